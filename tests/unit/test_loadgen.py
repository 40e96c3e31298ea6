"""pdcoord.dev.loadgen: the request mix, and the closed-loop client against a real local HTTP server."""

from __future__ import annotations

import asyncio
import random

from aiohttp import web

from pdcoord.dev.loadgen import (
    CONN_FAILED,
    HANG,
    ClosedLoop,
    LoadConfig,
    RequestMix,
    percentile,
)
from pdcoord.dev.netutil import free_port

NEVER = web.AppKey("never", asyncio.Event)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(101)), 99) == 99
    assert percentile([5.0], 99) == 5.0


def test_mix_is_seeded_and_sessions_grow() -> None:
    mix = RequestMix()
    first = [r.body for _, r in zip(range(50), mix.requests(random.Random(1), "u"), strict=False)]
    again = [r.body for _, r in zip(range(50), mix.requests(random.Random(1), "u"), strict=False)]
    assert first == again
    reqs = list(zip(range(400), RequestMix().requests(random.Random(2), "u"), strict=False))
    kinds = {r.kind for _, r in reqs}
    assert kinds == {"session", "cold", "shared_prefix", "gang"}
    sessions = [r for _, r in reqs if r.kind == "session"]
    by_sid: dict[str, list[int]] = {}
    for r in sessions:
        by_sid.setdefault(r.headers["X-Session-Id"], []).append(len(r.body["messages"]))
    # each conversation's turns follow one another, each carrying the history so far
    assert all(lens == list(range(1, 2 * len(lens), 2)) for lens in by_sid.values()), by_sid
    assert all(r.body["n"] == 4 for _, r in reqs if r.kind == "gang")
    padded = next(RequestMix(weights={"cold": 1}, prompt_words=64).requests(random.Random(3), "u"))
    assert len(padded.body["prompt"].split()) >= 64


async def test_outcomes_refusals_streams_and_retries() -> None:
    calls = {"n": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        calls["n"] += 1
        body = await request.json()
        if "refuse" in body["prompt"]:
            return web.json_response(
                {"error": {"code": "queue_full"}}, status=429, headers={"Retry-After": "0.3"}
            )
        if "hang" in body["prompt"]:
            await request.app[NEVER].wait()
        resp = web.StreamResponse(headers={"X-Admission-Class": "cold", "X-Admission-Wait-Ms": "1.5"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        if "truncate" not in body["prompt"]:
            await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app[NEVER] = asyncio.Event()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port, dead = free_port(), free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    live = ("live", f"http://127.0.0.1:{port}")
    down = ("down", f"http://127.0.0.1:{dead}")
    try:
        cfg = LoadConfig(request_timeout_s=1.0, lb_retry=True, fresh_connections=True)
        load = ClosedLoop(lambda: [down, live], cfg)
        mix = RequestMix(weights={"cold": 1}, stream_fraction=1.0)
        req = next(mix.requests(random.Random(1), "t"))
        async with load.session() as http:
            ok = await load.request(http, req)
            req.body["prompt"] = "refuse"
            refused = await load.request(http, req)
            req.body["prompt"] = "truncate"
            truncated = await load.request(http, req)
            req.body["prompt"] = "hang"
            hung = await load.request(http, req)
        no_retry = ClosedLoop(lambda: [down], LoadConfig(request_timeout_s=1.0))
        async with no_retry.session() as http:
            failed = await no_retry.request(http, next(mix.requests(random.Random(1), "t")))
    finally:
        app[NEVER].set()
        await runner.cleanup()

    assert ok is not None and ok.ok and ok.streamed_events == 2 and ok.first_event >= ok.started
    assert (ok.klass, ok.wait_ms, ok.retry_after) == ("cold", 1.5, False)
    assert refused is not None and refused.status == 429
    assert (refused.error, refused.retry_after_s) == ("queue_full", 0.3)
    assert truncated is not None and truncated.error == "stream_truncated" and not truncated.ok
    assert hung is not None and hung.status == HANG and not hung.explicit and 0.9 < hung.latency_s < 3
    assert failed is not None and failed.status == CONN_FAILED and failed.attempts == ["down"]
    # with lb_retry, a request the first target refused to connect for went to the other one
    retried = [o for o in (ok, refused, truncated, hung) if o.retried_because]
    assert retried and all(o.attempts == ["down", "live"] and o.master == "live" for o in retried)
    assert len(load.snapshot()) == 4 and calls["n"] == 4


async def test_a_refused_client_waits_for_retry_after() -> None:
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"code": "queue_full"}}, status=429, headers={"Retry-After": "0.2"}
        )

    app = web.Application()
    app.router.add_post("/v1/completions", refuse)
    app.router.add_post("/v1/chat/completions", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    target = [("m", f"http://127.0.0.1:{port}")]
    try:
        polite = await ClosedLoop(lambda: target, LoadConfig(users=1, duration_s=1.0)).run()
        eager = await ClosedLoop(lambda: target, LoadConfig(users=1, duration_s=0.5, max_backoff_s=0)).run()
    finally:
        await runner.cleanup()
    # 0.1-0.2 s (jittered Retry-After) between requests: at most about ten in a second
    assert 4 <= len(polite) <= 12, len(polite)
    assert all(o.status == 429 and o.retry_after_s == 0.2 for o in polite)
    assert len(eager) > 3 * len(polite), (len(eager), len(polite))
