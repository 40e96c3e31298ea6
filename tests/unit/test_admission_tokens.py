"""Capacity as a vector (DESIGN §13): slots and KV tokens in the admission core."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdmaster.admission import (
    CLASS_ORDER,
    AdmissionCore,
    AdmissionPolicy,
    RequestClass,
    Ticket,
    TicketState,
)
from pdmaster.admission_controller import AdmissionController, AdmissionRejected

Q, G, R = TicketState.QUEUED, TicketState.GRANTED, TicketState.REJECTED
COLD = RequestClass.COLD


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def core_with(policy: AdmissionPolicy | None = None) -> tuple[AdmissionCore, Clock]:
    clock = Clock()
    return AdmissionCore(policy or AdmissionPolicy(), clock=clock), clock


def test_a_lease_is_placed_only_where_its_tokens_fit_even_with_free_slots() -> None:
    core, _ = core_with()
    core.set_shares({"a": 4}, token_shares={"a": 1000})
    t1 = core.submit(1, COLD, tokens=800)
    assert t1.state is G and t1.node == "a"
    assert core.active_tokens_on("a") == 800 and core.token_share_on("a") == 1000
    t2 = core.submit(1, COLD, tokens=300)
    assert t2.state is Q  # 3 slots free, 200 tokens free
    assert core.wanted_tokens() == 300 and core.queued_tokens == 300
    t3 = core.submit(1, COLD, tokens=0)
    assert t3.state is G  # backfilled past the blocked one (free slots, no tokens needed)
    core.release(t1)
    assert t2.state is G and core.active_tokens_on("a") == 300
    assert core.wanted_tokens() == 0


def test_release_frees_tokens_and_slots() -> None:
    core, _ = core_with()
    core.set_shares({"a": 2}, token_shares={"a": 100})
    t = core.submit(2, COLD, tokens=100)
    assert t.state is G
    assert core.active == 2 and core.active_tokens == 100
    core.release(t)
    core.release(t)  # idempotent
    assert core.active == 0 and core.active_tokens == 0 and core.active_tokens_on("a") == 0


def test_too_many_tokens_is_final_and_a_fit_to_the_whole_pool_is_cannot_fit_now() -> None:
    core, _ = core_with()
    core.set_shares({"a": 4, "b": 4}, token_shares={"a": 1000, "b": 500}, token_full={"a": 2000, "b": 4000})
    assert core.max_token_pool() == 4000
    t = core.submit(1, COLD, tokens=4001)
    assert t.state is R and t.reason is not None
    assert t.reason.code == "too_many_tokens" and t.reason.retry_after_s is None
    t = core.submit(1, COLD, tokens=1500)  # fits b's whole pool, no share now
    assert t.state is R and t.reason is not None and t.reason.code == "cannot_fit_now"
    assert t.reason.retry_after_s is not None
    r = core.refusal(1, 4001)
    assert r is not None and r.code == "too_many_tokens"
    assert core.refusal(1, 1000) is None
    assert core.submit(1, COLD, tokens=-1).reason.code == "invalid"  # type: ignore[union-attr]


def test_the_node_with_the_most_free_tokens_wins_then_the_most_free_slots() -> None:
    core, _ = core_with()
    core.set_shares({"a": 4, "b": 8}, token_shares={"a": 1000, "b": 500})
    t = core.submit(1, COLD, tokens=100)
    assert t.node == "a"  # most free tokens, though b has more free slots
    # a's slots run out: the node with the most free tokens no longer fits, the one with the most
    # free slots does
    core.set_shares({"a": 1, "b": 8}, token_shares={"a": 10_000, "b": 500})
    u = core.submit(1, COLD, tokens=100)
    assert u.node == "b"


def test_a_node_without_a_pool_has_no_token_limit() -> None:
    core, _ = core_with()
    core.set_shares({"a": 2})
    assert core.token_share_on("a") is None and core.max_token_pool() is None
    t = core.submit(1, COLD, tokens=10**9)
    assert t.state is G and core.active_tokens_on("a") == 10**9
    # mixed: a large charge goes where there is no pool, never refused as too many
    core.set_shares({"a": 2, "b": 2}, token_shares={"b": 100})
    u = core.submit(1, COLD, tokens=5000)
    assert u.state is G and u.node == "a"
    v = core.submit(1, COLD, tokens=50)
    assert v.state is G and v.node == "b"  # the most free tokens


def test_a_token_share_shrink_fails_what_no_longer_fits_and_running_leases_run_on() -> None:
    core, _ = core_with(AdmissionPolicy(max_wait_s=dict.fromkeys(CLASS_ORDER, 100.0)))
    core.set_shares({"a": 8}, token_shares={"a": 1000}, token_full={"a": 2000})
    run = core.submit(1, COLD, tokens=900)
    big = core.submit(1, COLD, tokens=1000)
    small = core.submit(1, COLD, tokens=150)
    assert run.state is G and big.state is Q
    changes = core.update_shares({"a": 8}, token_shares={"a": 600}, token_full={"a": 2000})
    assert big in changes and big.state is R and big.reason is not None
    assert big.reason.code == "cannot_fit_now"
    assert run.state is G and core.active_tokens_on("a") == 900  # over the new share, runs on
    assert small.state is Q  # nothing new placed while over
    core.release(run)
    assert small.state is G
    # a pool that shrinks below a queued charge: too many tokens (400)
    huge = core.submit(1, COLD, tokens=600)
    blocker = core.submit(1, COLD, tokens=0)
    del blocker
    core.update_shares({}, token_shares={"a": 550}, token_full={"a": 550})
    assert huge.state is R and huge.reason is not None and huge.reason.code == "too_many_tokens"


def test_a_node_only_in_token_shares_keeps_its_slot_share_and_full_capacity() -> None:
    core, _ = core_with()
    core.set_shares({"a": 4}, {"a": 16})
    core.update_shares({}, token_shares={"a": 100})
    assert core.share_on("a") == 4 and core.token_share_on("a") == 100
    assert core.snapshot()["nodes"]["a"]["full_capacity"] == 16
    core.update_shares({"a": 4})  # a change without token_shares: no pool any more
    assert core.token_share_on("a") is None


def test_a_token_blocked_head_is_backfilled_past_then_reserved_like_a_gang() -> None:
    policy = AdmissionPolicy(max_wait_s=dict.fromkeys(CLASS_ORDER, 100.0), backfill_waves=0.5)
    core, _ = core_with(policy)
    core.set_shares({"a": 4}, token_shares={"a": 1000})
    run = core.submit(1, COLD, tokens=900)
    blocked = core.submit(1, COLD, tokens=500)
    assert blocked.state is Q
    snap = core.snapshot()["backfill"]
    assert snap["gang_ticket"] == blocked.id and snap["gang_tokens"] == 500
    b1 = core.submit(1, COLD, tokens=50)
    b2 = core.submit(1, COLD, tokens=50)
    assert b1.state is G and b2.state is G  # budget 2 slots
    assert core.snapshot()["backfill"]["reserved"]
    b3 = core.submit(1, COLD, tokens=0)
    assert b3.state is Q  # reserved for the blocked one
    core.release(run)
    assert blocked.state is G and b3.state is G


def test_kept_tokens_follow_the_kept_leases_and_kept_since_is_unchanged() -> None:
    core, _ = core_with()
    core.set_shares({"a": 4}, token_shares={"a": 1000})
    t = core.submit(1, COLD, tokens=300)
    u = core.submit(1, COLD, tokens=200)
    core.decode_sent(t)
    kept, mark = core.kept_since("a", None)
    assert kept == 0
    core.decode_sent(u)
    assert core.in_decode_tokens_on("a") == 500
    kept, kept_tokens, mark = core.kept_vector_since("a", mark)
    assert (kept, kept_tokens) == (1, 300) and core.last_kept_tokens("a") == 300
    core.release(t)
    kept, mark = core.kept_since("a", mark)  # the slots-only call keeps the tokens for the Ack too
    assert kept == 1 and core.last_kept_tokens("a") == 200


def test_snapshot_shows_tokens_per_node_and_in_total() -> None:
    core, _ = core_with()
    core.set_shares({"a": 4, "b": 2}, token_shares={"a": 1000}, token_full={"a": 4000})
    core.submit(1, COLD, tokens=100)
    snap = core.snapshot()
    assert snap["token_capacity"] == 1000 and snap["active_tokens"] == 100
    assert snap["nodes"]["a"]["token_share"] == 1000 and snap["nodes"]["a"]["token_full"] == 4000
    assert snap["nodes"]["a"]["active_tokens"] == 100
    assert snap["nodes"]["b"]["token_share"] is None


def test_bypass_ignores_tokens() -> None:
    core, _ = core_with(AdmissionPolicy(bypass=True))
    core.set_shares({"a": 1}, token_shares={"a": 10})
    ts = [core.submit(1, COLD, tokens=1000) for _ in range(3)]
    assert all(t.state is G for t in ts)


def test_expected_wait_counts_tokens_when_they_bind() -> None:
    core, clock = core_with(AdmissionPolicy(max_wait_s=dict.fromkeys(CLASS_ORDER, 1000.0)))
    core.set_shares({"a": 100}, token_shares={"a": 1000})
    for _ in range(10):  # a history: 10 leases of 100 tokens, one second each
        t = core.submit(1, COLD, tokens=100)
        clock.now += 1.0
        core.release(t)
    running = [core.submit(1, COLD, tokens=100) for _ in range(10)]
    assert all(t.state is G for t in running)
    queued = [core.submit(1, COLD, tokens=100) for _ in range(5)]
    assert all(t.state is Q for t in queued)
    slots_only = core.expected_wait(COLD, 1)  # 94 slots free: no wait in slots
    assert slots_only is not None
    with_tokens = core.expected_wait(COLD, 1, tokens=100)
    assert with_tokens is not None and with_tokens > 0.0
    rate = core._estimate.token_rate(clock.now)
    assert rate is not None and with_tokens == pytest.approx((5 * 100 + 100) / rate)


def test_controller_passes_tokens_and_names_the_limit() -> None:
    async def run() -> None:
        ctl = AdmissionController(AdmissionPolicy())
        ctl.set_shares({"a": 2}, token_shares={"a": 100}, token_full={"a": 400})
        async with ctl.acquire(1, COLD, tokens=60) as lease:
            assert lease.tokens == 60 and ctl.active_tokens_on("a") == 60
            assert ctl.token_share_on("a") == 100
        assert ctl.active_tokens_on("a") == 0
        with pytest.raises(AdmissionRejected) as exc:
            await ctl.acquire_lease(1, COLD, tokens=500)
        assert exc.value.status == 400 and exc.value.code == "too_many_tokens"
        assert "400" in exc.value.message and "500" in exc.value.message
        ctl.close()

    asyncio.run(run())


# ---------------------------------------------------------------------- random walks

NODES = ("d1", "d2", "d3")


def _walk(seed: int, ops: int, *, pools: bool, charge: bool) -> list[tuple[int, str, str | None]]:
    """Random submits, releases, cancels, share changes and timeouts; checks after every step that
    no grant put a node over its share in slots or tokens. Returns (ticket, state, node) per change."""
    rng = random.Random(seed)
    clock = Clock()
    policy = AdmissionPolicy(
        max_wait_s={c: rng.choice([0.5, 2.0]) for c in CLASS_ORDER},
        queue_waves=rng.choice([1.0, 2.0]),
        backfill_waves=rng.choice([0.0, 1.0]),
    )
    core = AdmissionCore(policy, clock=clock)
    trace: list[tuple[int, str, str | None]] = []
    live: dict[int, Ticket] = {}
    # the token rng is separate, so that a walk without charges sees the same other choices
    trng = random.Random(seed + 10_000)

    def shares() -> None:
        slots = {n: rng.choice([0, 2, 4, 8]) for n in NODES}
        tokens = {n: trng.choice([0, 500, 1000, 4000]) for n in NODES if trng.random() < 0.8}
        full = {n: v * 2 for n, v in tokens.items()}
        note(core.set_shares(slots, None, tokens if pools else None, full if pools else None))

    def note(changes: list[Ticket]) -> None:
        for t in changes:
            trace.append((t.id, t.state.value, t.node))
            if t.state is G:
                n = t.node
                assert n is not None
                assert core.active_on(n) <= core.share_on(n), f"{t} over the slot share"
                ts = core.token_share_on(n)
                if ts is not None:
                    assert core.active_tokens_on(n) <= ts, f"{t} over the token share"
        held: dict[str, int] = {}
        for t in live.values():
            if t.state is G and not t.released and t.node is not None:
                held[t.node] = held.get(t.node, 0) + t.tokens
        for n in NODES:
            assert core.active_tokens_on(n) == held.get(n, 0)

    shares()
    for _ in range(ops):
        clock.now += rng.random() * 0.1
        r = rng.random()
        tokens = trng.choice([0, 100, 300, 900, 3000]) if charge else 0
        if r < 0.5:
            t = core.submit(
                rng.choice([1, 1, 1, 2, 4]),
                rng.choice(CLASS_ORDER),
                rng.choice([None, None, "s1", "s2"]),
                tokens=tokens,
            )
            live[t.id] = t
            note(core.last_changes)
        elif r < 0.8:
            granted = [t for t in live.values() if t.state is G and not t.released]
            if granted:
                note(core.release(rng.choice(granted)))
        elif r < 0.85:
            queued = [t for t in live.values() if t.state is Q]
            if queued:
                note(core.cancel(rng.choice(queued)))
        elif r < 0.9:
            shares()
        else:
            note(core.expire())
    return trace


@pytest.mark.parametrize("seed", range(40))
def test_random_walk_never_places_over_a_token_share(seed: int) -> None:
    _walk(seed, 400, pools=True, charge=True)


@pytest.mark.parametrize("seed", range(20))
def test_without_pools_token_charges_change_nothing(seed: int) -> None:
    assert _walk(seed, 300, pools=False, charge=True) == _walk(seed, 300, pools=False, charge=False)
