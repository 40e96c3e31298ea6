"""Unit tests of the admission core, one (or a few) per behaviour of DESIGN §6."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdmaster.admission import (
    AdmissionCore,
    AdmissionPolicy,
    RequestClass,
    Ticket,
    TicketState,
)

CONT = RequestClass.CONTINUATION
PROB = RequestClass.PROBABLE_CACHE_HIT
COLD = RequestClass.COLD
Q, G = TicketState.QUEUED, TicketState.GRANTED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(shares: dict[str, int], clock: Clock | None = None, **policy: object) -> AdmissionCore:
    core = AdmissionCore(AdmissionPolicy(**policy), clock=clock or Clock())  # type: ignore[arg-type]
    core.set_shares(shares)
    return core


def granted(changes: list[Ticket]) -> list[Ticket]:
    return [t for t in changes if t.state is G]


def max_free(core: AdmissionCore) -> int:
    """Free slots on the emptiest node."""
    return max([0, *(n["share"] - n["active"] for n in core.snapshot()["nodes"].values())])


def queue_bound(core: AdmissionCore) -> int:
    return int(core.snapshot()["queue_bound_slots"])


def done(t: Ticket) -> bool:
    """The ticket has ended: refused, expired, cancelled, evicted, or granted and released."""
    return t.state is not Q and (t.state is not G or t.released)


def test_drr_capacity_one_grants_8_then_3_then_1() -> None:
    core = make({"d1": 1}, queue_waves=20)
    blocker = core.submit(1, COLD)
    assert blocker.state is G and blocker.node == "d1"
    # arrival order deliberately mixed, COLD first
    for cls in [COLD, PROB, CONT, PROB, CONT, CONT, PROB, CONT, CONT, CONT, CONT, CONT]:
        assert core.submit(1, cls).state is Q
    order = []
    cur = blocker
    for _ in range(12):
        (cur,) = granted(core.release(cur))
        order.append(cur.request_class)
    assert order == [CONT] * 8 + [PROB] * 3 + [COLD]


def test_drr_weights_are_configurable() -> None:
    core = make({"d1": 1}, queue_waves=20, weights={CONT: 2, PROB: 1, COLD: 1})
    cur = core.submit(1, COLD)
    for cls in [COLD, COLD, PROB, PROB, CONT, CONT, CONT, CONT]:
        core.submit(1, cls)
    order = []
    for _ in range(8):
        (cur,) = granted(core.release(cur))
        order.append(cur.request_class)
    assert order == [CONT, CONT, PROB, COLD, CONT, CONT, PROB, COLD]


def test_drr_is_charged_in_slots() -> None:
    core = make({"d1": 2}, queue_waves=50, weights={CONT: 2, PROB: 1, COLD: 2})
    big = core.submit(2, COLD)
    for _ in range(4):
        core.submit(2, CONT)
    for _ in range(8):
        core.submit(1, COLD)
    got = granted(core.release(big))
    assert [(t.request_class, t.slots) for t in got] == [(CONT, 2)]
    # one 2-slot gang costs CONT its whole quantum: the next wave is COLD's two singles
    got = granted(core.release(got[0]))
    assert [(t.request_class, t.slots) for t in got] == [(COLD, 1), (COLD, 1)]


def test_fifo_inside_a_class() -> None:
    core = make({"d1": 1}, queue_waves=10)
    first = core.submit(1, COLD)
    waiting = [core.submit(1, COLD) for _ in range(5)]
    cur, seen = first, []
    for _ in range(5):
        (cur,) = granted(core.release(cur))
        seen.append(cur)
    assert seen == waiting


def test_gang_backfill_then_reservation_then_runs() -> None:
    core = make({"d1": 4}, queue_waves=8, backfill_waves=1.0)
    running = [core.submit(1, COLD) for _ in range(3)]
    gang = core.submit(4, COLD)
    assert gang.state is Q
    smalls = [core.submit(1, COLD) for _ in range(6)]
    # the 4th slot is free: the gang does not fit, a later small request backfills at once
    assert smalls[0].state is G
    snap = core.snapshot()["backfill"]
    assert snap["gang_ticket"] == gang.id and snap["used_slots"] == 1 and not snap["reserved"]
    running.append(smalls[0])
    backfilled = 1
    while not core.snapshot()["backfill"]["reserved"]:
        got = granted(core.release(running.pop(0)))
        assert got and got[0] in smalls and gang.state is Q
        running.extend(got)
        backfilled += len(got)
    assert backfilled == 4  # exactly one decode wave (capacity 4) of backfill
    # reserved: freed slots now wait for the gang, nothing else bypasses it
    for _ in range(3):
        assert core.release(running.pop(0)) == []
        assert max_free(core) > 0
    assert core.active == 1
    got = granted(core.release(running.pop(0)))
    assert got == [gang] and gang.node == "d1"
    snap = core.snapshot()["backfill"]
    assert snap["gang_ticket"] is None and not snap["reserved"] and snap["used_slots"] == 0
    assert core.release(gang) and all(t.state is G for t in smalls[4:6])


def test_gang_needs_all_slots_on_one_node() -> None:
    core = make({"d1": 4, "d2": 4}, queue_waves=4)
    held = [core.submit(1, COLD) for _ in range(6)]
    assert {core.active_on("d1"), core.active_on("d2")} == {3}  # spread over nodes
    core.release(held[0])
    core.release(held[1])  # 4 slots free in total, at most 2 on one node
    gang = core.submit(4, CONT)
    assert gang.state is Q
    nodes = {"d1": [t for t in held[2:] if t.node == "d1"], "d2": [t for t in held[2:] if t.node == "d2"]}
    target = "d1" if len(nodes["d1"]) <= len(nodes["d2"]) else "d2"
    changes: list[Ticket] = []
    for t in nodes[target]:
        changes += core.release(t)
    assert gang.state is G and gang.node == target and gang in changes
    assert core.active_on(target) == 4


def test_full_queue_of_session_blocked_waiters_cannot_idle_slots() -> None:
    core = make({"d1": 4}, queue_waves=1.0)
    lease = core.submit(1, COLD, session_id="s")
    blocked = [core.submit(1, CONT, session_id="s") for _ in range(4)]
    assert lease.state is G and all(t.state is Q for t in blocked)
    assert core.queued_slots == queue_bound(core) == 4
    # the queue is full but every waiter is session-blocked: arrivals that fit run at once
    other = core.submit(1, COLD, session_id="other")
    anon = core.submit(1, COLD)
    assert other.state is G and anon.state is G and core.active == 3
    # ...but never past the blocked session's own FIFO
    same = core.submit(1, CONT, session_id="s")
    assert same.state is TicketState.REJECTED and same.reason and same.reason.code == "queue_full"
    assert same.reason.retry_after_s is not None


def test_same_session_fifo_while_other_sessions_proceed() -> None:
    core = make({"d1": 2}, queue_waves=4)
    a = core.submit(1, COLD, session_id="s")
    b = core.submit(1, CONT, session_id="s")
    c = core.submit(1, CONT, session_id="s")
    assert a.state is G and b.state is Q and c.state is Q
    t1 = core.submit(1, COLD, session_id="t")
    assert t1.state is G  # another session passes the blocked one
    core.release(t1)
    u1 = core.submit(1, COLD)
    assert u1.state is G and b.state is Q
    assert granted(core.release(a)) == [b]
    assert c.state is Q  # at most one lease per session
    assert granted(core.release(b)) == [c]
    core.release(c)
    assert core.snapshot()["sessions"] == 0


def test_session_waiter_cancelled_passes_headship_on() -> None:
    core = make({"d1": 1}, queue_waves=4)
    a = core.submit(1, COLD, session_id="s")
    b = core.submit(1, COLD, session_id="s")
    c = core.submit(1, COLD, session_id="s")
    assert core.cancel(b) == [b] and b.state is TicketState.CANCELLED
    assert granted(core.release(a)) == [c]


def test_promotion_moves_waiters_keeps_order_and_extends_deadline() -> None:
    clock = Clock()
    core = make({"d1": 1}, clock, queue_waves=10)
    blocker = core.submit(1, COLD)
    p1 = core.submit(1, PROB)
    s1 = core.submit(1, COLD, session_id="s")
    s2 = core.submit(1, COLD, session_id="s")
    assert s1.deadline == pytest.approx(clock.now + 5)
    assert core.promote_session("s") == []
    assert s1.request_class is CONT and s2.request_class is CONT
    assert s1.deadline == pytest.approx(s1.enqueued_at + 30) and s2.deadline == pytest.approx(
        s2.enqueued_at + 30
    )
    snap = core.snapshot()["classes"]
    assert snap["continuation"]["queued_requests"] == 2 and snap["cold"]["queued_requests"] == 0
    clock.now += 10  # past COLD and within CONTINUATION timeouts
    assert core.expire() == [] and s1.state is Q and p1.state is Q
    clock.now += 6  # p1 (PROB, 15 s) times out
    assert core.expire() == [p1] and p1.reason and p1.reason.code == "timeout"
    assert granted(core.release(blocker)) == [s1]
    assert granted(core.release(s1)) == [s2]


def test_replacement_evicts_lowest_class_newest_first_all_or_nothing() -> None:
    core = make({"d1": 2}, queue_waves=1)
    core.submit(1, COLD), core.submit(1, COLD)
    c1, c2 = core.submit(1, COLD), core.submit(1, COLD)
    assert core.queued_slots == 2 == queue_bound(core)
    refused = core.submit(1, COLD)  # same class: no replacement
    assert refused.state is TicketState.REJECTED and refused.reason and refused.reason.code == "queue_full"
    p = core.submit(1, PROB)
    assert p.state is Q and c2.state is TicketState.EVICTED and c1.state is Q
    assert c2.reason and c2.reason.code == "evicted" and c2.reason.retry_after_s is not None
    assert core.last_changes == [c2]
    # CONT gang of 2 needs both queued slots: COLD c1 first, then PROB p
    gang = core.submit(2, CONT)
    assert gang.state is Q and c1.state is TicketState.EVICTED and p.state is TicketState.EVICTED
    # all-or-nothing: a PROB arrival cannot evict CONT, nothing is touched
    p2 = core.submit(1, PROB)
    assert p2.state is TicketState.REJECTED and gang.state is Q


def test_replacement_refuses_when_lower_classes_do_not_free_enough() -> None:
    core = make({"d1": 2}, queue_waves=1.5)  # bound 3 slots
    core.submit(2, COLD)
    g = core.submit(2, PROB)
    c = core.submit(1, COLD)
    assert g.state is Q and c.state is Q and core.queued_slots == 3
    gang = core.submit(2, CONT)  # needs 2 queued slots: COLD c goes first, then PROB g
    assert gang.state is Q and c.state is TicketState.EVICTED and g.state is TicketState.EVICTED
    core2 = make({"d1": 2}, queue_waves=1.5)
    core2.submit(2, COLD)
    h = core2.submit(2, CONT)
    k = core2.submit(1, COLD)
    big = core2.submit(2, PROB)  # only COLD k (1 slot) is lower: not enough → refuse, evict nobody
    assert big.state is TicketState.REJECTED and k.state is Q and h.state is Q


def test_immediate_failures_carry_codes_and_retry_hints() -> None:
    core = AdmissionCore(AdmissionPolicy(), clock=Clock())
    t = core.submit(1, COLD)
    assert t.state is TicketState.REJECTED and t.reason and t.reason.code == "no_capacity"
    assert t.reason.retry_after_s
    core.set_shares({"d1": 2, "d2": 2}, node_capacity={"d1": 4, "d2": 2})
    t = core.submit(3, COLD)  # fits d1 when the fleet is whole, not now
    assert t.reason and t.reason.code == "cannot_fit_now" and t.reason.retry_after_s
    t = core.submit(5, COLD)  # never fits
    assert t.reason and (t.reason.code, t.reason.retry_after_s) == ("unsatisfiable", None)
    t = core.submit(0, COLD)
    assert t.reason and (t.reason.code, t.reason.retry_after_s) == ("invalid", None)
    outcomes = core.snapshot()["outcomes"]["cold"]
    assert outcomes["no_capacity"] == 1 and outcomes["cannot_fit_now"] == 1 and outcomes["unsatisfiable"] == 1


def test_shrink_fails_unfittable_gangs_trims_and_drains() -> None:
    core = make({"d1": 4, "d2": 4}, queue_waves=1.0)
    held = [core.submit(1, COLD) for _ in range(8)]
    gang = core.submit(4, PROB)
    cold = [core.submit(1, COLD) for _ in range(2)]
    cont = core.submit(1, CONT)
    prob = core.submit(1, PROB)
    assert core.queued_slots == 8
    changes = core.set_shares({"d1": 2, "d2": 2}, node_capacity={"d1": 4, "d2": 4})
    assert gang.state is TicketState.REJECTED and gang.reason and gang.reason.code == "cannot_fit_now"
    # new bound 4 slots: 4 queued singles remain, none trimmed; shrink further → trim COLD newest first
    assert core.queued_slots == 4 and gang in changes
    changes = core.set_shares({"d1": 2}, node_capacity={"d1": 4})
    assert queue_bound(core) == 2 and core.queued_slots == 2
    assert cold[1].state is TicketState.EVICTED and cold[0].state is TicketState.EVICTED
    assert cont.state is Q and prob.state is Q and set(changes) == {cold[0], cold[1]}
    # granted leases run on (8 active > capacity 2) and drain; no new grant until below the share
    assert core.active == 8
    on_d1 = [t for t in held if t.node == "d1"]
    on_d2 = [t for t in held if t.node == "d2"]
    for t in on_d2:
        assert granted(core.release(t)) == []
    for t in on_d1[:2]:
        assert granted(core.release(t)) == []
    assert granted(core.release(on_d1[2])) == [cont]
    assert core.active_on("d1") == 2 and core.active_on("d2") == 0


def test_zero_capacity_fails_everything_queued() -> None:
    core = make({"d1": 1}, queue_waves=10)
    lease = core.submit(1, COLD)
    queued = [core.submit(n, c) for n, c in [(1, CONT), (1, PROB), (1, COLD)]]
    changes = core.set_shares({})
    assert set(changes) == set(queued)
    for t in queued:
        assert t.state is TicketState.REJECTED and t.reason and t.reason.code == "no_capacity"
        assert t.reason.retry_after_s
    assert core.queued_slots == 0 and core.active == 1
    assert core.release(lease) == [] and core.active == 0


def _reserved_gang(clock: Clock) -> tuple[AdmissionCore, Ticket, list[Ticket], list[Ticket]]:
    core = make({"d1": 2}, clock, queue_waves=8, backfill_waves=1.0)
    running = [core.submit(1, COLD), core.submit(1, COLD)]
    gang = core.submit(2, CONT)
    smalls = [core.submit(1, COLD) for _ in range(5)]
    for _ in range(2):
        running += granted(core.release(running.pop(0)))
    assert core.snapshot()["backfill"]["reserved"]
    core.release(running.pop(0))
    assert max_free(core) == 1 and gang.state is Q
    return core, gang, running, smalls


def test_cancel_of_reserved_gang_clears_reservation() -> None:
    core, gang, _, smalls = _reserved_gang(Clock())
    changes = core.cancel(gang)
    assert gang in changes and gang.state is TicketState.CANCELLED
    assert granted(changes) == [smalls[2]]  # the idle slot goes to the next waiter at once
    bf = core.snapshot()["backfill"]
    assert bf["gang_ticket"] is None and not bf["reserved"] and bf["used_slots"] == 0


def test_timeout_of_reserved_gang_clears_reservation() -> None:
    clock = Clock()
    core, gang, _, smalls = _reserved_gang(clock)
    # the gang (CONT, 30 s) outlives the COLD smalls (5 s) only if they are younger; move past both
    clock.now += 31
    changes = core.expire()
    assert gang.state is TicketState.EXPIRED and gang.reason and gang.reason.code == "timeout"
    assert not core.snapshot()["backfill"]["reserved"] and core.snapshot()["backfill"]["gang_ticket"] is None
    assert all(t.state is TicketState.EXPIRED for t in smalls[2:]) and set(smalls[2:]) <= set(changes)


def test_next_deadline_and_expire() -> None:
    clock = Clock()
    core = make({"d1": 1}, clock, queue_waves=10)
    assert core.next_deadline() is None
    core.submit(1, COLD)
    cold = core.submit(1, COLD)
    cont = core.submit(1, CONT)
    assert core.next_deadline() == pytest.approx(clock.now + 5)
    core.cancel(cold)
    assert core.next_deadline() == pytest.approx(clock.now + 30)
    clock.now += 29.9
    assert core.expire() == []
    clock.now += 0.1
    assert core.expire() == [cont] and core.next_deadline() is None


def test_equal_shares_do_not_disturb_drr_or_backfill_state() -> None:
    core = make({"d1": 2, "d2": 1}, queue_waves=10)
    held = [core.submit(1, COLD) for _ in range(3)]
    for c in [CONT, CONT, PROB, COLD, CONT]:
        core.submit(1, c)
    core.submit(2, COLD)
    core.release(held[0])
    before = core.snapshot()
    assert core.set_shares({"d1": 2, "d2": 1, "d3": 0}) == []
    assert core.set_shares({"d2": 1, "d1": 2}) == []
    assert core.snapshot() == before


def test_growth_drives_the_queue_at_once() -> None:
    core = make({"d1": 1}, queue_waves=5)
    core.submit(1, COLD)
    waiting = [core.submit(1, COLD) for _ in range(3)]
    changes = core.set_shares({"d1": 1, "d2": 3})
    assert set(granted(changes)) == set(waiting)
    assert all(t.node == "d2" for t in waiting)


def test_release_is_idempotent_and_cancel_of_granted_releases() -> None:
    core = make({"d1": 1}, queue_waves=5)
    a = core.submit(1, COLD)
    b = core.submit(1, COLD)
    assert granted(core.release(a)) == [b]
    assert core.release(a) == [] and core.active == 1
    assert core.cancel(b) == [] and b.released and core.active == 0
    assert core.release(b) == [] and core.active == 0
    assert done(a) and done(b)


def test_bypass_grants_everything_and_only_counts() -> None:
    core = make({"d1": 1}, bypass=True)
    ts = [core.submit(4, COLD, session_id="s") for _ in range(5)]
    assert all(t.state is G for t in ts) and core.active == 20 and core.queued_slots == 0
    none = AdmissionCore(AdmissionPolicy(bypass=True), clock=Clock()).submit(1, COLD)
    assert none.state is G and none.node is None
    for t in ts:
        core.release(t)
        core.release(t)
    assert core.active == 0 and core.snapshot()["bypass"] is True


def test_snapshot_and_wanted_slots() -> None:
    core = make({"d1": 2, "d2": 2}, queue_waves=2)
    core.submit(2, CONT), core.submit(1, COLD), core.submit(1, COLD)
    core.submit(2, PROB)
    core.submit(1, COLD)
    snap = core.snapshot()
    assert snap["capacity"] == 4 and snap["active"] == 4 and snap["queued_slots"] == 3
    assert core.wanted_slots() == 3 and snap["classes"]["probable_cache_hit"]["queued_slots"] == 2
    assert (
        snap["nodes"]["d1"]["share"] == 2
        and snap["nodes"]["d1"]["active"] + snap["nodes"]["d2"]["active"] == 4
    )
    assert snap["outcomes"]["continuation"]["granted"] == 1


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        AdmissionPolicy(weights={CONT: 8, PROB: 0, COLD: 1})
    with pytest.raises(ValueError):
        AdmissionPolicy(queue_waves=-1)
    with pytest.raises(ValueError):
        make({"d1": -1})


def test_promoted_waiters_time_out_in_deadline_order_among_native_ones() -> None:
    clock = Clock()
    core = make({"d1": 1}, clock, queue_waves=10, max_wait_s={CONT: 10, PROB: 15, COLD: 20})
    blocker = core.submit(1, COLD, session_id="s")
    s1 = core.submit(1, COLD, session_id="s")  # deadline +20, and stays +20 (more than CONT's 10)
    clock.now += 1
    c1 = core.submit(1, CONT)  # deadline 111
    clock.now += 1
    c2 = core.submit(1, CONT)  # deadline 112
    core.promote_session("s")
    assert s1.request_class is CONT and s1.deadline == pytest.approx(120)
    assert core.next_deadline() == pytest.approx(111)
    clock.now = 111
    assert core.expire() == [c1]
    clock.now = 120
    assert core.expire() == [c2, s1]  # 112 before 120, though s1 arrived first
    core.release(blocker)


def test_trim_evicts_newest_first_across_native_and_promoted_waiters() -> None:
    core = make({"d1": 1, "d2": 3}, queue_waves=1)
    held = [core.submit(1, COLD) for _ in range(3)]
    lease = core.submit(1, COLD, session_id="s")
    s1 = core.submit(1, COLD, session_id="s")
    c1 = core.submit(1, CONT)
    c2 = core.submit(1, CONT)
    core.promote_session("s")
    assert [t.state for t in (s1, c1, c2)] == [Q, Q, Q] and s1.request_class is CONT
    changes = core.set_shares({"d1": 1, "d2": 1})  # bound 2 slots: one of three waiters goes
    assert changes == [c2]
    changes = core.set_shares({"d1": 1})  # bound 1
    assert changes == [c1] and s1.state is Q
    for t in [*held, lease]:
        core.release(t)


def test_a_clock_that_goes_back_still_times_out_in_deadline_order() -> None:
    clock = Clock()
    core = make({"d1": 1}, clock, queue_waves=10)
    core.submit(1, COLD)
    late = core.submit(1, COLD)  # deadline 105
    clock.now -= 2
    early = core.submit(1, COLD)  # deadline 103, arrived after ``late``
    assert core.next_deadline() == pytest.approx(103)
    clock.now = 104
    assert core.expire() == [early]
    clock.now = 105
    assert core.expire() == [late]


# --- resubmissions: a request retried after an engine failed it (avoid, kept deadline, ahead of newer)


def test_a_grant_never_goes_to_an_avoided_node() -> None:
    core = make({"d1": 4, "d2": 2})  # d1 has the most free slots: a normal request goes there
    assert core.submit(1, COLD).node == "d1"
    t = core.submit(1, COLD, avoid=frozenset({"d1"}), deadline=105.0)
    assert t.state is G and t.node == "d2"
    assert core.submit(1, COLD, avoid=frozenset({"d1"})).node == "d2"  # avoid without a deadline too


def test_with_room_only_on_an_avoided_node_the_retry_waits_then_goes_elsewhere() -> None:
    clock = Clock()
    core = make({"d1": 1, "d2": 1}, clock)
    on_d2 = core.submit(1, COLD)
    on_d1 = core.submit(1, COLD)
    assert {on_d1.node, on_d2.node} == {"d1", "d2"}
    if on_d1.node != "d1":
        on_d1, on_d2 = on_d2, on_d1
    core.release(on_d1)  # room on d1 only
    retry = core.submit(1, COLD, avoid=frozenset({"d1"}), deadline=clock.now + 5)
    assert retry.state is Q
    other = core.submit(1, COLD)  # anyone else may use d1 meanwhile
    assert other.state is G and other.node == "d1"
    assert granted(core.release(other)) == []  # d1 free again: still not for the retry
    assert granted(core.release(on_d2)) == [retry] and retry.node == "d2"


def test_a_retry_keeps_its_deadline() -> None:
    clock = Clock()
    core = make({"d1": 1, "d2": 1}, clock)
    a, b = core.submit(1, COLD), core.submit(1, COLD)
    clock.now += 1.0  # the first lease ran 1 s; its deadline was 103 (a 3 s wait from 100)
    retry = core.submit(1, COLD, avoid=frozenset({"zz"}), deadline=103.0)
    assert retry.state is Q and retry.deadline == 103.0 and core.next_deadline() == 103.0
    clock.now = 102.9
    assert core.expire() == []
    clock.now = 103.0
    assert core.expire() == [retry] and retry.state is TicketState.EXPIRED
    assert retry.reason is not None and retry.reason.code == "timeout"
    # a deadline already past: granted if there is room now, else timed out at once
    late = core.submit(1, COLD, deadline=100.0)
    assert late.state is TicketState.EXPIRED and core.queued_requests == 0
    core.release(a)
    late = core.submit(1, COLD, deadline=100.0)
    assert late.state is G
    del b


def test_a_retry_goes_before_newer_and_older_first_time_waiters() -> None:
    clock = Clock()
    core = make({"d1": 1, "d2": 1}, clock, queue_waves=5)
    x, y = core.submit(1, COLD), core.submit(1, COLD)
    older = core.submit(1, COLD)
    retry = core.submit(1, COLD, avoid=frozenset({"dx"}), deadline=clock.now + 5)
    newer = core.submit(1, COLD)
    assert older.state is Q and retry.state is Q and newer.state is Q
    assert granted(core.release(x)) == [retry]
    assert granted(core.release(y)) == [older]
    assert newer.state is Q


def test_a_retry_is_not_charged_to_its_class_nor_held_by_its_session() -> None:
    clock = Clock()
    core = make({"d1": 1}, clock, queue_waves=5)
    blocker = core.submit(1, COLD, session_id="s")
    before = core.snapshot()["classes"]["cold"]["deficit"]
    retry = core.submit(1, COLD, session_id="s", deadline=clock.now + 5)
    assert retry.state is Q and retry.session_id is None
    assert granted(core.release(blocker)) == [retry]
    assert core.snapshot()["classes"]["cold"]["deficit"] == before
    assert core.snapshot()["queued_retries"] == 0


def test_a_retry_over_a_full_queue_displaces_newest_first_time_waiters() -> None:
    clock = Clock()
    core = make({"d1": 2}, clock)  # bound 2 slots
    core.submit(1, COLD), core.submit(1, COLD)
    w1, w2 = core.submit(1, COLD), core.submit(1, COLD)
    assert core.submit(1, COLD).state is TicketState.REJECTED  # full
    retry = core.submit(1, COLD, deadline=clock.now + 5)
    assert retry.state is Q and w2.state is TicketState.EVICTED and w1.state is Q


def test_a_gang_retry_is_failed_by_a_shrink_like_any_gang() -> None:
    clock = Clock()
    core = make({"d1": 4, "d2": 4}, clock)
    core.submit(4, COLD), core.submit(4, COLD)
    retry = core.submit(4, COLD, avoid=frozenset({"d1"}), deadline=clock.now + 5)
    assert retry.state is Q
    core.set_shares({"d1": 2, "d2": 2}, {"d1": 8, "d2": 8})
    assert retry.state is TicketState.REJECTED and core.queued_requests == 0
    assert core.snapshot()["queued_retries"] == 0


def test_avoiding_every_node_with_room_skips_nothing_else() -> None:
    core = make({f"d{i}": 1 for i in range(6)})
    avoid = frozenset({"d0", "d1", "d2"})
    got = [core.submit(1, COLD, avoid=avoid, deadline=1e9) for _ in range(4)]
    assert sorted(t.node or "" for t in got[:3]) == ["d3", "d4", "d5"] and got[3].state is Q
    # the heap still knows every node: normal requests fill the avoided ones
    assert sorted(core.submit(1, COLD).node or "" for _ in range(3)) == ["d0", "d1", "d2"]


NODES = ["d1", "d2", "d3", "d4"]
share_updates = st.dictionaries(st.sampled_from(NODES), st.integers(0, 6), min_size=1, max_size=4)
admission_ops = st.lists(
    st.one_of(
        st.tuples(st.just("shares"), share_updates, st.integers(0, 3)),
        st.tuples(st.just("submit"), st.integers(1, 4), st.sampled_from([CONT, PROB, COLD])),
        st.tuples(st.just("release"), st.integers(0, 50), st.just(None)),
    ),
    max_size=40,
)


def outcome(changes: list[Ticket]) -> list[tuple[int, str, str | None]]:
    return [(t.id, t.state.value, t.node) for t in changes]


@given(admission_ops)
@settings(max_examples=150, deadline=None)
def test_updating_some_shares_equals_setting_them_all(ops: list[tuple[str, object, object]]) -> None:
    """A master applies share changes as they come (``update_shares``, a few nodes at a time); that
    must leave admission exactly where setting the whole table (``set_shares``) would."""
    full, inc = Clock(), Clock()
    a = AdmissionCore(AdmissionPolicy(queue_waves=1.0), clock=full)
    b = AdmissionCore(AdmissionPolicy(queue_waves=1.0), clock=inc)
    table: dict[str, int] = {}
    caps: dict[str, int] = {}
    granted_a: list[Ticket] = []
    granted_b: list[Ticket] = []
    for kind, x, y in ops:
        if kind == "shares":
            assert isinstance(x, dict) and isinstance(y, int)
            for n, s in x.items():
                table[n] = s
                caps[n] = s + y  # the node's full capacity, at least the share
            ra = a.set_shares({n: s for n, s in table.items() if s}, caps)
            rb = b.update_shares(dict(x), {n: caps[n] for n in x})
        elif kind == "submit":
            assert isinstance(x, int) and isinstance(y, RequestClass)
            a.submit(x, y), b.submit(x, y)
            ra, rb = a.last_changes, b.last_changes
        else:
            assert isinstance(x, int)
            if not granted_a:
                continue
            ta, tb = granted_a.pop(x % len(granted_a)), granted_b.pop(x % len(granted_b))
            ra, rb = a.release(ta), b.release(tb)
        assert outcome(ra) == outcome(rb)
        granted_a += [t for t in ra if t.state is G and not t.released]
        granted_b += [t for t in rb if t.state is G and not t.released]
        full.now += 0.01
        inc.now += 0.01
    sa, sb = a.snapshot(), b.snapshot()
    assert sa == sb


def test_queue_bound_keeps_the_even_part_when_a_demand_split_shrinks_the_share() -> None:
    # Two nodes of 8 slots, 2 masters; a demand split left this master 1 slot on each.
    core = AdmissionCore(AdmissionPolicy(queue_waves=1.0), clock=Clock())
    core.set_shares({"d1": 1, "d2": 1}, node_capacity={"d1": 8, "d2": 8})
    assert queue_bound(core) == 2  # master count unknown: the bound follows the share held
    core.set_masters(2)
    assert queue_bound(core) == 8 and core.snapshot()["masters"] == 2  # 16 slots ÷ 2 masters
    running = [core.submit(1, COLD) for _ in range(2)]
    queued = [core.submit(1, COLD) for _ in range(8)]
    assert all(t.state is G for t in running) and all(t.state is Q for t in queued)
    # what it queues is what it reports as demand: the split can now see it
    assert core.wanted_slots() == 8
    assert core.submit(1, COLD).reason.code == "queue_full"  # type: ignore[union-attr]
    # holding more than its even part (the other master drains), the bound follows the share
    core.update_shares({"d1": 8, "d2": 8}, node_capacity={"d1": 8, "d2": 8})
    assert queue_bound(core) == 16 and all(t.state is G for t in queued)
    # back to 1 slot per node with 4 masters: the even part is 4 slots
    core.update_shares({"d1": 1, "d2": 1}, node_capacity={"d1": 8, "d2": 8})
    core.set_masters(4)
    assert queue_bound(core) == 4
    later = [core.submit(1, COLD) for _ in range(5)]
    assert [t.state for t in later[:4]] == [Q] * 4 and later[4].reason.code == "queue_full"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="masters"):
        core.set_masters(-1)


def test_granted_on_counts_every_slot_ever_granted_on_a_node() -> None:
    """An Ack's kept_slots is the slots held now minus those granted since the previous Ack: the
    count must only grow, gangs counting each slot, releases leaving it alone."""
    core = make({"d1": 2, "d2": 2})
    first = core.submit(1, COLD)
    node = first.node
    assert node is not None and core.granted_on(node) == 1
    core.release(first)
    gang = core.submit(2, COLD)
    assert gang.state is G and gang.node is not None
    assert core.granted_on(gang.node) == (3 if gang.node == node else 2)
    core.release(gang)
    assert core.granted_on(gang.node) == (3 if gang.node == node else 2)
    assert core.granted_on("elsewhere") == 0


def test_a_lease_whose_decode_end_the_master_cannot_see_is_not_sure() -> None:
    """Once the master stops reading a lease's answer (a slow client), the engine may finish it
    unseen: it leaves ``sure_on`` (the base of an Ack's kept_slots) but still counts as active, and
    leaves both when released."""
    core = make({"d1": 4})
    gang, one, two, queued = (
        core.submit(2, COLD),
        core.submit(1, COLD),
        core.submit(1, COLD),
        core.submit(1, COLD),
    )
    assert [t.state for t in (gang, one, two, queued)] == [G, G, G, Q]
    assert core.sure_on("d1") == core.active_on("d1") == 4
    core.end_unseen(gang)
    core.end_unseen(gang)  # idempotent
    assert core.sure_on("d1") == 2 and core.active_on("d1") == 4
    assert core.snapshot()["unseen_slots"] == 2
    core.end_unseen(queued)  # not running: nothing to mark
    assert core.sure_on("d1") == 2
    core.release(gang)  # frees 2 slots: the queued request takes one, seen
    assert queued.state is G and core.active_on("d1") == 3 and core.sure_on("d1") == 3
    assert core.snapshot()["unseen_slots"] == 0
    core.end_unseen(gang)  # released: nothing to mark
    assert core.sure_on("d1") == 3 and core.sure_on("elsewhere") == 0


def test_a_lease_counts_as_in_decode_from_its_decode_request_to_its_end_or_unseen() -> None:
    """An Ack's kept_slots counts from the leases whose decode request went out (the engine holds
    them) and whose end the master sees: ``in_decode_on`` follows them."""
    core = make({"d1": 4})
    a, b, c = core.submit(2, COLD), core.submit(1, COLD), core.submit(1, COLD)
    assert core.in_decode_on("d1") == 0 and core.active_on("d1") == 4  # granted, still in the prefill
    core.decode_sent(a)
    core.decode_sent(a)  # idempotent
    core.decode_sent(b)
    assert core.in_decode_on("d1") == 3
    core.end_unseen(b)  # its relay paused for a slow client
    core.end_unseen(c)  # not sent yet: once sent it does not count either
    core.decode_sent(c)
    assert core.in_decode_on("d1") == 2
    for t in (a, b, c):
        core.release(t)
    assert core.in_decode_on("d1") == 0
    core.decode_sent(a)  # released: nothing
    assert core.in_decode_on("d1") == 0 and core.in_decode_on("elsewhere") == 0


def test_kept_since_counts_exactly_the_leases_in_decode_at_both_acks() -> None:
    """Whatever turned over between two Acks, kept is the slots in decode at the first that still
    are at the second: not lowered by leases that came and went in between."""
    core = make({"d1": 8})
    a, b = core.submit(2, COLD), core.submit(1, COLD)
    core.decode_sent(a)
    core.decode_sent(b)
    assert core.kept_since("d1", None) == (0, 1)  # a stream's first Ack claims nothing
    for _ in range(5):  # turnover between the Acks: sent and ended
        t = core.submit(1, COLD)
        core.decode_sent(t)
        core.release(t)
    late = core.submit(1, COLD)
    core.decode_sent(late)  # sent since the first Ack: not kept
    core.end_unseen(b)  # its end may pass unseen: not kept
    assert core.kept_since("d1", 1) == (2, 2)  # a alone
    core.release(a)
    assert core.kept_since("d1", 2) == (1, 3)  # late: in decode at the Ack before and now
    assert core.kept_since("d1", 1) == (0, 4)  # a mark that is not the latest: another stream acked
    assert core.kept_since("d2", None) == (0, 1)


# -- pauses of the process (watch_pauses) ------------------------------------------------------


class Resumed:
    """A stand-in for PauseWatch.resumed_at: when the latest pause ended."""

    def __init__(self) -> None:
        self.at = float("-inf")

    def __call__(self, now: float) -> float:
        return self.at


def test_after_a_pause_nothing_is_placed_until_the_hold_ends() -> None:
    clock = Clock()
    core = make({"d1": 2, "d2": 2}, clock)
    resumed = Resumed()
    core.watch_pauses(resumed, hold_s=1.5)
    first = core.submit(1, COLD)
    assert first.state is G and core.pauses == 0 and core.next_deadline() is None

    clock.now = 110.0
    resumed.at = 110.0  # the process stood still until now
    waiter = core.submit(1, COLD)
    assert waiter.state is Q, "placed on a share the agents may have handed on"
    assert core.pauses == 1 and core.held_until == 111.5
    assert core.next_deadline() == 111.5  # the adapter's timer moves the queue then
    assert core.snapshot()["placement_held_s"] == 1.5
    clock.now = 110.5
    assert not granted(core.release(first)), "a release placed during the hold"
    assert core.expire() == [] and waiter.state is Q
    clock.now = 111.5
    assert granted(core.expire()) == [waiter] and waiter.node is not None
    assert core.next_deadline() is None
    assert core.submit(1, COLD).state is G  # and placement is back to normal


def test_placement_is_reported_held_from_the_pause_until_the_hold_ends() -> None:
    """What the request path asks before a decode request placed earlier goes out: the hold counts
    from the pause's end even before a placement call noticed it."""
    clock = Clock()
    core = make({"d1": 2}, clock)
    assert not core.placement_held()  # no watch: never held
    resumed = Resumed()
    core.watch_pauses(resumed, hold_s=1.5)
    assert not core.placement_held()
    clock.now = 110.0
    resumed.at = 110.0
    assert core.placement_held()
    clock.now = 111.4
    assert core.placement_held()
    clock.now = 111.5
    assert not core.placement_held()


def test_a_pause_during_a_hold_extends_it_and_counts_once() -> None:
    clock = Clock()
    core = make({"d1": 1}, clock)
    resumed = Resumed()
    core.watch_pauses(resumed, hold_s=1.0)
    resumed.at = clock.now
    t = core.submit(1, CONT)
    assert t.state is Q and core.pauses == 1
    clock.now += 0.5
    resumed.at = clock.now
    assert core.expire() == [] and core.held_until == clock.now + 1.0 and core.pauses == 1
    clock.now += 1.0
    assert granted(core.expire()) == [t]
    clock.now += 5.0
    resumed.at = clock.now  # a later, separate pause
    core.release(t)
    assert core.pauses == 2


def test_waiters_keep_their_deadlines_through_a_hold() -> None:
    clock = Clock()
    core = make({"d1": 1}, clock, max_wait_s={CONT: 3.0, PROB: 2.0, COLD: 1.0})
    resumed = Resumed()
    core.watch_pauses(resumed, hold_s=2.0)
    resumed.at = clock.now
    t = core.submit(1, COLD)
    assert core.next_deadline() == t.deadline == clock.now + 1.0  # the earlier of the two
    clock.now += 1.0
    core.expire()
    assert t.state is TicketState.EXPIRED and core.next_deadline() == clock.now + 1.0


def test_a_retry_after_a_pause_waits_too() -> None:
    clock = Clock()
    core = make({"d1": 1, "d2": 1}, clock)
    resumed = Resumed()
    core.watch_pauses(resumed, hold_s=1.0)
    resumed.at = clock.now
    r = core.submit(1, COLD, avoid=frozenset({"d1"}), deadline=clock.now + 5.0)
    assert r.state is Q
    clock.now += 1.0
    assert granted(core.expire()) == [r] and r.node == "d2"


def test_bypass_ignores_pauses() -> None:
    clock = Clock()
    core = make({"d1": 1}, clock, bypass=True)
    resumed = Resumed()
    core.watch_pauses(resumed, hold_s=1.0)
    resumed.at = clock.now
    assert core.submit(1, COLD).state is G and core.pauses == 0
    with pytest.raises(ValueError, match="hold_s"):
        make({"d1": 1}).watch_pauses(resumed, hold_s=-1.0)


def test_forget_node_drops_its_bookkeeping_only_once_nothing_is_held_there() -> None:
    core = AdmissionCore(AdmissionPolicy(), clock=lambda: 0.0)
    core.set_shares({"d1": 2, "d2": 2})
    t = core.submit(1, RequestClass.COLD)
    assert t.node is not None
    node = t.node
    core.decode_sent(t)
    core.kept_since(node, None)  # an Ack was built for the node
    assert not core.forget_node(node)  # a share and a lease there: nothing dropped
    core.update_shares({node: 0})
    assert not core.forget_node(node)  # the lease still runs
    core.release(t)
    assert core.forget_node(node)
    ledger = core._ledger
    for per_node in (ledger.granted_on, ledger.unseen_on, ledger.in_decode, ledger.ack_gen, ledger.old):
        assert node not in per_node
    core.update_shares({node: 2})  # it comes back: a fresh start
    assert core.granted_on(node) == 0 and core.in_decode_on(node) == 0
    assert core.submit(1, RequestClass.COLD).state is TicketState.GRANTED


def test_at_once_takes_free_room_or_is_refused_never_queued() -> None:
    """A request another master spilled here (at_once) runs now or is refused now: it never waits
    beside this master's own clients, whatever the queue bound would allow."""
    core = make({"d1": 2}, queue_waves=20)
    first = core.submit(1, COLD, at_once=True)
    assert first.state is G
    mine = core.submit(1, COLD, "s1")
    assert mine.state is G
    late = core.submit(1, CONT, at_once=True)
    assert late.state is TicketState.REJECTED and late.reason is not None
    assert late.reason.code == "expected_wait" and late.reason.retry_after_s is not None
    assert core.queued_requests == 0
    core.release(first)
    # room again, but the session has a lease running: it would wait behind it
    assert core.submit(1, COLD, "s1", at_once=True).state is TicketState.REJECTED
    assert core.submit(1, COLD, "s2", at_once=True).state is G
    assert core.snapshot()["classes"]["cold"]["queued_requests"] == 0


def test_waits_for_room_only_when_no_node_has_it_and_its_session_holds_nothing() -> None:
    core = make({"d1": 1, "d2": 1}, queue_waves=20)
    assert core.can_start_now(1) and not core.waits_for_room(1)
    a = core.submit(1, COLD, "s1")
    assert core.can_start_now(1) and not core.can_start_now(1, "s1")
    assert not core.waits_for_room(1, "s1")  # behind its own session's turn, not for room
    b = core.submit(1, COLD, "s2")
    assert a.state is G and b.state is G
    assert not core.can_start_now(1) and core.waits_for_room(1) and core.waits_for_room(1, "s3")
    assert not core.waits_for_room(1, "s1")
    core.release(a)
    assert core.can_start_now(1) and not core.waits_for_room(1)
    assert core.waits_for_room(2)  # no node has two free


def test_handoffs_are_the_first_time_waiters_closest_to_their_deadline_that_fit() -> None:
    """What a master may hand to a peer with free room (pdmaster/spill.py): first-time waiters, the
    earliest deadline first, that fit the peer's room; never a request behind its own session's turn
    or one that needs more than the room."""
    # class waits: continuations 3 s, probable hits 2 s, cold 4 s
    core = make({"d1": 2}, queue_waves=20, max_wait_s={CONT: 3.0, PROB: 2.0, COLD: 4.0})
    assert core.free_now() == 2 and not core.has_handoffs()
    a = core.submit(1, COLD, "s1")
    core.submit(1, COLD, "s2")
    assert core.free_now() == 0
    cont = core.submit(1, CONT, "s9")
    behind = core.submit(1, COLD, "s1")  # waits for s1's running turn
    e = core.submit(1, PROB, "s3")
    f = core.submit(1, COLD, "s4")
    g = core.submit(2, COLD, "s5")
    assert all(t.state is Q for t in (cont, behind, e, f, g))
    assert core.has_handoffs()
    assert core.handoffs(1, 10) == [e, cont, f]
    assert core.handoffs(2, 10) == [e, cont, f, g]
    assert core.handoffs(2, 1) == [e]
    assert core.handoffs(0, 10) == [] and core.handoffs(2, 0) == []
    queued = core.queued_requests
    changes = core.hand_off(e)
    assert e in changes and e.state is TicketState.CANCELLED
    assert e.reason is not None and e.reason.code == "handed_off"
    assert core.queued_requests == queued - 1
    assert core.snapshot()["outcomes"]["probable_cache_hit"]["handed_off"] == 1
    assert core.hand_off(e) == []  # once only
    assert core.handoffs(2, 10) == [cont, f, g]
    # the rest is served here as before: the continuation first, then s1's next turn
    assert granted(core.release(a)) == [cont]
    assert behind.state is Q
    assert core.handoffs(2, 10) == [behind, f, g]  # its session's turn has come: it may go now


def test_free_now_is_the_room_one_first_time_request_could_take() -> None:
    core = make({"d1": 2, "d2": 3}, queue_waves=20)
    assert core.free_now() == 3
    core.submit(2, COLD)
    assert core.free_now() == 2
    assert make({}).free_now() == 0


def test_a_hand_off_drains_the_queue_like_a_completion_in_the_expected_wait() -> None:
    """The queue shrinks by hand-offs as by completions: the completion rate counts both, so arrivals
    are not refused for a wait that the peers' room is shortening."""
    clock = Clock()
    core = make({"d1": 1}, clock, queue_waves=20)
    for _ in range(8):
        t = core.submit(1, COLD)
        clock.now += 1.0
        core.release(t)
    core.submit(1, COLD)
    waiting = [core.submit(1, COLD) for _ in range(3)]
    assert all(t.state is Q for t in waiting)
    before = core.completion_rate()
    wait_before = core.expected_wait(COLD)
    assert before is not None and wait_before is not None
    core.hand_off(waiting[0])
    core.hand_off(waiting[1])
    after = core.completion_rate()
    assert after is not None and after > before
    wait_after = core.expected_wait(COLD)
    assert wait_after is not None and wait_after < wait_before
