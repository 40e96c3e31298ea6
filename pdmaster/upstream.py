"""A lean HTTP/1.1 client for the engines: keep-alive pool, one write per request, response bodies
handed on from the socket callback.

Why not aiohttp's client: per engine request it builds a ClientRequest, a ClientResponse, a
StreamReader and timers, and every streamed event wakes a task that copies it on. The master makes
two engine requests per client request (P and D) and relays every event, and the profile showed that
machinery as the largest share of its CPU after the socket calls themselves (bench/README.md). Here a
response is parsed inside ``data_received`` and its body goes straight to a sink (the client's
transport), to a buffer, or nowhere (P's answer, which nobody reads).

Only what engines speak is supported: ``POST`` with a body, responses with Content-Length,
chunked transfer encoding, or a body that ends with the connection. No redirects, no proxies, no
compression (requests never ask for it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl as _ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

__all__ = ["EngineError", "EnginePool", "Exchange", "Origin", "origin"]

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
# An idle connection is dropped after this long: below uvicorn's default keep-alive (5 s), so a
# reused connection is not one the engine is closing at that moment (a POST is never retried).
IDLE_TIMEOUT_S = 2.0
MAX_IDLE_PER_ORIGIN = 1024


class EngineError(ConnectionError):
    """The engine could not be reached, broke the protocol, or closed the connection mid-response."""


@dataclass(frozen=True)
class Origin:
    host: str
    port: int
    tls: bool
    prefix: str  # path prefix of the endpoint, "" or "/something"
    host_header: bytes

    @property
    def address(self) -> tuple[str, int, bool]:
        """What connections are pooled by (endpoints differing only in prefix share them)."""
        return (self.host, self.port, self.tls)


@functools.lru_cache(maxsize=1024)
def origin(endpoint: str) -> Origin:
    """Parse an engine endpoint (``http://host:port[/prefix]``) once."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EngineError(f"engine endpoint must be http(s)://host[:port][/prefix], got {endpoint!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    return Origin(host, port, tls, parts.path.rstrip("/"), f"{shown}:{port}".encode())


# Body framing states.
_HEAD, _LENGTH, _UNTIL_EOF, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _DONE = range(8)
# What happens to body bytes.
_BUFFER, _DISCARD, _RELAY = range(3)


class Exchange:
    """One request and its response on one connection.

    ``await head()`` waits for the status line and headers. The body is buffered (``read()``),
    dropped (``send(discard=True)``), or handed to a sink as it arrives (``relay()``); ``wait()`` returns
    when the body is complete. ``abort()`` closes the connection under it (the engine sees the
    client go away); a finished exchange's connection goes back to the pool.
    """

    __slots__ = (
        "_body",
        "_conn",
        "_done_cb",
        "_head_fut",
        "_mode",
        "_sink",
        "_timer",
        "_wake",
        "content_type",
        "done",
        "error",
        "headers",
        "paused",
        "status",
    )

    def __init__(self, conn: _Connection, mode: int) -> None:
        self._conn: _Connection | None = conn
        self._mode = mode
        self._body = bytearray()
        self._sink: Callable[[bytes], None] | None = None
        self._head_fut: asyncio.Future[None] | None = None
        self._wake: asyncio.Future[None] | None = None
        self._done_cb: Callable[[Exchange], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.content_type = ""
        self.done = False
        self.paused = False
        self.error: BaseException | None = None

    # -- caller side ----------------------------------------------------------------------------
    async def head(self) -> None:
        if self.status or self.error is not None:
            if self.error is not None and not self.status:
                raise self.error
            return
        if self._head_fut is None:
            self._head_fut = asyncio.get_running_loop().create_future()
        await self._head_fut

    async def read(self) -> bytes:
        """The whole body (the exchange must be in buffer mode, the default)."""
        await self.wait()
        return bytes(self._body)

    async def wait(self) -> None:
        """Until the body is complete (or paused by ``pause()``); raises the exchange's error."""
        while not self.done:
            if self.paused:
                return
            self._wake = asyncio.get_running_loop().create_future()
            try:
                await self._wake
            finally:
                self._wake = None
        if self.error is not None:
            raise self.error

    def relay(self, sink: Callable[[bytes], None]) -> None:
        """Hand every body byte to ``sink`` from now on, starting with what is buffered."""
        self._mode = _RELAY
        self._sink = sink
        if self._body:
            pending = bytes(self._body)
            self._body.clear()
            sink(pending)

    def on_done(self, callback: Callable[[Exchange], None]) -> None:
        """``callback(self)`` once the exchange ends (``error`` is None on success)."""
        if self.done:
            callback(self)
        else:
            self._done_cb = callback

    def pause(self) -> None:
        """Stop reading the engine's socket (the client is slow); ``wait()`` returns at once."""
        if self.paused or self.done:
            return
        self.paused = True
        conn = self._conn
        if conn is not None and conn.transport is not None:
            conn.transport.pause_reading()
        self._wakeup()

    def resume(self) -> None:
        if not self.paused:
            return
        self.paused = False
        conn = self._conn
        if conn is not None and conn.transport is not None and not self.done:
            conn.transport.resume_reading()

    def abort(self, error: BaseException | None = None) -> None:
        """End the exchange now: its connection is closed, not reused."""
        if self.done:
            return
        conn = self._conn
        self._finish(error or EngineError("request aborted"))
        if conn is not None:
            conn.exchange = None
            conn.close()

    @property
    def body(self) -> bytes:
        return bytes(self._body)

    # -- connection side ------------------------------------------------------------------------
    def _on_head(self, status: int, headers: dict[bytes, bytes]) -> None:
        self.status = status
        self.headers = headers
        self.content_type = headers.get(b"content-type", b"").split(b";", 1)[0].strip().decode("latin-1")
        if status != 200 and self._mode == _DISCARD:
            self._mode = _BUFFER  # the error body explains the failure
        fut = self._head_fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _on_body(self, data: bytes) -> None:
        mode = self._mode
        if mode == _RELAY:
            assert self._sink is not None
            self._sink(data)
        elif mode == _BUFFER:
            self._body += data

    def _finish(self, error: BaseException | None) -> None:
        if self.done:
            return
        self.done = True
        self.error = error
        self._conn = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        fut = self._head_fut
        if fut is not None and not fut.done():
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)
                fut.exception()  # retrieved here: a caller that stopped waiting must not log it
        self._wakeup()
        cb = self._done_cb
        if cb is not None:
            self._done_cb = None
            cb(self)

    def _wakeup(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses the response to the exchange it carries."""

    def __init__(self, pool: EnginePool, key: Origin) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.closed = False
        self.idle_since = 0.0
        self._state = _DONE
        self._buf = bytearray()
        self._left = 0
        self._keep_alive = False

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # bytes nobody asked for: the connection is not reusable
            self.close()
            return
        try:
            self._feed(ex, data)
        except EngineError as exc:
            ex.abort(exc)
        except ValueError as exc:
            ex.abort(EngineError(f"malformed response from {self._where()}: {exc}"))
        except Exception as exc:  # a failing sink: end this exchange, never leave it hanging
            log.exception("relaying a response from %s failed", self._where())
            ex.abort(EngineError(f"relaying the response of {self._where()} failed: {exc!r}"))

    def eof_received(self) -> bool:
        ex = self.exchange
        if ex is not None and self._state == _UNTIL_EOF:
            self._complete(ex, reusable=False)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        ex = self.exchange
        self.exchange = None
        if ex is not None:
            if self._state == _UNTIL_EOF:
                ex._finish(None)
            else:
                why = f": {exc}" if exc else ""
                when = "before answering" if self._state == _HEAD else "mid-response"
                ex._finish(EngineError(f"{self._where()} closed the connection {when}{why}"))

    # -- use ----------------------------------------------------------------------------------------
    def send(self, request: bytes, mode: int, timeout_s: float | None) -> Exchange:
        if self.transport is None or self.transport.is_closing() or self.exchange is not None:
            raise EngineError(f"{self._where()}: connection closed before the request was sent")
        ex = Exchange(self, mode)
        self.exchange = ex
        self._state = _HEAD
        self._buf.clear()
        if timeout_s is not None:
            ex._timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, ex, timeout_s)
        self.transport.write(request)
        return ex

    def _expire(self, ex: Exchange, timeout_s: float) -> None:
        ex.abort(TimeoutError(f"{self._where()} did not answer in {timeout_s:g} s"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _where(self) -> str:
        return f"engine {self.key.host}:{self.key.port}"

    # -- parsing --------------------------------------------------------------------------------
    def _feed(self, ex: Exchange, data: bytes) -> None:
        if self._state == _HEAD:
            buf = self._buf
            buf += data
            while True:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise EngineError(f"{self._where()} sent a response head over {MAX_HEAD_BYTES} bytes")
                    return
                head = bytes(buf[:end])
                del buf[: end + 4]
                status, headers = self._parse_head(head)
                if status >= 200:
                    break
                # 1xx (100 Continue, 103 Early Hints): the real head follows
            data = bytes(buf)
            buf.clear()
            ex._on_head(status, headers)
            if self._state == _DONE:
                self._complete(ex, reusable=self._keep_alive and not data)
                return
            if not data or ex.done:
                return
        state = self._state
        if state == _LENGTH:
            n = len(data)
            if n < self._left:
                self._left -= n
                ex._on_body(data)
                return
            tail = data[self._left :] if n > self._left else b""
            ex._on_body(data[: self._left] if tail else data)
            self._left = 0
            self._complete(ex, reusable=self._keep_alive and not tail)
        elif state == _UNTIL_EOF:
            ex._on_body(data)
        else:
            self._chunked(ex, data)

    def _parse_head(self, head: bytes) -> tuple[int, dict[bytes, bytes]]:
        """Status and headers; for a final (non-1xx) head also sets how its body is framed."""
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ValueError(f"bad status line {lines[0][:80]!r}")
        status = int(parts[1])
        if not 100 <= status <= 999:
            raise ValueError(f"bad status {status}")
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ValueError(f"bad header line {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        if status < 200:
            return status, headers
        conn = headers.get(b"connection", b"").lower()
        self._keep_alive = parts[0] == b"HTTP/1.1" and b"close" not in conn
        te = headers.get(b"transfer-encoding")
        cl = headers.get(b"content-length")
        if status in (204, 304):
            self._state = _DONE
        elif te is not None and b"chunked" in te.lower():
            self._state = _CHUNK_SIZE
        elif cl is not None:
            self._left = int(cl)
            if self._left < 0:
                raise ValueError("negative Content-Length")
            self._state = _LENGTH if self._left else _DONE
        else:
            self._state = _UNTIL_EOF
            self._keep_alive = False
        return status, headers

    def _chunked(self, ex: Exchange, data: bytes) -> None:
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
                    if end - pos > 1024:
                        raise ValueError("chunk size line too long")
                    self._buf += data[pos:]
                    break
                size = int(data[pos:nl].split(b";", 1)[0], 16)
                if size < 0:
                    raise ValueError("negative chunk size")
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
                    raise ValueError("chunk not followed by CRLF")
                pos += 2
                state = _CHUNK_SIZE
            else:  # _TRAILER: lines until an empty one
                nl = data.find(b"\r\n", pos)
                if nl < 0:
                    if end - pos > MAX_HEAD_BYTES:
                        raise ValueError("trailer too long")
                    self._buf += data[pos:]
                    break
                if nl == pos:
                    pos += 2
                    state = _DONE
                    break
                pos = nl + 2
        self._state = state
        if out:
            ex._on_body(out[0] if len(out) == 1 else b"".join(out))
        if state == _DONE and not ex.done:
            self._complete(ex, reusable=self._keep_alive and pos == end)

    def _complete(self, ex: Exchange, *, reusable: bool) -> None:
        self._state = _DONE
        self.exchange = None
        ex._finish(None)
        if reusable and not ex.paused and self.transport is not None and not self.closed:
            self.pool._release(self)
        else:
            self.close()


class EnginePool:
    """Keep-alive connections to the engines, by origin; unlimited in number (admission bounds them)."""

    def __init__(self, *, connect_timeout_s: float = 5.0, timeout_s: float | None = 600.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self._idle: dict[tuple[str, int, bool], deque[_Connection]] = {}
        self._ssl: _ssl.SSLContext | None = None
        self._closed = False
        self.opened = 0  # connections made (tests check reuse with it)

    async def send(
        self,
        endpoint: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        discard: bool = False,
    ) -> Exchange:
        """POST one request; returns once it is written (``await ex.head()`` for the answer).

        ``discard``: drop the body as it arrives (a non-200 body is still kept for the error).
        """
        key = origin(endpoint)
        request = _request_bytes(key, path, body, headers)
        conn = self._idle_connection(key) or await self._connect(key)
        return conn.send(request, _DISCARD if discard else _BUFFER, self.timeout_s)

    async def close(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()

    def _idle_connection(self, key: Origin) -> _Connection | None:
        conns = self._idle.get(key.address)
        if not conns:
            return None
        now = time.monotonic()
        while conns:
            c = conns.pop()  # the most recently used: the least likely to have been closed
            if c.closed or c.transport is None or c.transport.is_closing():
                continue
            if now - c.idle_since > IDLE_TIMEOUT_S:
                c.close()
                # the rest are older still
                for old in conns:
                    old.close()
                conns.clear()
                return None
            return c
        return None

    async def _connect(self, key: Origin) -> _Connection:
        if self._closed:
            raise EngineError("engine pool is closed")
        loop = asyncio.get_running_loop()
        ssl_ctx: _ssl.SSLContext | None = None
        if key.tls:
            if self._ssl is None:
                self._ssl = _ssl.create_default_context()
            ssl_ctx = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key), key.host, key.port, ssl=ssl_ctx
                )
        except TimeoutError:
            raise EngineError(
                f"engine {key.host}:{key.port}: no connection in {self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise EngineError(f"engine {key.host}:{key.port} unreachable: {exc}") from exc
        self.opened += 1
        return conn

    def _release(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        conns = self._idle.get(conn.key.address)
        if conns is None:
            conns = self._idle[conn.key.address] = deque()
        if len(conns) >= MAX_IDLE_PER_ORIGIN:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        conns.append(conn)


def _request_bytes(key: Origin, path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    lines = [f"POST {key.prefix}{path} HTTP/1.1".encode(), b"Host: " + key.host_header]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}".encode("latin-1", "replace"))
    lines.append(b"Content-Length: %d" % len(body))
    lines.append(b"\r\n")
    return b"\r\n".join(lines) + body
