"""Engine health as node state: the agent's liveness verdict (pure), its wire field, and how the
master's registry folds health (agent-reported or breaker-open) into capacity and the live set."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from aiohttp import web

from nodeagent.probe import EngineHealth, check_health
from pdcoord.v1 import coordination_pb2 as pb
from pdmaster.registry import DECODE, PREFILL, NodeRegistry

sys.path.insert(0, str(Path(__file__).parents[1] / "frozen"))

import coordination_v0_pb2 as old


def test_three_failures_mark_down_two_successes_mark_up() -> None:
    h = EngineHealth(failures=3, successes=2)
    assert h.up
    assert not h.observe(False, "refused")
    assert not h.observe(False, "refused")
    assert not h.observe(True)  # a success breaks the streak
    assert not h.observe(False, "a")
    assert not h.observe(False, "b")
    assert h.observe(False, "timeout") and not h.up and h.reason == "timeout"
    assert not h.observe(False, "reset") and h.reason == "reset"  # the latest error is shown
    assert not h.observe(True) and not h.up
    assert h.observe(True) and h.up and h.reason == ""


def test_old_agent_messages_count_as_healthy_and_new_fields_round_trip() -> None:
    legacy = old.AgentMessage(report=old.Report(seq=3)).SerializeToString()
    parsed = pb.AgentMessage.FromString(legacy)
    assert parsed.report.engine_down is False and parsed.report.engine_reason == ""
    reg = old.AgentMessage(register=old.Register(node_id="d1")).SerializeToString()
    assert pb.AgentMessage.FromString(reg).register.engine_down is False
    new = pb.AgentMessage(report=pb.Report(seq=4, engine_down=True, engine_reason="refused"))
    back = old.AgentMessage.FromString(new.SerializeToString())  # an old master ignores them
    assert back.report.seq == 4


def _reg(r: NodeRegistry, node: str, role: str = DECODE, *, down: bool = False) -> int:
    _, stream = r.register(
        node_id=node,
        role=role,
        endpoint="http://127.0.0.1:1",
        running_max_req_size=8,
        grant=(4, 10),
        engine_down=down,
        engine_reason="refused" if down else "",
    )
    return stream


def test_agent_reported_down_removes_capacity_and_live_then_restores() -> None:
    r = NodeRegistry()
    seen: list[dict[str, int]] = []
    r.subscribe(seen.append)
    left: list[tuple[str, str]] = []
    r.on_node_left(lambda n, role: left.append((n, role)))
    s1 = _reg(r, "d1")
    _reg(r, "d2")
    sp = _reg(r, "p1", PREFILL)
    assert r.capacity == 8
    assert r.report_engine("d1", s1, True, "connection refused")
    assert r.capacity == 4 and seen[-1] == {"d2": 4}
    assert [n.node_id for n in r.live(DECODE)] == ["d2"]
    assert ("d1", DECODE) in left
    snap = {n["node_id"]: n for n in r.snapshot()}
    assert snap["d1"]["engine_up"] is False and snap["d1"]["engine_reason"] == "connection refused"
    assert snap["d1"]["share"] == 4 and snap["d1"]["effective_share"] == 0
    assert not r.report_engine("d1", s1, True, "still refused")  # no flip, no publish
    assert r.report_engine("d1", s1, False)
    assert r.capacity == 8 and seen[-1] == {"d1": 4, "d2": 4}
    # a prefill node that is down is never a candidate
    assert r.report_engine("p1", sp, True, "timeout")
    assert r.live(PREFILL) == []


def test_registered_down_counts_no_capacity() -> None:
    r = NodeRegistry()
    _reg(r, "d1", down=True)
    assert r.capacity == 0 and r.live(DECODE) == []


def test_breaker_open_removes_capacity_and_survives_a_reconnect() -> None:
    r = NodeRegistry()
    s1 = _reg(r, "d1")
    _reg(r, "d2")
    assert r.set_breaker("d1", "open", "refused")
    assert not r.set_breaker("d1", "open")
    assert r.capacity == 4 and [n.node_id for n in r.live(DECODE)] == ["d2"]
    assert r.snapshot()[0]["breaker_state"] == "open" and r.snapshot()[0]["engine_up"] is False
    r.disconnect("d1", s1)
    _reg(r, "d1")  # the agent reconnects: the master's own verdict on the engine holds
    assert r.capacity == 4
    assert r.set_breaker("d1", "half_open")
    assert r.capacity == 5  # one slot: room for exactly one lease, the trial
    assert r.set_breaker("d1", "closed")
    assert r.capacity == 8
    # either signal alone keeps the node out
    s1b = r.nodes["d1"].stream
    r.report_engine("d1", s1b, True)
    r.set_breaker("d1", "open")
    r.report_engine("d1", s1b, False)
    assert r.capacity == 4
    r.set_breaker("d1", "closed")
    assert r.capacity == 8
    assert r.set_breaker("unknown", "open")  # remembered for when it registers
    _reg(r, "unknown")
    assert r.capacity == 8


def test_check_health_against_a_real_server() -> None:
    async def main() -> tuple[str, str, str]:
        state = {"status": 200}

        async def health(_r: web.Request) -> web.Response:
            return web.Response(status=state["status"])

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        import aiohttp

        async with aiohttp.ClientSession() as s:
            ok = await check_health(f"http://127.0.0.1:{port}/health", s)
            state["status"] = 503
            bad = await check_health(f"http://127.0.0.1:{port}/health", s)
            await runner.cleanup()
            gone = await check_health(f"http://127.0.0.1:{port}/health", s)
        return ok, bad, gone

    ok, bad, gone = asyncio.run(main())
    assert ok == ""
    assert "503" in bad
    assert gone.startswith("GET ")


# -- timeouts by phase in the engine pool ----------------------------------------------------------


async def _raw_server(script: list[tuple[float, bytes]], closed: asyncio.Event) -> tuple[asyncio.Server, str]:
    """A server that reads a request, then writes each (delay, bytes) of ``script`` in turn and waits."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:
            for delay, data in script:
                await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
            await reader.read()  # until the client closes
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            closed.set()
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_pool_first_byte_timeout_ends_with_504_and_closes_the_connection() -> None:
    from pdmaster.engine import EngineError, EnginePool

    async def main() -> EngineError:
        closed = asyncio.Event()
        server, url = await _raw_server([], closed)  # never answers
        pool = EnginePool(first_byte_timeout_s=0.3, idle_timeout_s=5)
        try:
            ex = await pool.send(url, "/x", b"{}", {})
            try:
                await asyncio.wait_for(ex.head(), 10)
            except EngineError as exc:
                await asyncio.wait_for(closed.wait(), 10)  # the engine sees the request cancelled
                return exc
            raise AssertionError("no timeout")
        finally:
            await pool.close()
            server.close()

    exc = asyncio.run(main())
    assert exc.kind == "timeout" and exc.status == 504 and "no response byte" in exc.message


def test_pool_idle_gap_timeout_mid_stream_but_a_slow_steady_stream_lives() -> None:
    from pdmaster.engine import EngineError, EnginePool

    async def stalled() -> EngineError:
        closed = asyncio.Event()
        server, url = await _raw_server([(0, HEAD + b"5\r\nhello\r\n")], closed)  # then silence
        pool = EnginePool(first_byte_timeout_s=5, idle_timeout_s=0.3)
        try:
            ex = await pool.send(url, "/x", b"{}", {})
            await ex.head()
            try:
                await asyncio.wait_for(ex.wait(), 10)
            except EngineError as exc:
                await asyncio.wait_for(closed.wait(), 10)
                return exc
            raise AssertionError("no timeout")
        finally:
            await pool.close()
            server.close()

    exc = asyncio.run(stalled())
    assert exc.kind == "timeout" and exc.status == 504 and "mid-response" in exc.message

    async def steady() -> bytes:
        closed = asyncio.Event()
        chunks = [(0.0, HEAD)] + [(0.1, b"1\r\nx\r\n")] * 12 + [(0.1, b"0\r\n\r\n")]
        server, url = await _raw_server(chunks, closed)
        # the whole answer takes ~1.3 s, far beyond the idle gap: it is never cut while bytes flow
        pool = EnginePool(first_byte_timeout_s=5, idle_timeout_s=0.5)
        try:
            ex = await pool.send(url, "/x", b"{}", {})
            return await asyncio.wait_for(ex.read(), 10)
        finally:
            await pool.close()
            server.close()

    assert asyncio.run(steady()) == b"x" * 12
