"""The lean engine client against real sockets: framing split at every byte, keep-alive, errors."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdmaster.engine import EngineError, EnginePool, origin


class RawServer:
    """A loopback server that answers each request with scripted bytes, written in given pieces."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.close_after = False
        self.requests: list[bytes] = []
        self.connections = 0
        self.disconnected = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.endpoint = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                for piece in self.pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
                if self.close_after:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnected.set()
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def raw() -> AsyncIterator[RawServer]:
    s = RawServer()
    await s.start()
    yield s
    await s.stop()


@contextlib.asynccontextmanager
async def scripted(
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    """A loopback engine answering each connection with ``serve``; yields its endpoint."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def pool(**kw: float | None) -> AsyncIterator[EnginePool]:
    p = EnginePool(**kw)  # type: ignore[arg-type]
    try:
        yield p
    finally:
        await p.close()


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


CHUNKED_BODY = b"data: one\n\n", b"data: two\n\n", b"x" * 300, b"data: [DONE]\n\n"


def chunked_response(trailer: bytes = b"") -> bytes:
    out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    out += b"Transfer-Encoding: chunked\r\n\r\n"
    for i, part in enumerate(CHUNKED_BODY):
        ext = b";name=v" if i == 1 else b""
        out += b"%x%s\r\n%s\r\n" % (len(part), ext, part)
    return out + b"0\r\n" + trailer + b"\r\n"


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12), trailer=st.booleans())
def test_chunked_body_survives_any_split(cuts: list[int], trailer: bool) -> None:
    async def run() -> None:
        s = RawServer()
        await s.start()
        try:
            s.pieces = split(chunked_response(b"X-Trailer: 1\r\n" if trailer else b""), cuts)
            async with pool() as p:
                for _ in range(2):  # the second request reuses the connection
                    ex = await p.send(s.endpoint, "/v1/completions", b"{}", {})
                    await ex.head()
                    assert ex.status == 200 and ex.content_type == "text/event-stream"
                    got: list[bytes] = []
                    ex.relay(got.append)
                    await ex.wait()
                    assert b"".join(got) == b"".join(CHUNKED_BODY)
                assert p.opened == 1 and s.connections == 1
        finally:
            await s.stop()

    asyncio.run(run())


async def test_content_length_and_until_eof_bodies(raw: RawServer) -> None:
    body = b'{"ok": true}'
    raw.pieces = [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n" + body]
    async with pool() as p:
        ex = await p.send(raw.endpoint + "/prefix", "/generate", b"{}", {"X-Request-Id": "r1"})
        assert await ex.read() == body
        assert raw.requests[0].startswith(b"POST /prefix/generate HTTP/1.1\r\n")
        assert b"X-Request-Id: r1\r\n" in raw.requests[0] and b"Content-Length: 2\r\n" in raw.requests[0]
        raw.pieces = [b"HTTP/1.0 200 OK\r\n\r\n", b"all of ", b"it"]
        raw.close_after = True
        ex = await p.send(raw.endpoint, "/x", b"", {})
        assert await ex.read() == b"all of it"
        raw.pieces = [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]
        ex = await p.send(raw.endpoint, "/x", b"", {})
        assert await ex.read() == b"ok"
        assert p.opened == 2  # the until-close body cost its connection


async def test_error_status_keeps_the_body_even_when_discarding(raw: RawServer) -> None:
    raw.pieces = [b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nfull"]
    async with pool() as p:
        ex = await p.send(raw.endpoint, "/x", b"{}", {}, discard=True)
        await ex.wait()
        assert ex.status == 503 and ex.body == b"full"


@pytest.mark.parametrize(
    "answer",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nbroken header\r\n\r\n",
    ],
)
async def test_malformed_answers_are_engine_errors(raw: RawServer, answer: bytes) -> None:
    raw.pieces = [answer]
    async with pool() as p:
        ex = await p.send(raw.endpoint, "/x", b"{}", {})
        with pytest.raises(EngineError):
            await ex.head()
            await ex.wait()


async def test_connection_lost_mid_body_and_unreachable_engine(raw: RawServer) -> None:
    raw.pieces = [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"]
    raw.close_after = True
    async with pool() as p:
        ex = await p.send(raw.endpoint, "/x", b"{}", {})
        await ex.head()
        with pytest.raises(EngineError, match="mid-response"):
            await ex.wait()
        with pytest.raises(EngineError, match="unreachable"):
            await p.send("http://127.0.0.1:1", "/x", b"", {})


async def test_timeout_and_abort_close_the_connection(raw: RawServer) -> None:
    raw.pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"]  # never ends
    async with pool(timeout_s=0.3) as p:
        ex = await p.send(raw.endpoint, "/x", b"{}", {})
        await ex.head()
        with pytest.raises(EngineError) as info:
            await asyncio.wait_for(ex.wait(), 5)
        assert info.value.kind == "timeout" and info.value.status == 504
        await asyncio.wait_for(raw.disconnected.wait(), 5)
    raw.disconnected.clear()
    async with pool() as p:
        ex = await p.send(raw.endpoint, "/x", b"{}", {})
        await ex.head()
        ex.abort()
        await asyncio.wait_for(raw.disconnected.wait(), 5)
        assert ex.done and isinstance(ex.error, EngineError)


async def test_first_byte_and_idle_timeouts_by_phase() -> None:
    """Silence before the head ends in a first-byte timeout; a stream that keeps sending lives longer
    than the idle timeout, and ends only once it stalls; the watchdog stops when nothing is in flight."""
    stall = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if b"/silent" not in head:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(8):  # 1.2 s of events, each gap well below the idle timeout
                writer.write(b"1\r\nx\r\n")
                await writer.drain()
                await asyncio.sleep(0.15)
        stall.set()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the client gives up
        writer.close()

    async with scripted(serve) as endpoint, pool(first_byte_timeout_s=0.5, idle_timeout_s=0.6) as p:
        ex = await p.send(endpoint, "/silent", b"{}", {})
        with pytest.raises(EngineError, match="no response byte") as info:
            await asyncio.wait_for(ex.head(), 10)
        assert info.value.kind == "timeout" and info.value.status == 504

        got: list[bytes] = []
        ex = await p.send(endpoint, "/stream", b"{}", {})
        await asyncio.wait_for(ex.head(), 10)
        ex.relay(got.append)
        with pytest.raises(EngineError, match="mid-response") as info:
            await asyncio.wait_for(ex.wait(), 10)
        assert info.value.kind == "timeout" and stall.is_set()
        assert b"".join(got) == b"x" * 8  # not cut while bytes kept coming
        assert not p._watched
        await asyncio.sleep(3 * p.tick)
        assert p._watchdog is None  # no timer wakes an idle master


@pytest.mark.parametrize("body_later", [False, True])
async def test_a_relayed_exchange_leaves_no_reference_cycle(body_later: bool) -> None:
    """The master relays every stream through a sink that closes over the response holding the
    exchange; the exchange must let go of it when it ends (whether the body was complete before the
    relay began or arrives through it), or every request's objects wait for the cycle collector
    (which then cost the master a tenth of its CPU)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        if body_later:
            await writer.drain()
            await asyncio.sleep(0.2)  # the client relays by now
        writer.write(b"hello")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()
        writer.close()

    got: list[bytes] = []

    async def relay(p: EnginePool, endpoint: str) -> None:
        ex = await p.send(endpoint, "/x", b"{}", {})
        await ex.head()

        def sink(data: bytes) -> None:  # like relay_stream's: it reaches the exchange
            got.append(data)
            assert ex is not None

        ex.relay(sink)
        await ex.wait()

    async with scripted(serve) as endpoint, pool() as p:
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            await relay(p, endpoint)
            gc.collect()
            cyclic = [o for o in gc.garbage if type(o).__name__ == "Exchange"]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert b"".join(got) == b"hello"
    assert not cyclic


async def test_a_stall_after_the_first_bytes_ends_at_the_idle_timeout_not_the_first_byte_one(
    raw: RawServer,
) -> None:
    """A stream that stops after its first chunk: the idle timeout ends it, long before the (much
    longer) first-byte timeout, whose timer was armed when the request was sent."""
    raw.pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"]  # then nothing
    async with pool(first_byte_timeout_s=60, idle_timeout_s=0.3) as p:
        ex = await p.send(raw.endpoint, "/x", b"{}", {})
        await ex.head()
        with pytest.raises(EngineError) as info:
            await asyncio.wait_for(ex.wait(), 20)  # generous, and still a third of the first-byte one
        assert info.value.kind == "timeout" and info.value.status == 504
        assert "mid-response" in info.value.message
        await asyncio.wait_for(raw.disconnected.wait(), 5)


async def test_header_injection_is_refused(raw: RawServer) -> None:
    async with pool() as p:
        with pytest.raises(ValueError, match="line break"):
            await p.send(raw.endpoint, "/x", b"", {"X-Request-Id": "a\r\nEvil: 1"})


def test_origin_parsing() -> None:
    o = origin("http://[::1]:8080/p/")
    assert (o.host, o.port, o.tls, o.prefix, o.host_header) == ("::1", 8080, False, "/p", b"[::1]:8080")
    assert origin("https://engine").port == 443
    with pytest.raises(EngineError, match="http"):
        origin("ftp://x")


async def test_pause_stops_reading_until_resume() -> None:
    """Flow control against an aiohttp engine streaming 2 MiB: pausing stops the relay."""
    block = b"y" * 65536

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for _ in range(32):
            await resp.write(block)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/s", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with pool() as p:
            ex = await p.send(f"http://127.0.0.1:{port}", "/s", b"", {})
            await ex.head()
            got = bytearray()
            paused_once = False

            def sink(data: bytes) -> None:
                nonlocal paused_once
                got.extend(data)
                if len(got) >= 4 * len(block) and not paused_once:
                    paused_once = True
                    ex.pause()

            ex.relay(sink)
            await ex.wait()
            assert ex.paused and not ex.done
            held = len(got)
            await asyncio.sleep(0.2)
            assert len(got) - held < 512 * 1024  # at most what was already in flight
            ex.resume()
            await asyncio.wait_for(ex.wait(), 10)
            assert ex.done and len(got) == 32 * len(block)
    finally:
        await runner.cleanup()
