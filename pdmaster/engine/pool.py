"""The engine connection pool: keep-alive HTTP/1.1 connections, one write per request, response bodies
handed on from the socket callback.

Why not aiohttp's client: per engine request it builds a ClientRequest, a ClientResponse, a
StreamReader and timers, and every streamed event wakes a task that copies it on. The master makes
two engine requests per client request (P and D) and relays every event, and the profile showed that
machinery as the largest share of its CPU after the socket calls themselves (bench/README.md). Here a
response is parsed (by :mod:`pdmaster.engine.http11`) inside ``data_received`` and its body goes
straight to a sink (the client's transport), to a buffer, or nowhere (P's answer, which nobody reads).

Only what engines speak is supported: ``POST`` with a body; no redirects, no proxies, no compression
(requests never ask for it).
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

from pdmaster.engine.errors import EngineError
from pdmaster.engine.http11 import Head, ParseError, ResponseParser

__all__ = ["EnginePool", "Exchange", "Origin", "origin"]

log = logging.getLogger(__name__)

# An idle connection is dropped after this long: below uvicorn's default keep-alive (5 s), so a
# reused connection is not one the engine is closing at that moment (a POST is never retried).
IDLE_TIMEOUT_S = 2.0
MAX_IDLE_PER_ORIGIN = 1024


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
        raise EngineError(
            f"engine endpoint must be http(s)://host[:port][/prefix], got {endpoint!r}", kind="config"
        )
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    return Origin(host, port, tls, parts.path.rstrip("/"), f"{shown}:{port}".encode())


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
        "_deadline",
        "_done_cb",
        "_fresh",
        "_got_bytes",
        "_head_fut",
        "_last_bytes",
        "_mode",
        "_sent_at",
        "_sink",
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
        # Timeouts by phase (loop.time()): sent, last bytes seen by the watchdog, the total cap (inf:
        # none). The socket callback only raises ``_fresh``; the watchdog turns it into a time.
        self._sent_at = 0.0
        self._last_bytes = 0.0
        self._deadline = float("inf")
        self._got_bytes = False
        self._fresh = False
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.content_type = ""
        self.done = False
        self.paused = False
        self.error: EngineError | None = None

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
        if not self.done:
            self._sink = sink  # kept only while bytes may come (see _finish)
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
        self._last_bytes = asyncio.get_running_loop().time()  # the idle gap counts from here
        conn = self._conn
        if conn is not None and conn.transport is not None and not self.done:
            conn.transport.resume_reading()

    def abort(self, error: EngineError | None = None) -> None:
        """End the exchange now: its connection is closed, not reused."""
        if self.done:
            return
        conn = self._conn
        self._finish(error or EngineError("request aborted", kind="aborted"))
        if conn is not None:
            conn.exchange = None
            conn.close()

    @property
    def body(self) -> bytes:
        return bytes(self._body)

    # -- connection side ------------------------------------------------------------------------
    def _on_head(self, head: Head) -> None:
        self.status = head.status
        self.headers = head.headers
        self.content_type = head.content_type
        if head.status != 200 and self._mode == _DISCARD:
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

    def _finish(self, error: EngineError | None) -> None:
        if self.done:
            return
        self.done = True
        self.error = error
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.pool._unwatch(self)
        # The sink closes over the response that holds this exchange: drop it, so that the request's
        # objects go with their last reference instead of waiting for the cycle collector.
        self._sink = None
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
    """One keep-alive connection; feeds the parser and hands its events to the exchange it carries."""

    def __init__(self, pool: EnginePool, key: Origin) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.closed = False
        self.idle_since = 0.0
        self.parser = ResponseParser()
        self.loop = asyncio.get_running_loop()

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # bytes nobody asked for: the connection is not reusable
            self.close()
            return
        ex._fresh = True
        try:
            for event in self.parser.feed(data):
                if event.__class__ is bytes:
                    ex._on_body(event)
                elif event.__class__ is Head:
                    ex._on_head(event)
                else:
                    self._complete(ex, reusable=self.parser.reusable)
                if ex.done:
                    break
        except ParseError as exc:
            ex.abort(EngineError(f"malformed response from {self._where()}: {exc}", kind="protocol"))
        except Exception as exc:  # a failing sink: end this exchange, never leave it hanging
            log.exception("relaying a response from %s failed", self._where())
            ex.abort(EngineError(f"relaying the response of {self._where()} failed: {exc!r}"))

    def eof_received(self) -> bool:
        ex = self.exchange
        if ex is not None and self.parser.until_eof:
            self.parser.feed_eof()
            self._complete(ex, reusable=False)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        ex = self.exchange
        self.exchange = None
        if ex is not None:
            if self.parser.until_eof:
                ex._finish(None)
            else:
                why = f": {exc}" if exc else ""
                when = "before answering" if self.parser.awaiting_head else "mid-response"
                ex._finish(EngineError(f"{self._where()} closed the connection {when}{why}"))

    # -- use ----------------------------------------------------------------------------------------
    def send(self, request: bytes, mode: int) -> Exchange:
        if self.transport is None or self.transport.is_closing() or self.exchange is not None:
            raise EngineError(f"{self._where()}: connection closed before the request was sent")
        ex = Exchange(self, mode)
        self.exchange = ex
        self.parser.start()
        now = self.loop.time()
        ex._sent_at = ex._last_bytes = now
        if self.pool.timeout_s is not None:
            ex._deadline = now + self.pool.timeout_s
        self.pool._watch(ex)
        self.transport.write(request)
        return ex

    def _check(self, ex: Exchange, now: float) -> None:
        """The watchdog's look at one exchange: end it when a phase took too long."""
        pool = self.pool
        if ex._fresh:
            ex._fresh = False
            ex._got_bytes = True
            ex._last_bytes = now
        if now >= ex._deadline:
            self._expire(ex, f"did not finish in {pool.timeout_s:g} s")
        elif not ex._got_bytes:
            if now - ex._sent_at >= pool.first_byte_timeout_s:
                self._expire(ex, f"sent no response byte in {pool.first_byte_timeout_s:g} s")
        elif ex.paused:
            ex._last_bytes = now  # our client is slow, not the engine
        elif now - ex._last_bytes >= pool.idle_timeout_s:
            self._expire(ex, f"sent nothing for {pool.idle_timeout_s:g} s mid-response")

    def _expire(self, ex: Exchange, what: str) -> None:
        # Closing the connection is what cancels the request inside the engine.
        ex.abort(EngineError(f"{self._where()} {what}", status=504, kind="timeout"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _where(self) -> str:
        return f"engine {self.key.host}:{self.key.port}"

    def _complete(self, ex: Exchange, *, reusable: bool) -> None:
        self.exchange = None
        ex._finish(None)
        if reusable and not ex.paused and self.transport is not None and not self.closed:
            self.pool._release(self)
        else:
            self.close()


class EnginePool:
    """Keep-alive connections to the engines, by origin; unlimited in number (admission bounds them)."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        first_byte_timeout_s: float = 300.0,
        idle_timeout_s: float = 120.0,
        timeout_s: float | None = None,
    ) -> None:
        """Timeouts by phase: connecting; from the request written to the engine's first response
        byte (a long prompt prefills slowly); the longest gap between two chunks of the response while
        the client keeps up. ``timeout_s`` caps a whole exchange; off by default, because a long
        generation that keeps streaming is healthy however long it runs."""
        self.connect_timeout_s = connect_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.timeout_s = timeout_s
        # Timeouts by phase are checked by one watchdog timer per pool, while exchanges are in
        # flight, every ``tick`` seconds: an eighth of the shortest timeout, at most a second. A
        # timer per exchange (armed, re-armed, cancelled) cost more than the check; a timeout
        # fires at most two ticks late, which is noise against timeouts of seconds to minutes.
        shortest = min(first_byte_timeout_s, idle_timeout_s, timeout_s or idle_timeout_s)
        self.tick = min(max(shortest / 8, 0.01), 1.0)
        self._watched: set[Exchange] = set()
        self._watchdog: asyncio.TimerHandle | None = None
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
        check: Callable[[], None] | None = None,
    ) -> Exchange:
        """POST one request; returns once it is written (``await ex.head()`` for the answer).

        ``discard``: drop the body as it arrives (a non-200 body is still kept for the error).
        ``check``: called with a connection in hand, just before the request is written (nothing
        awaits between the two); what it raises stops the request, and the connection stays idle.
        """
        key = origin(endpoint)
        request = _request_bytes(key, path, body, headers)
        conn = self._idle_connection(key) or await self._connect(key)
        if check is not None:
            try:
                check()
            except BaseException:
                self._release(conn)
                raise
        return conn.send(request, _DISCARD if discard else _BUFFER)

    def _watch(self, ex: Exchange) -> None:
        self._watched.add(ex)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(self.tick, self._sweep)

    def _unwatch(self, ex: Exchange) -> None:
        self._watched.discard(ex)

    def _sweep(self) -> None:
        self._watchdog = None
        if not self._watched:
            return  # idle: no timer until the next request
        now = asyncio.get_running_loop().time()
        for ex in list(self._watched):  # an exchange that ends (here or meanwhile) unwatches itself
            conn = ex._conn
            if conn is not None:
                conn._check(ex, now)
        if self._watched:
            self._watchdog = asyncio.get_running_loop().call_later(self.tick, self._sweep)

    async def close(self) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
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
            raise EngineError("engine pool is closed", kind="aborted")
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
                f"engine {key.host}:{key.port}: no connection in {self.connect_timeout_s:g} s",
                status=504,
                kind="connect",
            ) from None
        except OSError as exc:
            raise EngineError(f"engine {key.host}:{key.port} unreachable: {exc}", kind="connect") from exc
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
