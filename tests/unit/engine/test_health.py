"""The per-engine circuit breaker (pdmaster.engine.health), on an injected clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest
from aiohttp import web

from pdcoord.dev.netutil import free_port
from pdmaster.engine import EngineError, EnginePool, make_dispatch
from pdmaster.engine.health import (
    BreakerPolicy,
    BreakerState,
    CircuitBreaker,
    EngineBreakers,
    counts_as_failure,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def fail(b: CircuitBreaker, n: int = 1) -> None:
    for _ in range(n):
        token = b.allow()
        assert token is not None
        b.record(token, False, "refused")


def test_opens_after_n_consecutive_failures_and_a_success_resets_the_count() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerPolicy(failures=3, backoff=1.0, backoff_max=8.0), clock)
    fail(b, 2)
    t = b.allow()
    assert t is not None
    b.record(t, True)
    assert b.consecutive_failures == 0
    fail(b, 2)
    assert b.state is BreakerState.CLOSED
    t = b.allow()
    assert t is not None
    b.record(t, None)  # a client 4xx: no verdict, the count stays
    assert b.consecutive_failures == 2
    fail(b, 1)
    assert b.state is BreakerState.OPEN and b.last_error == "refused"
    assert b.allow() is None and not b.usable


def test_half_open_allows_exactly_one_trial_then_closes_on_success() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerPolicy(failures=1, backoff=1.0, backoff_max=8.0), clock)
    fail(b)
    clock.t += 0.99
    assert b.state is BreakerState.OPEN
    clock.t += 0.02
    assert b.state is BreakerState.HALF_OPEN and b.usable
    trial = b.allow()
    assert trial is not None
    assert b.allow() is None  # only one trial at a time
    assert b.record(trial, True)
    assert b.state is BreakerState.CLOSED and b.backoff == 1.0
    assert b.allow() is not None and b.allow() is not None


def test_failed_trials_double_the_backoff_up_to_the_cap() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerPolicy(failures=2, backoff=1.0, backoff_max=5.0), clock)
    fail(b, 2)
    waits = []
    for _ in range(4):
        waits.append(b.seconds_to_trial())
        clock.t += b.seconds_to_trial()
        assert b.state is BreakerState.HALF_OPEN
        fail(b, 1)  # the trial fails: open again at once
        assert b.state is BreakerState.OPEN
    assert waits == [1.0, 2.0, 4.0, 5.0]
    clock.t += 5.0
    t = b.allow()
    assert t is not None
    b.record(t, True)
    fail(b, 1)
    assert b.state is BreakerState.CLOSED  # the count started afresh
    fail(b, 1)
    # failing again right after a trial closed it: the backoff does not start over (no thrashing)
    assert b.seconds_to_trial() == 5.0


def test_a_trial_without_verdict_frees_the_trial_slot() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerPolicy(failures=1, backoff=1.0), clock)
    fail(b)
    clock.t += 1.0
    t = b.allow()
    assert t is not None and b.allow() is None
    b.record(t, None)
    assert b.state is BreakerState.HALF_OPEN and b.allow() is not None


def test_outcomes_of_requests_permitted_under_an_earlier_state_are_ignored() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerPolicy(failures=2, backoff=1.0), clock)
    early = b.allow()
    assert early is not None
    fail(b, 2)
    assert b.state is BreakerState.OPEN
    assert not b.record(early, True)  # started before it opened: cannot close it
    assert b.state is BreakerState.OPEN
    clock.t += 1.0
    trial = b.allow()
    assert trial is not None
    assert not b.record(early, False)  # nor decide the trial
    assert b.state is BreakerState.HALF_OPEN
    b.record(trial, True)
    assert b.state is BreakerState.CLOSED


def test_book_reports_each_change_once() -> None:
    clock = Clock()
    seen: list[tuple[str, str]] = []
    book = EngineBreakers(
        BreakerPolicy(failures=1, backoff=2.0), clock, lambda n, b: seen.append((n, b.state.value))
    )
    t = book.allow("d1")
    assert t is not None
    book.record("d1", t, False, "timeout")
    assert seen == [("d1", "open")]
    book.refresh("d1")
    assert seen == [("d1", "open")]
    clock.t += 2.0
    book.refresh("d1")
    assert seen[-1] == ("d1", "half_open")
    book.reset("d1")
    assert seen[-1] == ("d1", "closed")
    assert book.state("other") is BreakerState.CLOSED


@pytest.mark.parametrize(
    ("kind", "status", "counts"),
    [
        ("connect", 0, True),
        ("timeout", 504, True),
        ("closed", 0, True),
        ("status", 500, True),
        ("status", 503, True),
        ("status", 400, False),
        ("status", 429, False),
        ("protocol", 0, False),
        ("aborted", 0, False),
    ],
)
def test_what_counts_as_a_failure(kind: str, status: int, counts: bool) -> None:
    assert counts_as_failure(kind, status) is counts


def test_policy_is_checked() -> None:
    with pytest.raises(ValueError):
        BreakerPolicy(failures=0)
    with pytest.raises(ValueError):
        BreakerPolicy(backoff=10, backoff_max=5)


# -- dispatch names the node whose engine failed, as the breaker needs -----------------------------


@dataclass(frozen=True)
class _Node:
    node_id: str
    endpoint: str
    bootstrap_port: int | None = 1


def _serve(status: int, delay: float = 0.0) -> Callable[[], Awaitable[tuple[web.AppRunner, str]]]:
    async def start() -> tuple[web.AppRunner, str]:
        async def handler(_r: web.Request) -> web.Response:
            await asyncio.sleep(delay)
            return web.json_response({"kv_transfer_params": {"x": 1}}, status=status)

        app = web.Application()
        app.router.add_post("/generate", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"

    return start


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
@pytest.mark.parametrize(
    ("p_status", "d_status", "node", "engine_status", "counts"),
    [
        (200, 503, "d", 503, True),
        (200, 400, "d", 400, False),
        (500, 200, "p", 500, True),
        (None, 200, "p", 0, True),  # prefill unreachable
        (200, None, "d", 0, True),  # decode unreachable
    ],
)
def test_dispatch_names_the_failed_node(
    protocol: str, p_status: int | None, d_status: int | None, node: str, engine_status: int, counts: bool
) -> None:
    async def main() -> EngineError:
        runners = []
        urls = []
        # D answers a moment later, as it would after the KV transfer from P
        for status, delay in ((p_status, 0.0), (d_status, 0.2)):
            if status is None:
                urls.append(f"http://127.0.0.1:{free_port()}")  # nothing listens there
            else:
                runner, url = await _serve(status, delay)()
                runners.append(runner)
                urls.append(url)
        pool = EnginePool(first_byte_timeout_s=5)
        try:
            dispatch = make_dispatch(protocol, pool)
            with pytest.raises(EngineError) as info:
                answer = await dispatch.open(
                    "/generate", {"text": "hi"}, _Node("p", urls[0]), _Node("d", urls[1]), {}
                )
                await answer.read()  # SGLang: P's failure can arrive after D's head
                await answer.close()
            return info.value
        finally:
            await pool.close()
            for r in runners:
                await r.cleanup()

    exc = asyncio.run(main())
    assert exc.node == node
    assert exc.engine_status == engine_status
    assert counts_as_failure(exc.kind, exc.engine_status) is counts


def test_an_engine_failing_half_its_requests_does_not_make_the_breaker_thrash() -> None:
    """Lucky trials close it, but each re-open soon after doubles the wait instead of starting over;
    once the engine has stayed good for backoff_max the next opening starts from backoff again."""
    clock = Clock()
    b = CircuitBreaker(BreakerPolicy(failures=3, backoff=1.0, backoff_max=8.0), clock)
    waits = []
    for _ in range(5):
        fail(b, 3)  # three failures in a row open it
        waits.append(b.backoff)
        clock.t += b.backoff
        trial = b.allow()
        assert trial is not None
        b.record(trial, True)  # a lucky trial closes it
        assert b.state is BreakerState.CLOSED
        clock.t += 0.5
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0]
    clock.t += 8.0  # good for backoff_max: forgiven
    fail(b, 3)
    assert b.backoff == 1.0
    b.reset()  # the agent reports the engine up: forgiven at once
    assert b.backoff == 1.0 and b.closed_at is None


def test_a_refused_connection_opens_the_breaker_at_once() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerPolicy(failures=3, backoff=1.0, backoff_max=8.0), clock)
    token = b.allow()
    assert token is not None
    assert b.record(token, False, "refused", decisive=True)
    assert b.state is BreakerState.OPEN
