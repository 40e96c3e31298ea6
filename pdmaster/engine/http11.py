"""A sans-I/O HTTP/1.1 response parser: bytes in, events out (in the manner of h11).

It knows nothing about sockets, so it can be fed one byte at a time in tests. ``feed(data)`` returns
the events the bytes complete, in order:

* a :class:`Head` (status and headers of a final response; 1xx heads are skipped),
* ``bytes``: a piece of the body (plain ``bytes`` rather than a wrapper object, because the master
  relays every streamed event through here and an allocation per piece shows in its profile),
* :data:`END`: the response is complete; :attr:`ResponseParser.reusable` then says whether the
  connection may carry another request.

Framing: ``Content-Length``, ``Transfer-Encoding: chunked`` (with trailers), or a body that ends with
the connection (call :meth:`ResponseParser.feed_eof`). Malformed input raises :class:`ParseError`.
"""

from __future__ import annotations

from typing import Final

__all__ = ["END", "MAX_HEAD_BYTES", "End", "Event", "Head", "ParseError", "ResponseParser"]

MAX_HEAD_BYTES = 64 * 1024
_MAX_CHUNK_LINE = 1024


class ParseError(ValueError):
    """The bytes are not a valid HTTP/1.1 response."""


class Head:
    __slots__ = ("headers", "keep_alive", "status")

    def __init__(self, status: int, headers: dict[bytes, bytes], keep_alive: bool) -> None:
        self.status = status
        self.headers = headers  # names lower-cased
        self.keep_alive = keep_alive

    @property
    def content_type(self) -> str:
        return self.headers.get(b"content-type", b"").split(b";", 1)[0].strip().decode("latin-1")

    def __repr__(self) -> str:
        return f"Head({self.status}, keep_alive={self.keep_alive})"


class End:
    __slots__ = ()

    def __repr__(self) -> str:
        return "END"


END: Final = End()
Event = Head | bytes | End

# Parser states.
_HEAD, _LENGTH, _UNTIL_EOF, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _DONE = range(8)


class ResponseParser:
    """Parses one response at a time; :meth:`start` readies it for the next one on the connection."""

    __slots__ = ("_buf", "_events", "_keep_alive", "_left", "_state", "reusable")

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._state = _DONE
        self._buf = bytearray()
        self._left = 0
        self._keep_alive = False
        self.reusable = False

    def start(self) -> None:
        """Expect a new response (after a request was sent)."""
        self._state = _HEAD
        self._buf.clear()
        self._left = 0
        self.reusable = False

    @property
    def awaiting_head(self) -> bool:
        return self._state == _HEAD

    @property
    def until_eof(self) -> bool:
        """The body ends with the connection: closing it completes the response."""
        return self._state == _UNTIL_EOF

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, data: bytes) -> list[Event]:
        """The events ``data`` completes. The list is reused by the next call: consume it first
        (a fresh list per call is a visible share of the master's CPU when it relays a stream)."""
        events = self._events
        events.clear()
        state = self._state
        if state == _DONE:
            if data:
                raise ParseError("bytes after the end of the response")
            return events
        if state == _HEAD:
            data = self._head(data, events)
            state = self._state
            if state == _DONE:
                self._end(events, extra=bool(data))
                return events
            if not data:
                return events
        if state == _LENGTH:
            n = len(data)
            if n < self._left:
                self._left -= n
                events.append(data)
                return events
            left = self._left
            events.append(data[:left] if n > left else data)
            self._left = 0
            self._end(events, extra=n > left)
        elif state == _UNTIL_EOF:
            events.append(data)
        else:
            self._chunked(data, events)
        return events

    def feed_eof(self) -> list[Event]:
        """The connection closed: completes an until-close body, otherwise the response is cut."""
        if self._state == _UNTIL_EOF:
            self._state = _DONE
            self.reusable = False
            return [END]
        if self._state == _DONE:
            return []
        raise ParseError("connection closed before the response was complete")

    # -- parts -------------------------------------------------------------------------------------
    def _end(self, events: list[Event], *, extra: bool) -> None:
        self._state = _DONE
        self.reusable = self._keep_alive and not extra
        events.append(END)

    def _head(self, data: bytes, events: list[Event]) -> bytes:
        buf = self._buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise ParseError(f"response head over {MAX_HEAD_BYTES} bytes")
                return b""
            raw = bytes(buf[:end])
            del buf[: end + 4]
            head = self._parse_head(raw)
            if head is not None:
                break
            # 1xx (100 Continue, 103 Early Hints): the real head follows
        rest = bytes(buf)
        buf.clear()
        events.append(head)
        return rest

    def _parse_head(self, raw: bytes) -> Head | None:
        lines = raw.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ParseError(f"bad status line {lines[0][:80]!r}")
        try:
            status = int(parts[1])
        except ValueError:
            raise ParseError(f"bad status line {lines[0][:80]!r}") from None
        if not 100 <= status <= 999:
            raise ParseError(f"bad status {status}")
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ParseError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        if status < 200:
            return None
        conn = headers.get(b"connection", b"").lower()
        keep_alive = parts[0] == b"HTTP/1.1" and b"close" not in conn
        te = headers.get(b"transfer-encoding")
        cl = headers.get(b"content-length")
        if status in (204, 304):
            self._state = _DONE
        elif te is not None and b"chunked" in te.lower():
            self._state = _CHUNK_SIZE
        elif cl is not None:
            try:
                self._left = int(cl)
            except ValueError:
                raise ParseError(f"bad Content-Length {cl[:40]!r}") from None
            if self._left < 0:
                raise ParseError("negative Content-Length")
            self._state = _LENGTH if self._left else _DONE
        else:
            self._state = _UNTIL_EOF
            keep_alive = False
        self._keep_alive = keep_alive
        return Head(status, headers, keep_alive)

    def _chunked(self, data: bytes, events: list[Event]) -> None:
        if self._buf:
            self._buf += data
            data = bytes(self._buf)
            self._buf.clear()
        state = self._state
        pos = 0
        end = len(data)
        out: list[bytes] = []
        while pos < end:
            if state == _CHUNK_DATA:
                take = min(self._left, end - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._left -= take
                if not self._left:
                    state = _CHUNK_END
            elif state == _CHUNK_SIZE:
                nl = data.find(b"\r\n", pos)
                if nl < 0:
                    if end - pos > _MAX_CHUNK_LINE:
                        raise ParseError("chunk size line too long")
                    self._buf += data[pos:]
                    break
                try:
                    size = int(data[pos:nl].split(b";", 1)[0], 16)
                except ValueError:
                    raise ParseError(f"bad chunk size line {data[pos:nl][:40]!r}") from None
                if size < 0:
                    raise ParseError("negative chunk size")
                pos = nl + 2
                if size:
                    self._left = size
                    state = _CHUNK_DATA
                else:
                    state = _TRAILER
            elif state == _CHUNK_END:
                if end - pos < 2:
                    self._buf += data[pos:]
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise ParseError("chunk not followed by CRLF")
                pos += 2
                state = _CHUNK_SIZE
            else:  # _TRAILER: lines until an empty one
                nl = data.find(b"\r\n", pos)
                if nl < 0:
                    if end - pos > MAX_HEAD_BYTES:
                        raise ParseError("trailer too long")
                    self._buf += data[pos:]
                    break
                if nl == pos:
                    pos += 2
                    state = _DONE
                    break
                pos = nl + 2
        self._state = state
        if out:
            events.append(out[0] if len(out) == 1 else b"".join(out))
        if state == _DONE:
            self._end(events, extra=pos != end)
