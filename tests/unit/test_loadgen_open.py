"""pdcoord.dev.loadgen's open-loop load: schedules, the sticky balancer, trace replay and synthetic
sessions (pure), summarize(), and the driver against a local fake server and a real pdsim."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from pdcoord.dev.loadgen import (
    CONN_FAILED,
    HANG,
    OpenLoop,
    OpenLoopConfig,
    RequestRecord,
    main,
    open_arrivals,
    open_parser,
    summarize,
)
from pdcoord.dev.netutil import free_port
from pdcoord.dev.workload import (
    Balancer,
    Schedule,
    SyntheticConfig,
    Target,
    Turn,
    block_text,
    load_trace,
    parse_targets,
    poisson_times,
    synthetic_arrivals,
    synthetic_session,
    tokens_of,
    trace_arrivals,
    trace_prompt,
)

REPO = Path(__file__).resolve().parents[2]
MOONCAKE = REPO / "bench/traces/mooncake-fast25/conversation_trace.jsonl"


# ---------------------------------------------------------------------------- schedules and arrivals


def test_schedule_multipliers_and_warp() -> None:
    s = Schedule.parse("0:60:1.0,60:120:2.5,120:200:0.7")
    assert [s.multiplier(t) for t in (0, 59.9, 60, 119, 150, 200, 1e6)] == [1.0, 1.0, 2.5, 2.5, 0.7, 1.0, 1.0]
    assert s.cumulative(60) == 60 and s.cumulative(120) == pytest.approx(210)
    assert s.cumulative(200) == pytest.approx(266)
    for tau in (0.0, 10.0, 60.0, 100.0, 210.0, 250.0, 266.0, 300.0):
        assert s.cumulative(s.warp(tau)) == pytest.approx(tau)
    assert s.warp(60 + 150) == pytest.approx(120)  # 2.5x: 150 base seconds in 60 real ones
    # gaps are 1.0, a 0 multiplier pauses, overlaps and nonsense are refused
    g = Schedule.parse("10:20:0")
    assert g.warp(5) == 5 and g.warp(10.0) == 10 and g.warp(10.5) == pytest.approx(20.5)
    assert Schedule.parse(None).warp(42.0) == 42.0
    for bad in ("0:10:1,5:20:2", "10:5:1", "0:10:-1", "0:10"):
        with pytest.raises(ValueError):
            Schedule.parse(bad)


def test_poisson_is_seeded_and_the_schedule_shapes_its_rate() -> None:
    a = [t for _, t in zip(range(200), poisson_times(5.0, random.Random(7)), strict=False)]
    b = [t for _, t in zip(range(200), poisson_times(5.0, random.Random(7)), strict=False)]
    assert a == b and a == sorted(a)
    assert 0.15 < a[-1] / 200 < 0.25  # mean gap 1/5 s
    s = Schedule.parse("0:100:1,100:200:3,200:300:0.5")
    times = []
    for tau in poisson_times(10.0, random.Random(3)):
        t = s.warp(tau)
        if t >= 300:
            break
        times.append(t)
    per = Counter(int(t // 100) for t in times)
    assert 800 < per[0] < 1200 and 2600 < per[1] < 3400 and 400 < per[2] < 600, per


# ---------------------------------------------------------------------------- balancer


def test_sticky_balancer_is_stable_and_respects_weights() -> None:
    targets = parse_targets("http://a:1,http://b:2/,http://c:3", "0.7,0.2,0.1")
    assert [t.url for t in targets] == ["http://a:1", "http://b:2", "http://c:3"]
    one, two = Balancer(targets, seed=1), Balancer(targets, seed=2)
    sids = [f"session-{i}" for i in range(6000)]
    picks = [one.pick(s).name for s in sids]
    assert picks == [two.pick(s).name for s in sids]  # a hash, not the process's random state
    assert picks == [one.pick(s).name for s in sids]  # every turn of a session goes to one target
    share = Counter(picks)
    for t, w in zip(targets, (0.7, 0.2, 0.1), strict=True):
        assert abs(share[t.name] / len(sids) - w) < 0.03, share
    # without a session: weighted random; a zero weight gets nothing
    zero = Balancer(parse_targets("http://a:1,http://b:2", "1,0"))
    assert {zero.pick(None).name for _ in range(200)} == {"http://a:1"}
    assert {zero.pick(s).name for s in sids[:200]} == {"http://a:1"}
    lb = Balancer(parse_targets("http://a:1,http://b:2"))
    even = Counter(lb.pick(None).name for _ in range(2000))
    assert 800 < even["http://a:1"] < 1200
    # a refused request goes to the session's next target, the same one every time; none is left once
    # every target refused
    for s in sids[:200]:
        first = one.pick(s)
        nxt = one.next_after(s, [first])
        assert nxt is not None and nxt != first and nxt == two.next_after(s, [first])
        assert one.next_after(s, one.targets) is None
    assert one.next_after(None, [targets[0], targets[1]]) == targets[2]
    for bad in ("1", "1,-1", "0,0"):
        with pytest.raises(ValueError):
            parse_targets("http://a:1,http://b:2", bad)


# ---------------------------------------------------------------------------- trace replay


def write_trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    with open(path, "w") as f:
        for ts, inp, out, hids in rows:
            f.write(
                json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": hids})
                + "\n"
            )
    return path


def test_trace_sessions_follow_shared_prefixes(tmp_path: Path) -> None:
    rows = [
        (0, 1200, 10, [0, 1, 2]),  # 0: root; its block 2 is partial (1200 = 2*512 + 176)
        (500, 1100, 20, [0, 5, 6]),  # 1: shares only block 0 with 0: a new session
        (1000, 2000, 30, [0, 1, 7, 8]),  # 2: extends 0's full blocks [0, 1]: turn 1 of 0
        (1500, 2048, 40, [0, 1, 7, 8]),  # 3: the same prompt as 2 (all full): turn 2 of 0
        (2000, 2500, 50, [0, 1, 7, 8, 9]),  # 4: extends 3 (2048 = 4 full blocks): turn 3 of 0
        (2500, 600, 60, [0, 11]),  # 5: only block 0 plus a partial one: a new session
        (3000, 1100, 70, [0, 5, 12]),  # 6: 1's full blocks are [0, 5]: turn 1 of 1
        (3500, 900, 80, [0, 13]),  # 7: nothing shared beyond block 0
    ]
    reqs = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    assert [(r.root, r.parent, r.turn) for r in reqs] == [
        (0, None, 0), (1, None, 0), (0, 0, 1), (0, 2, 2), (0, 3, 3), (5, None, 0), (1, 1, 1), (7, None, 0),
    ]  # fmt: skip
    assert [r.timestamp_s for r in reqs][:3] == [0.0, 0.5, 1.0]
    # a window: timestamps from its start, sessions only within it (the server never saw the rest)
    win = load_trace(tmp_path / "t.jsonl", start_s=1.5, duration_s=1.6)
    assert [r.timestamp_s for r in win] == [0.0, 0.5, 1.0, 1.5]
    assert [(r.root, r.turn) for r in win] == [(0, 0), (0, 1), (2, 0), (3, 0)]

    arrivals = list(trace_arrivals(reqs, speed=2.0, max_input_tokens=2000, tag="t"))
    assert [a.at_s for a in arrivals][:3] == [0.0, 0.25, 0.5]
    turns = [a.turns[0] for a in arrivals]
    assert [t.session_id for t in turns][:5] == ["t-0", "t-1", "t-0", "t-0", "t-0"]
    assert [t.is_continuation for t in turns] == [False, False, True, True, True, False, True, False]
    assert [t.max_tokens for t in turns] == [10, 20, 30, 40, 50, 60, 70, 80]
    assert [(t.input_tokens, t.clipped) for t in turns][2:5] == [(2000, False), (2000, True), (2000, True)]
    assert all(t.kind == "trace" and t.n == 1 and t.turn == r.turn for t, r in zip(turns, reqs, strict=True))
    msgs = turns[4].messages()
    assert len(msgs) == 1 and msgs[0]["role"] == "user" and tokens_of(msgs) == 2000
    # a scheduled replay: 2x from 0.5 s on, so the rest arrives twice as fast
    warped = [a.at_s for a in trace_arrivals(reqs, schedule=Schedule.parse("0.5:100:2"))]
    assert warped[:3] == [0.0, 0.5, 0.75] and warped[-1] == pytest.approx(0.5 + 3.0 / 2)


def test_trace_prompts_share_exactly_the_shared_blocks() -> None:
    a = trace_prompt([0, 1, 2, 3], 1800)
    b = trace_prompt([0, 1, 2, 9, 10], 2300)
    c = trace_prompt([0, 1, 2, 3], 1800)
    assert len(a) == 1800 * 4 and len(b) == 2300 * 4 and a == c
    assert a[: 3 * 2048] == b[: 3 * 2048]
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert 3 * 2048 <= common < 3 * 2048 + 4  # differ within the first characters of the block
    # distinct blocks: consecutive ids differ at their first character, all within a few
    for i in range(0, 200_000, 997):
        x, y = block_text(i), block_text(i + 1)
        assert len(x) == 2048 and x[0] != y[0]
        z = block_text(i + 36 * 37)
        assert next(k for k, (p, q) in enumerate(zip(x, z, strict=True)) if p != q) < 4
    assert block_text(5) == block_text(5)
    assert trace_prompt([0, 1], 600) == block_text(0) + block_text(1)[: 600 * 4 - 2048]


def test_the_shipped_mooncake_trace() -> None:
    reqs = load_trace(MOONCAKE)
    assert len(reqs) == 12031
    assert reqs[-1].timestamp_s == pytest.approx(3536.999)
    cont = sum(1 for r in reqs if r.turn > 0)
    assert 3500 < cont < 4500  # about a third continue an earlier conversation
    assert all(r.hash_ids[0] == 0 for r in reqs)
    for name in ("LICENSE", "README.md", "NOTICE"):
        assert (MOONCAKE.parent / name).is_file()


def test_a_burst_replays_more_of_the_trace_not_the_same_window_faster() -> None:
    """A schedule above 1x consumes trace time faster: the replayed window must cover the whole
    run (a burst once used up its window two thirds of the way through and sent nothing more)."""
    args = open_parser().parse_args(
        [
            "--targets",
            "http://127.0.0.1:1",
            "--trace",
            str(MOONCAKE),
            "--rate",
            "4",
            "--duration",
            "140",
            "--schedule",
            "0:20:1,20:80:2.5,80:140:0.7",
        ]
    )
    arrivals = list(open_arrivals(args)[0])
    times = [a.at_s for a in arrivals]
    assert max(times) > 130  # arrivals until the end of the run
    after = [t for t in times if 80 <= t < 140]
    during = [t for t in times if 20 <= t < 80]
    assert len(during) > 2 * len(after) > 0  # 2.5x during the burst, 0.7x after it


# ---------------------------------------------------------------------------- synthetic sessions


def test_synthetic_sessions_grow_and_are_seeded() -> None:
    cfg = SyntheticConfig(session_rate=2.0, system_tokens=300, first_user_median_tokens=200)
    turns, thinks = synthetic_session(cfg, 5, 3)
    again, thinks2 = synthetic_session(cfg, 5, 3)
    assert [t.messages() for t in turns] == [t.messages() for t in again] and thinks == thinks2
    assert 2 <= len(turns) <= 6 and len(thinks) == len(turns) - 1 and all(x >= 0 for x in thinks)
    assert {t.session_id for t in turns} == {"syn5-3"} and [t.turn for t in turns] == list(range(len(turns)))
    assert [t.is_continuation for t in turns] == [False] + [True] * (len(turns) - 1)
    assert all(t.session_turns == len(turns) for t in turns)
    prev = turns[0].messages()
    assert [m["role"] for m in prev] == ["system", "user"] and len(prev[0]["content"]) == 300 * 4
    for before, turn in itertools.pairwise(turns):
        msgs = turn.messages()
        assert msgs[: len(prev)] == prev  # the conversation so far, unchanged
        assert [m["role"] for m in msgs[len(prev) :]] == ["assistant", "user"]
        assert len(msgs[len(prev)]["content"]) == before.max_tokens * 4  # the answer it asked for
        assert turn.input_tokens == tokens_of(msgs) > before.input_tokens
        prev = msgs
    # many sessions: a few shared system prompts, about 10% gangs of 4, lengths in range
    many = [t for k in range(400) for t in synthetic_session(cfg, 5, k)[0]]
    systems = {t.messages()[0]["content"] for t in many if t.turn == 0}
    assert len(systems) == cfg.system_prompts
    gangs = sum(1 for t in many if t.n == 4)
    assert all(t.n in (1, 4) for t in many) and 0.06 < gangs / len(many) < 0.14
    assert all(80 <= t.max_tokens <= 350 for t in many)
    # arrivals: Poisson at session_rate, deterministic, the schedule applied
    arr = [a for _, a in zip(range(300), synthetic_arrivals(cfg, 5), strict=False)]
    assert [a.at_s for a in arr] == [
        a.at_s for _, a in zip(range(300), synthetic_arrivals(cfg, 5), strict=False)
    ]
    assert 120 < arr[-1].at_s < 180
    assert arr[3].turns[0].messages() == synthetic_session(cfg, 5, 3)[0][0].messages()
    fast = [
        a for _, a in zip(range(300), synthetic_arrivals(cfg, 5, Schedule.parse("0:1000:2")), strict=False)
    ]
    assert [a.at_s for a in fast] == pytest.approx([a.at_s / 2 for a in arr])


# ---------------------------------------------------------------------------- summarize


def rec(seq: int, **kw: object) -> RequestRecord:
    base: dict[str, object] = dict(seq=seq, kind="synthetic", target="a", t_sched=0.0, t_send=0.0, t_end=1.0,
                                   ttft_s=0.2, tpot_s=0.01, status=200)  # fmt: skip
    base.update(kw)
    return RequestRecord(**base)  # type: ignore[arg-type]


def test_summarize_hand_made_records() -> None:
    records = [
        rec(1, session_id="s1", turn=0, session_turns=2, output_tokens=10),
        rec(2, session_id="s1", turn=1, session_turns=2, is_continuation=True, ttft_s=0.4, output_tokens=10),
        rec(3, session_id="s2", turn=0, session_turns=3, ttft_s=3.0),  # TTFT misses
        rec(4, session_id="s3", turn=0, session_turns=2, tpot_s=0.2),  # TPOT misses
        rec(
            5,
            session_id="s4",
            status=429,
            ttft_s=None,
            tpot_s=None,
            error_code="queue_full",
            retry_after_s=1.0,
        ),
        rec(6, session_id="s5", status=503, ttft_s=None, tpot_s=None, error_code="overloaded"),
        rec(7, session_id="s6", status=HANG, ttft_s=None, tpot_s=None, error_code="hang"),
        rec(8, session_id="s7", status=200, error_code="upstream_failed"),  # an SSE error event
        rec(
            9,
            session_id="s8",
            status=CONN_FAILED,
            ttft_s=None,
            tpot_s=None,
            error_code="ClientConnectorError",
        ),
        rec(10, session_id="s9", is_continuation=True, tpot_s=None, ttft_s=0.1),  # one token: no TPOT
        rec(11, session_id="s10", session_turns=3),  # met, but the window closed after turn 0
    ]
    s = summarize(records, slo_ttft_s=1.0, slo_tpot_s=0.05, duration_s=10.0)
    assert s["requests"] == 11 and s["ok"] == 6 and s["met_slo"] == 4
    assert s["goodput_rps"] == pytest.approx(0.4) and s["attainment"] == pytest.approx(4 / 11)
    assert s["throughput_rps"] == pytest.approx(0.6) and s["offered_rps"] == pytest.approx(1.1)
    assert s["refusals"] == {"429": 1, "503": 1} and s["refused"] == 2
    assert (s["hangs"], s["conn_failed"]) == (1, 1)
    assert s["errors"]["upstream_failed"] == 1 and s["statuses"]["200"] == 7
    assert s["first_turn"]["requests"] == 9 and s["continuation"]["requests"] == 2
    assert s["continuation"]["met_slo"] == 2 and s["continuation"]["ttft_s"]["p50"] == 0.1
    assert s["first_turn"]["ttft_s"]["p99"] == 3.0
    assert (s["sessions"], s["sessions_met"], s["sessions_completed"]) == (10, 3, 1)
    assert s["output_tokens_per_s"] == pytest.approx(2.0)
    # engine time: with engines 10x slower, everything met a 10x tighter SLO
    scaled = summarize(records, slo_ttft_s=0.1, slo_tpot_s=0.005, time_scale=10.0, duration_s=1.0)
    assert scaled["met_slo"] == 4 and scaled["goodput_rps"] == pytest.approx(4.0)
    assert scaled["first_turn"]["ttft_s"]["p99"] == pytest.approx(0.3)
    assert summarize([], 1.0, 1.0)["attainment"] is None


# ---------------------------------------------------------------------------- the driver


def turn(sid: str | None, max_tokens: int = 5, n: int = 1, t: int = 0) -> Turn:
    return Turn(sid, t, t > 0, n, max_tokens, 3, lambda: [{"role": "user", "content": f"hi {sid}"}])


async def test_driver_outcomes_against_a_fake_server() -> None:
    left = asyncio.Event()
    seen: list[tuple[str, dict[str, object]]] = []
    refused_once: set[str] = set()

    async def chat(request: web.Request) -> web.StreamResponse:
        sid = request.headers.get("X-Session-Id", "")
        body = await request.json()
        seen.append((sid, body))
        if sid == "refuse" or (sid in ("refuse-once", "pass-on") and sid not in refused_once):
            refused_once.add(sid)
            err = {
                "error": {"message": "full", "type": "rate_limit_error", "code": "queue_full", "param": None}
            }
            return web.json_response(err, status=429, headers={"Retry-After": "0.2"})
        if sid == "hang":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                left.set()  # the client closed its connection
                raise
        resp = web.StreamResponse(headers={"X-Admission-Class": "continuation", "X-Admission-Wait-Ms": "2.5"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
        for k in range(body["max_tokens"]):
            for i in range(body["n"]):
                chunk = {"choices": [{"index": i, "delta": {"content": f" tok{k}"}}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(0.01)
        if sid == "sse-error":
            await resp.write(
                b'data: {"error": {"message": "x", "type": "upstream_error", "code": "upstream_failed"}}\n\n'
            )
        if sid != "truncate":
            usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"] * body["n"]}}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application(handler_args={"handler_cancellation": True})
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        cfg = OpenLoopConfig(request_timeout_s=1.0)
        load = OpenLoop([Target("a", url), Target("b", url)], [], cfg)
        async with aiohttp.ClientSession() as http:
            ok = await load.send(http, turn("fine", max_tokens=6, n=2))
            refused = await load.send(http, turn("refuse"))
            err = await load.send(http, turn("sse-error"))
            trunc = await load.send(http, turn("truncate"))
            hung = await load.send(http, turn("hang"))
            await asyncio.wait_for(left.wait(), 10)
            retry = OpenLoop(
                [Target("a", url)], [], OpenLoopConfig(request_timeout_s=5.0, retry_refused=True)
            )
            again = await retry.send(http, turn("refuse-once"))
            passing = OpenLoop(
                [Target("a", url), Target("b", url)],
                [],
                OpenLoopConfig(request_timeout_s=5.0, next_upstream=1),
            )
            passed = await passing.send(http, turn("pass-on"))
            stuck = await passing.send(http, turn("refuse"))
            dead = OpenLoop([Target("dead", f"http://127.0.0.1:{free_port()}")], [], cfg)
            failed = await dead.send(http, turn("x"))
    finally:
        await runner.cleanup()

    assert ok.ok and ok.status == 200 and ok.output_tokens == 12 and ok.n == 2
    assert ok.ttft_s is not None and 0 < ok.ttft_s < ok.t_end - ok.t_send
    assert ok.tpot_s is not None and 0.005 < ok.tpot_s < 1.0
    assert (ok.server_class, ok.admission_wait_ms, ok.session_id) == ("continuation", 2.5, "fine")
    body = seen[0][1]
    assert body["stream"] is True and body["n"] == 2 and body["max_tokens"] == 6
    assert (refused.status, refused.error_code, refused.error_type) == (429, "queue_full", "rate_limit_error")
    assert refused.retry_after_s == 0.2 and not refused.retried and not refused.ok and refused.ttft_s is None
    assert (err.status, err.error_code, err.error_type, err.ok) == (
        200,
        "upstream_failed",
        "upstream_error",
        False,
    )
    assert err.ttft_s is not None  # tokens came before the error
    assert trunc.error_code == "stream_truncated" and not trunc.ok
    assert hung.status == HANG and hung.error_code == "hang" and 0.9 < hung.t_end - hung.t_send < 5
    assert again.retried and again.ok and again.t_end - again.t_send >= 0.2
    # next_upstream: the balancer passes a refused request on at once (no Retry-After wait), once
    assert passed.ok and passed.passed_on == 1 and not passed.retried
    assert passed.target == passing.balancer.next_after("pass-on", [passing.balancer.pick("pass-on")]).name
    assert stuck.status == 429 and stuck.passed_on == 1 and not stuck.ok
    assert failed.status == CONN_FAILED and failed.error_code and failed.target == "dead"
    assert [r.seq for r in load.records] == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------------------- against a real pdsim


@pytest.fixture
def pdsim_decode(tmp_path: Path) -> Iterator[str]:
    """A pdsim --fast decode server (one in four requests fails with 503), stopped by its PID."""
    args = [sys.executable, "-m", "pdsim", "--role", "decode", "--host", "127.0.0.1", "--port", "0", "--fast",
            "--running-max-req-size", "16", "--fault-error-rate", "0.25", "--fault-seed", "3"]  # fmt: skip
    with open(tmp_path / "pdsim.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, bufsize=0)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 30
        line = b""
        while not line.endswith(b"\n"):
            assert time.monotonic() < deadline and proc.poll() is None, f"pdsim not ready: {line!r}"
            r, _, _ = select.select([proc.stdout], [], [], 1.0)
            if r:
                line += proc.stdout.read(1)
        port = dict(kv.split("=", 1) for kv in line.decode().split()[2:])["port"]
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def test_open_loop_against_pdsim(pdsim_decode: str, tmp_path: Path) -> None:
    cfg = SyntheticConfig(session_rate=4.0, turns=(2, 4), system_tokens=200, first_user_median_tokens=100,
                          user_tokens=(20, 60), max_tokens=(5, 20), think_mean_s=0.2)  # fmt: skip
    arrivals = synthetic_arrivals(cfg, seed=11)
    targets = [Target("m1", pdsim_decode, 0.5), Target("m2", pdsim_decode, 0.5)]
    out = tmp_path / "records.jsonl"
    load = OpenLoop(targets, arrivals, OpenLoopConfig(duration_s=3.0, request_timeout_s=20.0), out)
    records = await asyncio.wait_for(load.run(), 120)

    assert len(records) >= 8
    ok = [r for r in records if r.ok]
    assert ok and all(r.ttft_s is not None and r.output_tokens == r.max_tokens * r.n for r in ok)
    assert all(r.tpot_s is not None for r in ok)
    refused = [r for r in records if r.status == 503]
    assert refused and all(r.error_code == "injected_fault" and r.ttft_s is None for r in refused)
    assert all(r.status in (200, 503) for r in records), Counter(r.status for r in records)
    by_session: dict[str, list[RequestRecord]] = {}
    for r in records:
        assert r.session_id is not None and r.t_send <= r.t_end
        by_session.setdefault(r.session_id, []).append(r)
    for rs in by_session.values():
        assert [r.turn for r in rs] == list(range(len(rs)))  # turns in order, none skipped
        assert len({r.target for r in rs}) == 1  # sticky
        assert all(r.ok for r in rs[:-1])  # a failed turn ends its session
        assert all(r.t_send >= p.t_end for p, r in itertools.pairwise(rs))  # after the previous ended
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["seq"] for x in lines] == [r.seq for r in records]
    assert set(lines[0]) >= {"t_send", "ttft_s", "tpot_s", "t_end", "status", "error_code", "retry_after_s",
                             "session_id", "turn", "is_continuation", "n", "input_tokens", "max_tokens",
                             "output_tokens", "target", "server_class"}  # fmt: skip
    s = summarize(records, slo_ttft_s=5.0, slo_tpot_s=1.0, duration_s=3.0)
    assert s["met_slo"] == len(ok) and s["refusals"] == {"503": len(refused)}


def test_cli_open_trace_replay(pdsim_decode: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [(i * 200, 700 + 10 * i, 8, [0, 100 + i, 200 + i]) for i in range(10)]
    rows.append((2100, 1500, 8, [0, 100, 200, 300]))  # continues the first request
    trace = write_trace(tmp_path / "t.jsonl", rows)
    out = tmp_path / "r.jsonl"
    main(["open", "--targets", f"{pdsim_decode},{pdsim_decode}", "--weights", "0.7,0.3",
          "--trace", str(trace), "--speed", "2", "--duration", "1.5", "--seed", "4", "--out", str(out),
          "--request-timeout", "20", "--max-input-tokens", "1000"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["START", "END"]
    summary = json.loads(lines[2])
    assert summary["source"] == "trace" and summary["requests"] == 11 and summary["clipped"] == 1
    records = [json.loads(x) for x in out.read_text().splitlines()]
    last = max(records, key=lambda r: r["t_send"])
    assert last["session_id"] == "mc4-0" and last["is_continuation"] and last["input_tokens"] == 1000
    assert all(math.isclose(r["max_tokens"], 8) for r in records)
    assert {r["status"] for r in records} <= {200, 503}


def test_trace_input_range_and_overasking_clients(tmp_path: Path) -> None:
    rows = [(i * 100, 1000 * (i + 1), 5 + i, [0, *range(100 * i + 1, 100 * i + 12)]) for i in range(6)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    picked = load_trace(trace, input_range=(2000, 4000))
    assert [r.input_length for r in picked] == [2000, 3000, 4000]
    # over-asking: max_tokens as asked, the trace's output the answer that ends first
    turns = [a.turns[0] for a in trace_arrivals(picked, ask_max_tokens=4096)]
    assert [(t.max_tokens, t.answer_tokens) for t in turns] == [(4096, 6), (4096, 7), (4096, 8)]
    assert all(t.answer_tokens is None for a in trace_arrivals(picked) for t in a.turns)
    args = open_parser().parse_args(
        [
            "--targets",
            "http://127.0.0.1:1",
            "--trace",
            str(trace),
            "--rate",
            "3",
            "--duration",
            "1",
            "--trace-input-range",
            "2000-4000",
            "--ask-max-tokens",
            "64",
        ]
    )
    arrivals, info = open_arrivals(args)
    # the rate is the selected requests': 3 of them over the trace's 0.5 s span at 3 req/s
    assert info["speed"] == pytest.approx(3 / (3 / 0.5))
    assert [a.turns[0].max_tokens for a in arrivals] == [64, 64, 64]


def test_overasking_answers_end_early_at_pdsim(pdsim_decode: str, tmp_path: Path) -> None:
    rows = [(i * 100, 300, 4 + i, [0, 50 + i]) for i in range(3)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    out = tmp_path / "r.jsonl"
    for extra in ([], ["--answer-in-prompt"]):
        main(["open", "--targets", pdsim_decode, "--trace", str(trace), "--speed", "1", "--duration", "1",
              "--out", str(out), "--request-timeout", "20", "--ask-max-tokens", "40", *extra])  # fmt: skip
        records = [json.loads(x) for x in out.read_text().splitlines()]
        ok = [r for r in records if r["status"] == 200 and not r["error_code"]]
        assert ok and all(r["max_tokens"] == 40 and r["output_tokens"] == r["answer_tokens"] < 40 for r in ok)


def test_the_answer_marker_replaces_the_prompts_end() -> None:
    from pdcoord.dev.loadgen import with_answer_marker
    from pdsim.protocol import answer_in_prompt

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "x" * 100}]
    out = with_answer_marker(msgs, 321)
    assert out[0] == msgs[0] and msgs[1]["content"] == "x" * 100  # a copy
    assert len(out[1]["content"]) == 100 and out[1]["content"].endswith("<pdsim-answer-tokens=321>")
    assert answer_in_prompt("<|user|>" + out[1]["content"] + "\n<|assistant|>") == 321
    assert answer_in_prompt("x" * 200) is None
    assert answer_in_prompt("<pdsim-answer-tokens=5>" + "x" * 200) is None  # only at the end
