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

sys.path.insert(0, str(Path(__file__).parent / "frozen"))

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
    assert r.set_breaker("d1", True)
    assert not r.set_breaker("d1", True)
    assert r.capacity == 4 and [n.node_id for n in r.live(DECODE)] == ["d2"]
    r.disconnect("d1", s1)
    _reg(r, "d1")  # the agent reconnects: the master's own verdict on the engine holds
    assert r.capacity == 4
    assert r.set_breaker("d1", False)
    assert r.capacity == 8
    # either signal alone keeps the node out
    s1b = r.nodes["d1"].stream
    r.report_engine("d1", s1b, True)
    r.set_breaker("d1", True)
    r.report_engine("d1", s1b, False)
    assert r.capacity == 4
    r.set_breaker("d1", False)
    assert r.capacity == 8
    assert r.set_breaker("unknown", True)  # remembered for when it registers


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
