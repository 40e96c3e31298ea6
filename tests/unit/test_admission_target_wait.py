"""Early rejection against a target wait (``--admission-target-wait``): core and adapter."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import CollectorRegistry

from pdcoord.config import EnvArgumentParser
from pdmaster.admission import (
    EXPECTED_WAIT,
    OUTCOMES,
    PEER_LOAD_TTL_S,
    RATE_MIN_RELEASES,
    AdmissionCore,
    AdmissionPolicy,
    PeerLoad,
    RequestClass,
    Ticket,
    TicketState,
)
from pdmaster.admission_controller import (
    AdmissionController,
    AdmissionRejected,
    add_admission_flags,
    policy_from_args,
)

CONT = RequestClass.CONTINUATION
PROB = RequestClass.PROBABLE_CACHE_HIT
COLD = RequestClass.COLD
Q, G, R = TicketState.QUEUED, TicketState.GRANTED, TicketState.REJECTED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def targets(cont: float, prob: float, cold: float) -> dict[RequestClass, float]:
    return {CONT: cont, PROB: prob, COLD: cold}


def make(clock: Clock, target: float | dict[RequestClass, float] | None, capacity: int = 2) -> AdmissionCore:
    tw = targets(target, target, target) if isinstance(target, (int, float)) else target
    core = AdmissionCore(AdmissionPolicy(target_wait_s=tw, queue_waves=100), clock=clock)
    core.set_shares({"d1": capacity})
    return core


def warm(core: AdmissionCore, clock: Clock, hold: float) -> None:
    """History: RATE_MIN_RELEASES one-slot leases, one after the other, each held ``hold`` s."""
    for _ in range(RATE_MIN_RELEASES):
        t = core.submit(1, COLD)
        assert t.state is G
        clock.now += hold
        core.release(t)


def fill(core: AdmissionCore) -> list[Ticket]:
    """Hold every slot."""
    held = [core.submit(1, COLD) for _ in range(core.capacity)]
    assert all(t.state is G for t in held)
    return held


def test_refused_at_once_when_the_queue_ahead_is_long_and_completions_slow() -> None:
    clock = Clock()
    core = make(clock, 5.0)
    warm(core, clock, hold=10.0)
    fill(core)
    # two slots held 10 s each: 0.2 slots/s
    assert core.completion_rate() == pytest.approx(0.2, rel=0.01)
    assert core.expected_wait(COLD) == pytest.approx(5.0, rel=0.01)  # its own slot: 1 / 0.2
    first = core.submit(1, COLD)  # 5 s expected: not above the target
    assert first.state is Q
    t = core.submit(1, COLD)  # one slot ahead of it: 10 s
    assert t.state is R and t.reason is not None and t.reason.code == EXPECTED_WAIT
    assert t.reason.retry_after_s == pytest.approx(10.0, rel=0.01)
    assert t.wait_s == 0.0  # refused on arrival, not after a wait
    assert core.queued_requests == 1  # nothing joined, nothing was evicted for it
    snap = core.snapshot()
    assert snap["outcomes"]["cold"][EXPECTED_WAIT] == 1
    assert snap["classes"]["cold"]["target_wait_s"] == 5.0
    assert snap["classes"]["cold"]["expected_wait_s"] == pytest.approx(10.0, rel=0.01)
    assert snap["completion_rate_slots_per_s"] == pytest.approx(0.2, rel=0.01)


def test_admitted_when_completions_are_fast() -> None:
    clock = Clock()
    core = make(clock, 5.0)
    warm(core, clock, hold=0.1)
    fill(core)
    tickets = [core.submit(1, COLD) for _ in range(50)]  # 50 ahead at 20 slots/s: 2.5 s
    assert all(t.state is Q for t in tickets)
    assert core.expected_wait(COLD) == pytest.approx(51 / 20, rel=0.01)


def test_retry_after_is_the_expected_wait_clamped_to_the_policy() -> None:
    clock = Clock()
    core = make(clock, 0.2)
    warm(core, clock, hold=1.0)
    fill(core)  # 2 slots/s: the next slot is 0.5 s away
    t = core.submit(1, COLD)
    assert t.state is R and t.reason is not None
    assert t.reason.retry_after_s == 1.0  # retry_after_min_s
    clock = Clock()
    slow = make(clock, 1.0)
    warm(slow, clock, hold=100.0)
    fill(slow)
    clock.now += 50.0  # the released slots have decayed away: 2 slots held 100 s, 0.02 slots/s
    t = slow.submit(1, COLD)  # 50 s expected
    assert t.state is R and t.reason is not None and t.reason.retry_after_s == 30.0  # retry_after_max_s


def test_continuation_not_refused_while_only_cold_is_queued_ahead() -> None:
    clock = Clock()
    core = make(clock, targets(5.0, 5.0, 0))  # COLD has no target: it queues
    warm(core, clock, hold=5.0)
    fill(core)  # 0.4 slots/s
    cold = [core.submit(1, COLD) for _ in range(20)]
    assert all(t.state is Q for t in cold)
    # DRR serves COLD 1 slot per 8 of CONTINUATION: 1.125 slots before a continuation is granted
    assert core.expected_wait(CONT) == pytest.approx(1.125 / 0.4, rel=0.01)
    assert core.expected_wait(PROB) == pytest.approx((1 + 1 / 3) / 0.4, rel=0.01)
    assert core.expected_wait(COLD) == pytest.approx(21 / 0.4, rel=0.01)
    assert core.submit(1, PROB).state is Q
    # behind one PROB: PROB's share 3/8 and COLD's 1/8 of its one slot
    assert core.expected_wait(CONT) == pytest.approx(1.5 / 0.4, rel=0.01)
    assert core.submit(1, CONT, "s1").state is Q
    # a second continuation waits for its own class ahead too, and the others' larger share: 7.5 s
    assert core.submit(1, CONT, "s2").state is R
    assert core.snapshot()["outcomes"]["continuation"][EXPECTED_WAIT] == 1


def test_no_rejection_without_history() -> None:
    clock = Clock()
    core = make(clock, 0.001, capacity=1)
    for _ in range(RATE_MIN_RELEASES - 1):
        t = core.submit(1, COLD)
        clock.now += 100.0
        core.release(t)
    assert core.completion_rate() is None
    fill(core)
    tickets = [core.submit(1, COLD) for _ in range(20)]
    assert all(t.state is Q for t in tickets)
    assert core.expected_wait(COLD) is None
    assert core.snapshot()["classes"]["cold"]["expected_wait_s"] is None


def test_never_refused_when_it_can_run_now() -> None:
    clock = Clock()
    core = make(clock, 0.001, capacity=4)
    warm(core, clock, hold=100.0)  # slow: anything that has to wait is refused
    assert all(core.submit(1, COLD).state is G for _ in range(4))  # free slots, nothing queued
    assert core.submit(1, COLD).state is R


def test_a_gang_being_backfilled_does_not_make_a_fitting_arrival_refused() -> None:
    clock = Clock()
    core = make(clock, targets(1000.0, 1000.0, 0.001), capacity=4)
    warm(core, clock, hold=100.0)
    assert core.submit(1, COLD).state is G and core.submit(1, COLD).state is G
    g = core.submit(4, CONT)  # waits for the whole node; the 2 free slots may be backfilled
    assert g.state is Q
    assert core.submit(1, COLD).state is G


def test_zero_turns_a_class_off_and_default_is_off() -> None:
    clock = Clock()
    core = make(clock, targets(0, 0, 0))
    warm(core, clock, hold=100.0)
    fill(core)
    assert all(core.submit(1, c).state is Q for c in (CONT, PROB, COLD))
    off = make(Clock(), None)
    assert off.snapshot()["classes"]["cold"]["target_wait_s"] is None
    assert off.wait_limit(COLD) == 5.0


def test_target_caps_the_class_timeout() -> None:
    clock = Clock()
    core = make(clock, targets(0, 2.0, 60.0))
    assert [core.wait_limit(c) for c in (CONT, PROB, COLD)] == [30.0, 2.0, 5.0]
    fill(core)
    t = core.submit(1, PROB)  # no history: queued
    assert t.state is Q and t.deadline == clock.now + 2.0
    clock.now += 2.0
    core.expire()
    assert t.state is TicketState.EXPIRED and t.reason is not None and t.reason.code == "timeout"
    assert core.snapshot()["classes"]["probable_cache_hit"]["max_wait_s"] == 2.0


def test_completion_rate_follows_a_steady_stream() -> None:
    clock = Clock()
    core = make(clock, None, capacity=100)
    for _ in range(200):  # a one-slot lease ends every 0.5 s, each held 0.01 s
        t = core.submit(1, COLD)
        clock.now += 0.01
        core.release(t)
        clock.now += 0.49
    rate = core.completion_rate()
    assert rate is not None and 1.6 < rate < 2.4
    clock.now += 100.0  # long idle: the rate decays (and a stale low rate only refuses when full)
    rate = core.completion_rate()
    assert rate is not None and rate < 0.01


def test_resubmission_is_never_refused_on_expected_wait() -> None:
    clock = Clock()
    core = make(clock, 0.001)
    warm(core, clock, hold=100.0)
    fill(core)
    t = core.submit(1, COLD, avoid=frozenset({"d2"}))
    assert t.state is Q


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        AdmissionPolicy(target_wait_s=targets(-1, 0, 0))
    with pytest.raises(ValueError):
        AdmissionPolicy(rate_window_s=0)
    assert EXPECTED_WAIT in OUTCOMES


# ---------------------------------------------------------------------- flag and adapter


def parser() -> argparse.ArgumentParser:
    p = EnvArgumentParser(prog="t", env_prefix="PDMASTER_TEST")
    add_admission_flags(p)
    return p


def test_flag_takes_one_value_or_one_per_class() -> None:
    assert policy_from_args(parser().parse_args([])).target_wait_s is None
    p = policy_from_args(parser().parse_args(["--admission-target-wait", "2.5"]))
    assert p.target_wait_s == targets(2.5, 2.5, 2.5)
    p = policy_from_args(parser().parse_args(["--admission-target-wait", "0:5:2"]))
    assert p.target_wait_s == targets(0, 5, 2)
    for bad in ("-1", "1:2", "x", "inf"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--admission-target-wait", bad])


async def test_adapter_refuses_with_429_retry_after_and_counts_the_outcome() -> None:
    clock = Clock()
    reg = CollectorRegistry()
    ctl = AdmissionController(
        AdmissionPolicy(target_wait_s=targets(4.0, 4.0, 4.0)), clock=clock, registry=reg
    )
    ctl.set_shares({"d1": 2})
    warm(ctl.core, clock, hold=10.0)
    leases = [await ctl.acquire_lease() for _ in range(2)]
    with pytest.raises(AdmissionRejected) as exc:
        await ctl.acquire_lease()  # 1 slot at 0.2 slots/s: 5 s > 4 s
    assert (exc.value.code, exc.value.http_status) == (EXPECTED_WAIT, 429)
    assert exc.value.retry_after == pytest.approx(5.0) and exc.value.retry_after_header() in ("5", "6")
    assert "target" in exc.value.message
    sample = reg.get_sample_value(
        "pdcoord_admission_outcomes_total", {"class": "cold", "outcome": EXPECTED_WAIT}
    )
    assert sample == 1.0
    assert ctl.snapshot()["outcomes"]["cold"][EXPECTED_WAIT] == 1
    for lease in leases:
        lease.release()
    assert ctl.core.active == 0
    # a granted lease's deadline follows the capped timeout
    lease = await ctl.acquire_lease()
    assert lease.deadline == clock.now + 4.0
    lease.release()
    ctl.close()


def test_a_later_stage_s_wait_counts_against_the_target() -> None:
    """Two-stage admission: what a granted request still waits in the decode stage is part of the
    wait the target bounds (``later_wait_s``), so the gate refuses earlier."""
    clock = Clock()
    core = make(clock, 5.0)
    warm(core, clock, hold=10.0)
    fill(core)  # 0.2 slots/s: a first waiter expects 5 s, not above the target
    core.later_wait_s = 1.0  # the decode stage adds a second
    t = core.submit(1, COLD)
    assert t.state is R and t.reason is not None and t.reason.code == EXPECTED_WAIT
    assert t.reason.retry_after_s == pytest.approx(6.0, rel=0.01)
    core.later_wait_s = 0.0
    assert core.submit(1, COLD).state is Q


# ---------------------------------------------------------------------- a time-to-first-token target


def test_the_lead_counts_against_the_target_but_never_refuses_what_runs_now() -> None:
    def core_at_target() -> AdmissionCore:
        clock = Clock()
        core = make(clock, 5.0)
        warm(core, clock, hold=10.0)
        fill(core)  # the next slot is 5 s away (0.2 slots/s): exactly the target
        return core

    assert core_at_target().submit(1, COLD, lead_s=0.0).state is Q
    refused = core_at_target().submit(1, COLD, lead_s=0.5)  # 5 s + its 0.5 s prefill: past it
    assert refused.state is R and refused.reason is not None and refused.reason.code == EXPECTED_WAIT
    assert refused.reason.retry_after_s == pytest.approx(5.5, rel=0.01)
    clock = Clock()
    idle = make(clock, 5.0)
    warm(idle, clock, hold=10.0)
    assert idle.submit(1, COLD, lead_s=60.0).state is G  # a free slot: it runs, however long its prefill


def test_the_flag_turns_the_target_into_a_ttft_target_and_needs_one() -> None:
    assert not policy_from_args(parser().parse_args([])).target_includes_prefill
    ns = parser().parse_args(["--admission-target-wait", "2", "--admission-target-includes-prefill"])
    assert policy_from_args(ns).target_includes_prefill
    from pdcoord.config import EtcdSettings
    from pdmaster.config import ConfigError, MasterConfig

    alone = AdmissionPolicy(target_includes_prefill=True)
    with pytest.raises(ConfigError, match="--admission-target-wait"):
        MasterConfig("m1", EtcdSettings(["127.0.0.1:2379"]), admission=alone)


def test_a_queued_request_waits_only_what_its_prefill_leaves_of_the_target() -> None:
    clock = Clock()
    core = make(clock, 5.0)
    warm(core, clock, hold=1.0)
    fill(core)  # 2 slots/s: the next slot 0.5 s away
    long_prompt = core.submit(1, COLD, lead_s=4.0)  # 0.5 + 4 s: within the target
    short_prompt = core.submit(1, COLD, lead_s=0.1)
    assert long_prompt.state is Q and short_prompt.state is Q
    assert long_prompt.deadline == pytest.approx(clock.now + 1.0)  # 5 s - its 4 s prefill
    assert short_prompt.deadline == pytest.approx(clock.now + 4.9)
    plain = core.submit(1, COLD)  # no lead: the target caps the class's wait, as before
    assert plain.deadline == pytest.approx(clock.now + 5.0)
    clock.now += 1.5
    core.expire()
    assert long_prompt.state is not Q and long_prompt.reason is not None
    assert short_prompt.state is Q


def test_with_the_peers_load_the_expected_wait_is_the_pooled_one() -> None:
    """Masters that hand waiters to each other (``--spill-peers``) judge an arrival over all of them:
    their queues stand ahead of it, their free room and the slots they serve drain this queue too."""
    clock = Clock()
    core = make(clock, 5.0)
    warm(core, clock, hold=10.0)
    fill(core)  # 0.2 slots/s here
    assert core.submit(1, COLD).state is Q
    assert core.expected_wait(COLD) == pytest.approx(10.0, rel=0.01)  # alone: refused
    assert core.submit(1, COLD).state is R
    core.set_peer_load(PeerLoad(free=1, rate=0.8))
    # one queued + its own slot, less the peer's free slot, over 0.2 + 0.8 slots/s
    assert core.expected_wait(COLD) == pytest.approx(1.0, rel=0.01)
    assert core.snapshot()["peer_load"] == {"free": 1, "queued_slots": 0, "rate_slots_per_s": 0.8}
    core.set_peer_load(PeerLoad(free=0, queued={COLD: 3}, rate=0.8))
    assert core.expected_wait(COLD) == pytest.approx(5.0, rel=0.01)  # the peer's cold queue is ahead
    # a continuation passes the cold queues at both (DRR gives cold 1/8 of its slot)
    assert core.expected_wait(CONT) == pytest.approx(1.125, rel=0.01)
    # a peer that reports no rate (an earlier release) leaves this master's own turnover
    core.set_peer_load(PeerLoad(free=1))
    assert core.expected_wait(COLD) == pytest.approx(1 / 0.2, rel=0.01)
    core.set_peer_load(PeerLoad(free=2, rate=1.8))
    t = core.submit(1, COLD)
    assert t.state is Q  # admitted: the peers' room and turnover are about to take the queue
    clock.now += PEER_LOAD_TTL_S + 0.01  # a report this old has moved on: this master alone again
    assert core.snapshot()["peer_load"] is None
    assert core.expected_wait(COLD) == pytest.approx(15.0, rel=0.05)
    assert core.submit(1, COLD).state is R


def test_a_hand_off_takes_the_peers_room_and_is_not_served_here() -> None:
    clock = Clock()
    core = make(clock, None)
    warm(core, clock, hold=10.0)
    fill(core)
    waiting = [core.submit(1, COLD) for _ in range(2)]
    assert core.load() == PeerLoad(0, {COLD: 2}, pytest.approx(0.2, rel=0.01), 2)
    core.set_peer_load(PeerLoad(free=3, rate=1.0))
    before = core.completion_rate()
    core.hand_off(waiting[0])
    assert core.snapshot()["peer_load"]["free"] == 2  # the waiter took a slot of the peers' room
    assert core.completion_rate() is not None and before is not None and core.completion_rate() > before
    # what this master serves itself (what it tells its peers) leaves the hand-off out
    assert core.completion_rate(handed=False) == pytest.approx(before, rel=0.01)
    assert core.load().queued == {COLD: 1}


def test_with_the_peers_load_the_queue_is_bounded_over_their_slots_too() -> None:
    """One master over the pooled slots would queue a wave of all of them: a master whose peers take
    its waiters queues past its own wave, less what the peers queue themselves."""
    clock = Clock()
    core = AdmissionCore(AdmissionPolicy(queue_waves=1.0), clock=clock)
    core.set_shares({"d1": 2})
    fill(core)
    assert [core.submit(1, COLD).state for _ in range(3)] == [Q, Q, R]  # a wave of its own 2 slots
    core.set_peer_load(PeerLoad(capacity=6, queued={CONT: 3}))
    # a wave of 2 + 6 slots, less the peers' 3 queued: 5 here
    assert [core.submit(1, COLD).state for _ in range(4)] == [Q, Q, Q, R]
    assert core.queued_slots == 5
    clock.now += PEER_LOAD_TTL_S + 0.01
    assert core.submit(1, COLD).state is R


def test_a_request_whose_prefill_alone_breaks_its_target_misses_it_even_now() -> None:
    """What keeps such a request from spilling to a peer's free slot (it would be served late there;
    one master runs it only if it can start at once)."""
    clock = Clock()
    core = make(clock, targets(1.3, 1.8, 0))
    assert core.misses_target(CONT, 1.31) and not core.misses_target(CONT, 1.3)
    assert core.misses_target(PROB, 2.0) and not core.misses_target(PROB, 1.0)
    assert not core.misses_target(COLD, 100.0)  # no target
    core.later_wait_s = 0.5  # two-stage admission: the decode stage's wait counts too
    assert core.misses_target(PROB, 1.4)
    ctl = AdmissionController(
        AdmissionPolicy(target_wait_s=targets(1.3, 1.8, 1.8)), registry=CollectorRegistry()
    )
    assert ctl.misses_target(COLD, 1.9) and not ctl.misses_target(COLD, 1.7)


def test_a_request_that_could_run_now_is_refused_for_the_prefill_backlog_ahead_of_it() -> None:
    """Prefill in tokens (DESIGN §13): free decode room does not make a request's first token come in
    time when other prompts queue at the prefill engines ahead of it. Its own prefill never refuses it;
    the backlog does, once it is what breaks the target."""
    clock = Clock()
    idle = make(clock, 2.0, capacity=8)
    warm(idle, clock, hold=10.0)
    # 3 s of prefill, all its own (an idle prefill node): it runs, however long its prefill
    assert idle.submit(1, COLD, lead_s=3.0, backlog_s=0.0).state is G
    # 1 s of its own behind 1.5 s of others' prompts: past the target because of them
    late = idle.submit(1, COLD, lead_s=2.5, backlog_s=1.5)
    assert late.state is R and late.reason is not None and late.reason.code == EXPECTED_WAIT
    assert late.reason.retry_after_s == pytest.approx(2.5, rel=0.01)
    # within the target with the backlog: it runs
    assert idle.submit(1, COLD, lead_s=1.9, backlog_s=1.5).state is G
    # a backlog on top of an own prefill that alone breaks the target: not the backlog's doing
    assert idle.submit(1, COLD, lead_s=4.0, backlog_s=0.5).state is G
