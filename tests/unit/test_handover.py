"""Strict handover and demand-following shares (DESIGN §4): the pure cores, step by step."""

from __future__ import annotations

import string

from hypothesis import given
from hypothesis import strategies as st

from nodeagent.handover import END_SEEN_S, START_SEEN_S, STARTUP, Handover
from nodeagent.slicing import (
    GONE_SAMPLE_DELAY_S,
    PEER_DETECT_S,
    SharePolicy,
    Slicer,
    demand_shares,
    slice_shares,
    step_towards,
)

ids = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=4)


def started(capacity: int, masters: list[str], **kw: object) -> Slicer:
    """A strict slicer whose startup reservation has been released by an idle engine sample.

    The even split unless the test asks for ``policy="demand"``: these tests follow the handover's
    steps, which demand-following targets would move under them. Masters are allowed a round second
    to notice a lost stream (``peer_detect_s``), which keeps the steps' times readable."""
    kw.setdefault("grace", 1.0)
    kw.setdefault("policy", "static")
    s = Slicer(node_id="d1", capacity=capacity, policy=SharePolicy(**kw), peer_detect_s=1.0)  # type: ignore[arg-type]
    s.set_masters(masters, 0.0, 1)
    for m in masters:
        s.stream_up(m, 0.0, 2)
        s.on_ack(m, s.epoch, 0, 0, 0.0, 3)
    s.on_probe(0, 1.0, 1.0, 4)
    return s


def test_startup_holds_every_slot_until_an_engine_sample_one_grace_later() -> None:
    s = Slicer(node_id="d1", capacity=8, policy=SharePolicy(grace=1.0), peer_detect_s=1.0)
    s.set_masters(["a", "b"], 0.0, 1)
    s.stream_up("a", 0.0, 1)
    s.stream_up("b", 0.0, 1)
    assert dict(s.shares) == {"a": 0, "b": 0}
    assert dict(s.targets) == slice_shares(8, ["a", "b"], "d1")
    assert s.handover_pending
    assert s.waits_for_engine  # only a sample can tell what the previous incarnation left running
    # A sample taken before the grace is over could miss a master still bound to the old agent.
    assert not s.on_probe(0, 0.5, 0.6, 2)
    assert s.snapshot()["orphans"] == {STARTUP: 8}
    # The engine runs 3 slots that no master has reported yet: those stay reserved.
    assert s.on_probe(3, 1.0, 1.1, 3)
    assert sum(s.shares.values()) == 5
    s.on_ack("a", s.epoch, 2, 0, 1.2, 4)
    s.on_ack("b", s.epoch, 1, 0, 1.2, 4)
    assert s.on_probe(3, 1.3, 1.4, 5)
    assert dict(s.shares) == dict(s.targets)


def test_without_a_probe_the_first_acks_release_the_startup_reservation() -> None:
    s = Slicer(node_id="d1", capacity=6, probe=False, policy=SharePolicy(grace=1.0), peer_detect_s=1.0)
    s.set_masters(["a", "b"], 0.0, 1)
    s.stream_up("a", 0.0, 1)
    s.stream_up("b", 0.0, 1)
    s.on_ack("a", s.epoch, 1, 0, 0.1, 2)
    assert sum(s.shares.values()) == 0
    assert s.on_ack("b", s.epoch, 2, 0, 0.1, 3)
    assert dict(s.shares) == {"a": 3, "b": 3}


def test_join_grows_only_as_the_others_acknowledge_and_drain() -> None:
    s = started(8, ["a", "b"])
    assert dict(s.shares) == {"a": 4, "b": 4}
    s.on_ack("a", s.epoch, 4, 0, 2.0, 10)
    s.on_ack("b", s.epoch, 4, 0, 2.0, 10)
    before = s.epoch
    s.set_masters(["a", "b", "c"], 2.1, 11)
    target = dict(s.targets)
    assert sum(target.values()) == 8 and target["c"] > 0
    # Shrink at once, grow by nothing: a and b still run 4 each.
    assert s.share_for("c") == 0
    # The others' Acks move a join on; the engine's count cannot (no need to sample it often).
    assert s.handover_pending and not s.waits_for_engine
    assert s.share_for("a") == target["a"] and s.share_for("b") == target["b"]
    # a applied its lower grant but still runs 4: nothing is free yet.
    assert not s.on_ack("a", s.epoch, 4, 0, 2.2, 12)
    assert s.share_for("c") == 0
    # a drained to its new share: exactly what it gave up moves to c.
    assert s.on_ack("a", s.epoch, target["a"], 0, 2.3, 13)
    assert s.share_for("c") == 4 - target["a"]
    # b has not acknowledged its lower grant: its old 4 still counts even though it runs 0.
    assert not s.on_ack("b", before, 0, 0, 2.4, 14)
    assert s.share_for("c") == 4 - target["a"]
    assert s.on_ack("b", s.epoch, 0, 0, 2.5, 15)
    assert dict(s.shares) == target
    assert not s.handover_pending


def test_a_master_that_leaves_keeps_its_slots_until_the_engine_shows_them_free() -> None:
    s = started(8, ["a", "b"])
    s.on_ack("a", s.epoch, 4, 0, 2.0, 10)
    s.on_ack("b", s.epoch, 3, 0, 2.0, 10)
    s.stream_down("b", 2.0, 11)
    assert s.tick(3.0, 12)  # grace over: b is out of the split
    assert s.share_for("a") == 4 and dict(s.targets) == {"a": 8}
    assert s.snapshot()["orphans"] == {"b": 4}
    assert s.waits_for_engine
    # A sample started before b left proves nothing.
    assert not s.on_probe(4, 2.9, 3.1, 13)
    # The engine still runs 6 slots while a reports 4: 2 of b's may still run.
    assert s.on_probe(6, 3.1, 3.2, 14)
    assert s.share_for("a") == 6
    assert s.on_probe(4, 3.5, 3.6, 15)
    assert dict(s.shares) == {"a": 8}


def test_orphans_expire_after_the_timeout_when_no_probe_answers() -> None:
    s = started(4, ["a", "b"], orphan_timeout=10.0)
    s.on_ack("b", s.epoch, 2, 0, 2.0, 10)
    s.set_masters(["a"], 2.0, 11)
    assert s.share_for("a") == 2
    assert s.next_deadline(2.0) == 12.0
    assert not s.tick(11.9, 12)
    assert s.tick(12.0, 13)
    assert dict(s.shares) == {"a": 4}


def test_a_returning_master_reports_the_truth_and_frees_its_reservation() -> None:
    s = started(6, ["a", "b"])
    s.on_ack("b", s.epoch, 3, 0, 2.0, 10)
    s.set_masters(["a"], 2.0, 11)
    assert s.share_for("a") == 3
    s.set_masters(["a", "b"], 3.0, 12)
    s.stream_up("b", 3.0, 13)
    assert s.on_ack("b", s.epoch, 1, 0, 3.1, 14)
    assert dict(s.shares) == {"a": 3, "b": 3}


def test_fast_mode_grants_targets_at_once() -> None:
    s = Slicer(node_id="d1", capacity=8, policy=SharePolicy(handover="fast", policy="static"))
    s.set_masters(["a", "b"], 0.0, 1)
    assert dict(s.shares) == {"a": 4, "b": 4}
    s.on_ack("a", s.epoch, 4, 0, 0.1, 2)
    s.set_masters(["a", "b", "c"], 0.2, 3)
    assert dict(s.shares) == dict(s.targets) == slice_shares(8, ["a", "b", "c"], "d1")


def test_bad_modes_are_refused_by_name() -> None:
    for kw in ({"handover": "lazy"}, {"policy": "random"}):
        try:
            SharePolicy(**kw)  # type: ignore[arg-type]
        except ValueError as exc:
            assert next(iter(kw.values())) in str(exc)
        else:
            raise AssertionError(f"{kw} accepted")


@given(
    capacity=st.integers(0, 500),
    demands=st.dictionaries(ids, st.integers(0, 600), min_size=1, max_size=6),
    floor=st.integers(0, 10),
)
def test_demand_shares_sum_to_capacity_keep_the_floor_and_are_max_min_fair(
    capacity: int, demands: dict[str, int], floor: int
) -> None:
    shares = demand_shares(capacity, demands, "n1", floor)
    assert set(shares) == set(demands)
    assert sum(shares.values()) == capacity
    f = min(floor, capacity // len(demands))
    assert all(v >= f for v in shares.values())
    if sum(demands.values()) >= capacity:
        # Nobody gets more than it asked (beyond its floor) while another gets less than it asked,
        # unless they are within one slot of each other.
        for a, sa in shares.items():
            for b, sb in shares.items():
                if sa > max(demands[a], f) and sb < demands[b]:
                    raise AssertionError((shares, demands))
                if sa < demands[a] and sb < demands[b]:
                    assert abs(sa - sb) <= 1 or sa >= demands[a] or sb >= demands[b]
    else:
        assert all(shares[k] >= min(demands[k], capacity) for k in demands)


def test_demand_shares_follow_a_90_10_split() -> None:
    assert demand_shares(100, {"busy": 500, "idle": 8}, "n", floor=1) == {"busy": 92, "idle": 8}
    assert demand_shares(100, {"a": 0, "b": 0}, "n") == slice_shares(100, ["a", "b"], "n")


@given(
    cur=st.lists(st.integers(0, 50), min_size=1, max_size=5),
    ideal_seed=st.lists(st.integers(0, 50), min_size=1, max_size=5),
    step=st.integers(1, 20),
)
def test_step_towards_moves_boundedly_and_keeps_the_sum(
    cur: list[int], ideal_seed: list[int], step: int
) -> None:
    keys = [f"m{i}" for i in range(len(cur))]
    current = dict(zip(keys, cur, strict=True))
    total = sum(cur)
    raw = [ideal_seed[i % len(ideal_seed)] for i in range(len(keys))]
    # Scale the ideal to the same total.
    ideal = demand_shares(total, dict(zip(keys, raw, strict=True)), "n", 0)
    out = step_towards(current, ideal, step)
    assert sum(out.values()) == total
    for k in keys:
        lo, hi = sorted((current[k], ideal[k]))
        assert lo <= out[k] <= hi
        assert abs(out[k] - current[k]) <= step + 1


def test_demand_policy_rebalances_with_hysteresis_and_a_bounded_step() -> None:
    s = started(
        100,
        ["busy", "idle"],
        policy="demand",
        rebalance_interval=1.0,
        rebalance_hysteresis=2,
        rebalance_max_step=0.25,
    )
    assert dict(s.targets) == {"busy": 50, "idle": 50}
    # Masters that just joined count as wanting an even share: no move before that window ends.
    s.on_ack("busy", s.epoch, 50, 60, 1.5, 10)
    s.on_ack("idle", s.epoch, 5, 0, 1.5, 10)
    s.tick(2.1, 11)
    assert dict(s.targets) == {"busy": 50, "idle": 50}
    t = s.join_prior_s
    assert s.next_deadline(2.1) is not None
    s.tick(t + 0.1, 11)
    assert dict(s.targets) == {"busy": 75, "idle": 25}  # at most a quarter of the node per step
    # Strict: idle has not yet acknowledged its lower grant, so busy grows by nothing yet.
    assert s.share_for("busy") == 50
    s.on_ack("idle", s.epoch, 5, 0, t + 0.2, 12)
    assert dict(s.shares) == {"busy": 75, "idle": 25}
    s.on_ack("busy", s.epoch, 75, 60, t + 1.2, 13)
    s.tick(t + 1.3, 14)
    assert s.targets["busy"] > 75
    # A small wobble in demand does not move the targets.
    before = dict(s.targets)
    s.on_ack("idle", s.epoch, 5, 1, t + 1.4, 15)
    s.tick(t + 2.4, 16)
    s.tick(t + 3.5, 17)
    s.on_ack("idle", s.epoch, 5, 0, t + 3.6, 18)
    s.tick(t + 4.6, 19)
    assert abs(s.targets["idle"] - before["idle"]) <= 8


def test_demand_policy_wakes_for_a_rebalance_only_when_one_can_move_the_targets() -> None:
    """An idle node has nothing to rebalance: the agent sleeps until a master's demand changes (or
    a join window ends) instead of waking every ``rebalance_interval`` to find the same split."""
    s = started(100, ["a", "b"], policy="demand", rebalance_interval=1.0, rebalance_max_step=0.25)
    t = s.join_prior_s  # both joined at 0
    assert s.next_deadline(2.0) == t  # the join window's end can move the targets
    s.tick(t, 5)
    assert dict(s.targets) == {"a": 50, "b": 50}
    assert s.next_deadline(t) is None  # idle and settled: no timer at all
    s.on_ack("a", s.epoch, 50, 80, t + 0.2, 6)  # a's demand changed
    assert s.next_deadline(t + 0.2) == t + 1.0
    s.tick(t + 1.0, 7)
    assert dict(s.targets) == {"a": 75, "b": 25}  # a quarter of the node per step: not there yet
    assert s.next_deadline(t + 1.0) == t + 2.0
    s.tick(t + 2.0, 8)
    assert dict(s.targets) == {"a": 99, "b": 1}
    assert s.next_deadline(t + 2.0) is None
    s.on_ack("b", s.epoch, 0, 0, t + 2.1, 9)  # an Ack with the same demand changes nothing
    assert s.next_deadline(t + 2.1) is None


def test_demand_policy_starts_a_joining_master_at_an_even_share() -> None:
    """A master that joins while the others want the whole node is not left at the floor: its
    clients are on their way (its queue bound follows its share), so it starts even and then
    follows the demand it reports."""
    s = started(90, ["a", "b"], policy="demand", rebalance_interval=1.0)
    t = s.join_prior_s
    s.on_ack("a", s.epoch, 45, 100, 1.5, 10)
    s.on_ack("b", s.epoch, 45, 100, 1.5, 10)
    s.tick(t + 1.1, 11)
    assert dict(s.targets) == {"a": 45, "b": 45}
    joined = t + 2.0
    s.set_masters(["a", "b", "c"], joined, 12)
    s.stream_up("c", joined, 12)
    assert dict(s.targets) == {"a": 30, "b": 30, "c": 30}
    s.on_ack("c", s.epoch, 0, 0, joined + 0.1, 13)  # nothing queued yet: still even
    for k in range(1, 4):
        s.tick(joined + k, 14 + k)
        assert s.targets["c"] == 30
    # The window over and still no demand: c goes down towards the floor, a and b take the rest.
    for k in range(0, 8):
        s.tick(joined + t + 0.1 + k, 20 + k)
    assert s.targets["c"] < 10 and s.targets["a"] + s.targets["b"] + s.targets["c"] == 90


def test_demand_policy_splits_an_idle_node_exactly_evenly_when_a_master_joins() -> None:
    """No demand anywhere: the join gives the static split exactly, not the newcomer's even share
    plus a part of the slots nobody asked for (which a second handover would then take back)."""
    from nodeagent.slicing import slice_shares

    for cap in (1, 8, 37, 256):
        s = started(cap, ["a", "b"], policy="demand", rebalance_interval=1.0)
        t = s.join_prior_s + 1.0
        s.tick(t, 10)
        joined = t + 1.0
        s.set_masters(["a", "b", "c"], joined, 11)
        s.stream_up("c", joined, 11)
        even = slice_shares(cap, ["a", "b", "c"], "d1")
        assert dict(s.targets) == even
        for k in range(1, 12):  # and it stays so once the window is over
            s.tick(joined + k, 11 + k)
            assert dict(s.targets) == even, (cap, k)


def test_handover_issue_list_stays_bounded_without_acks() -> None:
    h = Handover(10, strict=True)
    h.include("a")
    for e in range(1, 100):
        h.issue(e, {"a": e % 7})
    assert len(h.holders["a"].issued) <= 16
    assert h.holders["a"].hold == 6  # the largest share it may hold is never forgotten


def test_a_failing_probe_falls_back_to_acks_for_the_startup_reservation() -> None:
    s = Slicer(node_id="d1", capacity=4, policy=SharePolicy(grace=1.0), peer_detect_s=1.0)
    s.set_masters(["a"], 0.0, 1)
    s.stream_up("a", 0.0, 1)
    s.on_ack("a", s.epoch, 0, 0, 0.1, 2)
    assert s.share_for("a") == 0  # the probe has not answered yet
    assert s.on_probe(None, 0.2, 0.3, 3)
    assert s.share_for("a") == 4


def test_a_master_gone_from_etcd_with_its_stream_up_keeps_its_slots_for_a_grace() -> None:
    s = started(8, ["a", "b"])
    s.on_ack("b", s.epoch, 0, 0, 2.0, 10)
    # b's key is gone while its stream is still up: b may not know yet that it lost this node.
    assert s.set_masters(["a"], 2.0, 11)
    s.stream_down("b", 2.0, 11)  # the agent drops its link to a master that left etcd
    assert s.snapshot()["orphans"] == {"b": 4}
    assert not s.on_probe(0, 2.5, 2.6, 12)  # an idle engine proves nothing before b noticed
    assert s.share_for("a") == 4
    assert s.on_probe(0, 3.0, 3.1, 13)
    assert dict(s.shares) == {"a": 8}


def test_lease_expiry_of_a_long_dead_master_frees_its_slots_at_the_next_sample() -> None:
    # Stream-based exclusion effectively off (huge grace): the key's expiry is what removes b.
    s = started(8, ["a", "b"], grace=1e6)
    s.on_ack("b", s.epoch, 4, 0, 2.0, 10)
    s.stream_down("b", 2.0, 11)  # killed: its stream broke at once
    assert s.share_for("a") == 4
    s.set_masters(["a"], 7.0, 12)  # lease expired 5 s later
    assert s.on_probe(0, 7.1, 7.2, 13)  # b's stream has been down for far longer than it needs to notice
    assert dict(s.shares) == {"a": 8}


def test_a_master_whose_address_refuses_leaves_the_split_without_waiting_for_the_grace() -> None:
    s = started(8, ["a", "b"])
    s.on_ack("b", s.epoch, 4, 0, 2.0, 10)
    s.stream_down("b", 2.0, 11)  # killed: its stream broke at once
    assert s.members(2.05) == ("a", "b")  # a broken stream alone keeps b for the grace (1 s)
    assert s.master_gone("b", 2.05, 12)  # its address refuses connections: the process is gone
    assert s.members(2.05) == ("a",)
    assert dict(s.targets) == {"a": 8}
    assert s.share_for("a") == 4  # b's 4 running leases stay reserved...
    assert s.waits_for_engine
    # ...until an engine sample taken after what b sent just before it died has arrived
    assert not s.on_probe(0, 2.1, 2.15, 13)
    assert s.on_probe(0, 2.05 + GONE_SAMPLE_DELAY_S, 2.4, 14)
    assert dict(s.shares) == {"a": 8}
    assert s.next_grace_deadline(2.4) is None  # no grace window left open for b
    # The same id comes back (a restarted process at the same address): it joins again.
    s.stream_up("b", 3.0, 15)
    assert s.members(3.0) == ("a", "b")


def test_a_refusal_while_the_stream_is_up_or_from_an_unknown_master_changes_nothing() -> None:
    s = started(8, ["a", "b"])
    epoch = s.epoch
    assert not s.master_gone("b", 2.0, 10)  # its stream is up: a stray refusal proves nothing
    assert not s.master_gone("x", 2.0, 10)
    assert s.members(2.0) == ("a", "b") and s.epoch == epoch


def test_a_master_that_registers_again_after_it_was_found_gone_gets_a_fresh_window() -> None:
    s = started(8, ["a", "b"])
    s.stream_down("b", 2.0, 11)
    s.set_masters(["a"], 2.0, 12)  # its key expired...
    s.master_gone("b", 2.1, 13)
    s.set_masters(["a", "b"], 5.0, 14)  # ...and a new process registered under the same id
    assert s.members(5.0) == ("a", "b")  # waiting for its stream, as any new master


def test_a_draining_master_with_nothing_queued_leaves_the_split_and_its_slots_follow_its_leases() -> None:
    s = started(8, ["a", "b"])
    s.on_ack("a", s.epoch, 4, 3, 2.0, 10)
    s.on_ack("b", s.epoch, 3, 0, 2.0, 10)
    # b drains but still has a queue: it keeps its share so its waiters can run.
    assert not s.on_ack("b", s.epoch, 3, 2, 2.1, 11, draining=True)
    assert s.members(2.1) == ("a", "b")
    # Queue empty: b takes no more work. It leaves the split at once; its 3 running leases stay counted.
    assert s.on_ack("b", s.epoch, 3, 0, 2.2, 12, draining=True)
    assert dict(s.targets) == {"a": 8}
    assert s.share_for("a") == 5
    assert not s.waits_for_engine  # b is still connected: its Acks free its slots
    # The engine cannot tell whose requests run: an idle-looking sample does not free b's slots...
    assert not s.on_probe(4, 2.3, 2.4, 13)
    assert s.share_for("a") == 5
    # ...its own Acks do, as its leases end.
    assert s.on_ack("b", s.epoch, 1, 0, 2.5, 14, draining=True)
    assert s.share_for("a") == 7
    assert s.on_ack("b", s.epoch, 0, 0, 2.6, 15, draining=True)
    assert dict(s.shares) == {"a": 8}
    # The same id comes back as a new process: a fresh stream, no longer draining.
    s.stream_down("b", 3.0, 16)
    s.stream_up("b", 3.1, 17)
    assert s.members(3.1) == ("a", "b")


def test_a_drained_master_whose_stream_closes_keeps_its_leases_reserved_until_it_could_stop() -> None:
    """A master at its drain timeout revokes its key and closes its streams while its last leases still
    run for a moment. Its stale Acks said it runs 3; a live master's last Ack says 5 although 2 of
    those have ended since. An engine sample of 6 (3 of a, 3 of b) taken at once would read as "a runs
    5, 1 left for b" and free b's reservation while b still runs 3: only samples taken after b could
    have stopped (one peer-detect interval) may release it."""
    s = started(8, ["a", "b"])
    s.on_ack("a", s.epoch, 5, 3, 2.0, 10)
    s.on_ack("b", s.epoch, 3, 0, 2.0, 10)
    assert s.on_ack("b", s.epoch, 3, 0, 2.1, 11, draining=True)  # leaves the split, 3 leases reserved
    assert s.snapshot()["orphans"] == {"b": 3}
    s.set_masters(["a"], 3.0, 12)  # its key is revoked at the drain timeout
    s.stream_down("b", 3.0, 13)
    assert s.waits_for_engine  # b is gone: only the engine's count can free its slots now
    assert not s.on_probe(6, 3.05, 3.1, 14)
    assert s.snapshot()["orphans"] == {"b": 3}
    # Later (b has exited, its leases ended) a sample frees the slots.
    s.on_ack("a", s.epoch, 3, 3, 4.0, 15)
    assert s.on_probe(3, 4.1, 4.2, 16)
    assert s.snapshot()["orphans"] == {}
    assert s.share_for("a") == 8


def test_demand_join_window_lifts_only_the_newcomer() -> None:
    """While c is in its join window it counts as wanting its even share; an idle a still yields
    its slots to a busy b (the window does not freeze the node at the even split)."""
    s = started(90, ["a", "b"], policy="demand", rebalance_interval=1.0)
    t = s.join_prior_s + 1.0
    s.on_ack("a", s.epoch, 0, 0, t, 10)
    s.on_ack("b", s.epoch, 45, 100, t, 10)
    joined = t + 0.5
    s.set_masters(["a", "b", "c"], joined, 11)
    s.stream_up("c", joined, 11)
    targets = dict(s.targets)
    assert targets["c"] == 30 and targets["a"] < 30 and targets["b"] > 30
    assert sum(targets.values()) == 90


def _cut_off_b_while_a_turns_over(kept: bool) -> Slicer:
    """a and b each run 4 of 8 slots; b is cut off (alive, its leases run on) and leaves the split.
    By the engine sample at 3.1 one of a's leases has ended and two of b's still run: 3 + 2."""
    s = started(8, ["a", "b"])
    for m in ("a", "b"):
        s.on_ack(m, s.epoch, 4, 0, 2.0, 10, kept=4 if kept else None, answers_sent_at=1.9)
    s.stream_down("b", 2.0, 11)
    s.tick(3.0, 12)
    assert s.snapshot()["orphans"] == {"b": 4}
    s.on_probe(5, 3.1, 3.15, 13)
    return s


def test_known_gap_a_master_of_an_earlier_release_with_an_ack_older_than_a_lease_end() -> None:
    """Pins the gap that remains with masters that send no kept_slots (``nodeagent/handover.py``,
    "Known gap"): their last acked count stands in, and it predates the end of one of a's leases, so
    the sample frees slots b still uses. b runs 2, but only 1 stays reserved, and a may use 7: 9 of 8."""
    s = _cut_off_b_while_a_turns_over(kept=False)
    assert s.snapshot()["orphans"] == {"b": 1}
    assert s.share_for("a") == 7


def test_a_sample_counts_only_the_leases_a_master_kept_between_acks_around_it() -> None:
    """With kept_slots the same sample frees nothing on its own (no Ack after it yet); a's answer to a
    Report sent after the sample came back says it kept 3 leases since its Ack before the sample, so
    b may run at most 5 - 3 = 2: exactly what it runs, and a grows only to 6."""
    s = _cut_off_b_while_a_turns_over(kept=True)
    assert s.snapshot()["orphans"] == {"b": 4}
    assert s.waits_for_bracket
    assert s.on_ack("a", s.epoch, 3, 0, 3.3, 14, kept=3, answers_sent_at=3.2)
    assert s.snapshot()["orphans"] == {"b": 2}
    assert s.share_for("a") == 6


def test_an_ack_to_a_report_sent_right_after_the_sample_does_not_close_the_bracket() -> None:
    """The engine stops counting a decode a moment before its last bytes reach the master, which
    only then stops counting the lease: an Ack to a Report sent less than END_SEEN_S after the
    sample came back (at 3.15) may still count a lease the sample did not, so it frees nothing."""
    s = _cut_off_b_while_a_turns_over(kept=True)
    s.on_ack("a", s.epoch, 3, 0, 3.3, 14, kept=3, answers_sent_at=3.15 + END_SEEN_S / 2)
    assert s.snapshot()["orphans"] == {"b": 4}
    s = _cut_off_b_while_a_turns_over(kept=True)
    s.on_ack("a", s.epoch, 3, 0, 3.3, 14, kept=3, answers_sent_at=3.15 + END_SEEN_S)
    assert s.snapshot()["orphans"] == {"b": 2}


def test_orphans_cut_together_keep_covering_each_other_when_one_master_returns() -> None:
    """b and c are cut off (3 slots each reserved); a sample bounds what both still run together, 3
    (b runs 2, c 1), and the cut takes b's 3 first (name order). When c comes back and says it runs
    1, its 3 reserved slots may be covering b's leases: they stay reserved under the pool's name
    until a sample frees them, instead of leaving b's 2 leases covered by nothing."""
    s = started(8, ["a", "b", "c"])
    assert dict(s.shares) == {"a": 2, "b": 3, "c": 3}
    for m, n in (("a", 2), ("b", 3), ("c", 3)):
        s.on_ack(m, s.epoch, n, 0, 2.0, 10, kept=n, answers_sent_at=1.9)
    s.stream_down("b", 2.0, 11)
    s.stream_down("c", 2.0, 11)
    s.tick(3.0, 12)
    assert s.snapshot()["orphans"] == {"b": 3, "c": 3}
    s.on_probe(5, 3.9, 3.95, 13)  # a 2, b 2, c 1
    s.on_ack("a", s.epoch, 2, 0, 4.1, 14, kept=2, answers_sent_at=3.95 + END_SEEN_S)
    assert s.snapshot()["orphans"] == {"c": 3}
    s.stream_up("c", 4.2, 15)
    s.on_ack("c", s.epoch, 1, 0, 4.3, 16, kept=0, answers_sent_at=4.25)
    orphans = s.snapshot()["orphans"]
    assert list(orphans.values()) == [3] and next(iter(orphans)).startswith("(pool "), orphans
    assert s.share_for("a") + max(s.share_for("c"), 1) + 3 <= 8


def test_a_sample_taken_right_after_the_opening_ack_is_not_bracketed_by_it() -> None:
    """A decode request the master sent just before its Ack may not be in the engine's queues yet
    when a sample is taken right after the Ack came in: the Ack opens a bracket only for samples
    taken START_SEEN_S after it."""
    for gap, orphans in ((START_SEEN_S / 2, {"b": 4}), (START_SEEN_S, {"b": 2})):
        s = started(8, ["a", "b"])
        for m in ("a", "b"):
            s.on_ack(m, s.epoch, 4, 0, 2.0, 10, kept=4, answers_sent_at=1.9)
        s.stream_down("b", 2.0, 11)
        s.tick(3.0, 12)
        s.on_ack("a", s.epoch, 3, 0, 3.5, 13, kept=3, answers_sent_at=3.45)
        s.on_probe(5, 3.5 + gap, 3.55 + gap, 14)
        s.on_ack("a", s.epoch, 3, 0, 3.8 + gap, 15, kept=3, answers_sent_at=3.7 + gap)
        assert s.snapshot()["orphans"] == orphans, gap


def test_acks_that_do_not_bracket_the_sample_free_nothing() -> None:
    """An Ack that answers a Report sent before the sample came back, or whose predecessor came in
    after the sample started, may count leases the engine did not run at it."""
    s = _cut_off_b_while_a_turns_over(kept=True)
    s.on_ack("a", s.epoch, 3, 0, 3.12, 14, kept=3, answers_sent_at=3.11)  # sent during the sample
    assert s.snapshot()["orphans"] == {"b": 4}
    s.on_ack("a", s.epoch, 3, 0, 3.3, 15, kept=3, answers_sent_at=3.2)  # its predecessor: after 3.1
    assert s.snapshot()["orphans"] == {"b": 4}
    # The next sample, between the Ack at 3.3 and the answer to a Report sent after it, does.
    s.on_probe(5, 3.4, 3.45, 16)
    assert s.on_ack("a", s.epoch, 3, 0, 3.6, 17, kept=3, answers_sent_at=3.5)
    assert s.snapshot()["orphans"] == {"b": 2}


def test_a_gone_master_s_slots_follow_the_acked_counts_without_waiting_for_a_bracket() -> None:
    """A master whose address refuses connections is dead and the engine cancelled its requests: a
    sample against the live masters' acked counts frees its slots at once, as before kept_slots."""
    s = started(8, ["a", "b"])
    for m in ("a", "b"):
        s.on_ack(m, s.epoch, 4, 0, 2.0, 10, kept=4, answers_sent_at=1.9)
    s.stream_down("b", 2.0, 11)
    assert s.master_gone("b", 2.01, 12)
    assert s.snapshot()["orphans"] == {"b": 4}
    assert not s.waits_for_bracket
    s.on_probe(4, 2.01 + GONE_SAMPLE_DELAY_S, 2.3, 13)
    assert dict(s.shares) == {"a": 8}


def test_without_gone_on_refusal_a_refused_master_counts_as_gone_once_its_key_is_gone_too() -> None:
    """--no-gone-on-refusal: a refusal alone changes nothing (a firewall may reject for a live
    master: its slots wait for a bracket), but once its etcd key is gone as well its slots follow the
    acked counts, as a killed master's; a new stream forgets the refusal."""
    s = started(8, ["a", "b"])
    for m in ("a", "b"):
        s.on_ack(m, s.epoch, 4, 0, 2.0, 10, kept=4, answers_sent_at=1.9)
    s.stream_down("b", 2.0, 11)
    assert s.master_refused("b")
    assert not s.master_refused("b")  # once
    assert "b" in s.members(2.5)  # still within its grace
    s.tick(3.1, 12)
    assert s.snapshot()["orphans"] == {"b": 4}
    s.on_ack("a", s.epoch, 4, 0, 5.0, 13, kept=0)  # a's leases turned over: nothing surely ran
    s.on_probe(4, 5.2, 5.3, 14)
    assert s.snapshot()["orphans"] == {"b": 4}, "a refusal alone freed slots"
    s.set_masters(["a"], 7.0, 15)  # its key expired
    s.on_probe(4, 7.1, 7.2, 16)
    assert dict(s.shares) == {"a": 8}
    # A stream that comes up again means a live process: a later refusal starts over.
    s2 = started(8, ["a", "b"])
    s2.stream_down("b", 2.0, 11)
    assert s2.master_refused("b")
    s2.stream_up("b", 2.2, 12)
    assert not s2.views["b"].refused


def test_a_master_whose_key_said_drained_counts_as_gone_without_a_draining_ack() -> None:
    """A master whose drain ended before any of its Acks said it drains (nothing had changed to
    report) marks its key drained just before it revokes it: the agent sets what it left reserved
    against the acked counts at once. Without the mark it waits for Acks around a sample, which under
    a steady stream of short requests rarely account for every slot."""
    for marked in (True, False):
        s = started(8, ["a", "b"])
        s.on_ack("a", s.epoch, 5, 3, 2.0, 10, kept=0)
        s.on_ack("b", s.epoch, 1, 0, 2.1, 11, kept=0)
        if marked:
            s.master_drained("b")  # the put of its drained key, just before the deletion
        s.set_masters(["a"], 3.0, 12)
        s.stream_down("b", 3.0, 13)
        # Drained: only its acked leases stay reserved; else its share, as for a cut-off master.
        assert s.snapshot()["orphans"] == ({"b": 1} if marked else {"b": 4})
        assert s.waits_for_bracket is not marked
        s.on_ack("a", s.epoch, 6, 2, 4.0, 14, kept=0)  # a's leases turned over: it kept none
        s.on_probe(6, 4.1 + PEER_DETECT_S, 4.2 + PEER_DETECT_S, 15)
        assert s.snapshot()["orphans"] == ({} if marked else {"b": 4}), marked


def test_a_master_that_drained_and_revoked_its_key_counts_as_gone() -> None:
    """Its last leases have ended (or end as it exits), so what it left reserved is set against the
    acked counts like a dead master's, without waiting for Acks around a sample: under a steady
    stream of short requests those never account for every slot."""
    s = started(8, ["a", "b"])
    s.on_ack("a", s.epoch, 5, 3, 2.0, 10, kept=0)
    assert s.on_ack("b", s.epoch, 1, 0, 2.1, 11, draining=True, kept=0)
    assert s.snapshot()["orphans"] == {"b": 1}
    s.set_masters(["a"], 3.0, 12)  # revoked once drained
    s.stream_down("b", 3.0, 13)
    assert not s.waits_for_bracket
    s.on_ack("a", s.epoch, 6, 2, 4.0, 14, kept=0)  # a's leases turned over: it kept none
    assert s.on_probe(6, 4.1, 4.2, 15)
    assert s.snapshot()["orphans"] == {}


def test_demand_shares_take_a_floor_per_master() -> None:
    """A floor given per master: one that asks for none gets none while the others want the node."""
    floors = {"busy": 1, "idle": 0, "anchored": 1}
    shares = demand_shares(16, {"busy": 40, "idle": 0, "anchored": 0}, "n", floors)
    assert shares == {"busy": 15, "idle": 0, "anchored": 1}
    # a master missing from the mapping has no floor; floors above capacity // M are cut to it
    assert demand_shares(4, {"a": 9, "b": 0}, "n", {"a": 0}) == {"a": 4, "b": 0}
    assert demand_shares(4, {"a": 9, "b": 0}, "n", {"a": 5, "b": 5}) == {"a": 2, "b": 2}
    # nobody asks: the even split, whatever the floors
    assert demand_shares(8, {"a": 0, "b": 0}, "n", {"a": 0, "b": 0}) == slice_shares(8, ["a", "b"], "n")


def test_an_ack_s_floor_slots_replace_the_share_floor_for_that_master() -> None:
    """Masters of this release say which floor they want on each node (1 on the node they anchor to,
    0 elsewhere); a master whose Acks say nothing (an earlier release) keeps ``--share-floor``."""
    s = started(16, ["busy", "idle", "old"], policy="demand", rebalance_interval=1.0, floor=1)
    t = s.join_prior_s
    s.on_ack("busy", s.epoch, 5, 40, t, 10, floor=0)
    s.on_ack("idle", s.epoch, 0, 0, t, 10, floor=0)
    s.on_ack("old", s.epoch, 0, 0, t, 10)
    for k in range(8):  # step by step (a quarter of the node at a time), acking each grant
        s.tick(t + 1.0 + k, 11 + k)
        for m in ("idle", "old"):
            s.on_ack(m, s.epoch, 0, 0, t + 1.1 + k, 30 + k, floor=None if m == "old" else 0)
        s.on_ack("busy", s.epoch, 5, 40, t + 1.2 + k, 50 + k, floor=0)
    assert dict(s.targets) == {"busy": 15, "idle": 0, "old": 1}
    assert dict(s.shares) == dict(s.targets)


def test_an_idle_node_goes_back_to_its_even_split_despite_anchored_floors_and_the_hysteresis() -> None:
    """Anchored floors (1 here for a and c, 0 for b) used to tilt an idle node's split (3/1/2 of 6),
    and a loaded split one slot off the even one stayed there under the hysteresis once the load
    stopped. A node where nobody asks for anything splits evenly."""
    s = started(6, ["a", "b", "c"], policy="demand", rebalance_interval=1.0, rebalance_hysteresis=2)
    t = s.join_prior_s
    floors = {"a": 1, "b": 0, "c": 1}
    demand = {"a": (3, 4), "b": (1, 0), "c": (2, 0)}  # (active, wanted): a busy, b and c little
    for k in range(6):
        s.tick(t + 1.0 + k, 11 + k)
        for m in ("a", "b", "c"):
            active, wanted = demand[m]
            s.on_ack(
                m, s.epoch, min(active, s.shares.get(m, 0)), wanted, t + 1.1 + k, 30 + k, floor=floors[m]
            )
    assert dict(s.targets) != {"a": 2, "b": 2, "c": 2}
    now = t + 10.0
    for m in ("a", "b", "c"):  # the load stops
        s.on_ack(m, s.epoch, 0, 0, now, 60, floor=floors[m])
    for k in range(4):
        s.tick(now + 1.0 + k, 61 + k)
        for m in ("a", "b", "c"):
            s.on_ack(m, s.epoch, 0, 0, now + 1.1 + k, 70 + k, floor=floors[m])
    assert dict(s.targets) == {"a": 2, "b": 2, "c": 2}
    assert dict(s.shares) == dict(s.targets)


def test_a_master_with_nothing_here_that_should_have_something_is_not_held_by_the_hysteresis() -> None:
    """A master's anchor moved here (its floor became 1) or its queue asks: from 0 to 1 slot is below
    the hysteresis, but a master at 0 cannot admit anything here, so the split moves at the next
    rebalance."""
    s = started(16, ["a", "b"], policy="demand", rebalance_interval=1.0, rebalance_hysteresis=2)
    t = s.join_prior_s
    s.on_ack("a", s.epoch, 8, 40, t, 10, floor=0)
    s.on_ack("b", s.epoch, 0, 0, t, 10, floor=0)
    for k in range(4):
        s.tick(t + 1.0 + k, 11 + k)
        s.on_ack("b", s.epoch, 0, 0, t + 1.1 + k, 30 + k, floor=0)
        s.on_ack("a", s.epoch, 8, 40, t + 1.2 + k, 50 + k, floor=0)
    assert dict(s.targets) == {"a": 16, "b": 0}
    now = t + 6.0
    s.on_ack("b", s.epoch, 0, 0, now, 60, floor=1)  # b anchors here now
    s.tick(now + 1.0, 61)
    assert dict(s.targets) == {"a": 15, "b": 1}
    # the same move of one slot between two masters that both hold some stays within the hysteresis
    s.on_ack("a", s.epoch, 15, 40, now + 1.1, 62, floor=0)
    s.on_ack("b", s.epoch, 1, 1, now + 1.1, 62, floor=1)
    s.tick(now + 2.2, 63)
    assert dict(s.targets) == {"a": 15, "b": 1}


def test_slots_held_idle_move_to_a_master_whose_requests_wait_whatever_the_hysteresis() -> None:
    """A one-slot move is below the hysteresis; but when the master giving it runs fewer leases than
    it holds and queues nothing, while the taker's requests wait, the slot would only idle: it moves."""
    s = started(16, ["a", "b"], policy="demand", rebalance_interval=1.0, rebalance_hysteresis=2)
    t = s.join_prior_s

    def settle(now: float, a: tuple[int, int], b: tuple[int, int]) -> float:
        for k in range(4):
            s.tick(now + k, 11 + k)
            s.on_ack("b", s.epoch, *b, now + k + 0.1, 30 + k, floor=1)
            s.on_ack("a", s.epoch, *a, now + k + 0.2, 50 + k, floor=0)
        return now + 4

    now = settle(t + 1.0, (10, 2), (6, 0))
    assert dict(s.targets) == {"a": 10, "b": 6}
    # b's demand drops by one, a's grows by one: a wobble of one slot, held by the hysteresis...
    now = settle(now, (10, 1), (5, 1))
    assert dict(s.targets) == {"a": 10, "b": 6}
    # ...but when b runs 5 of its 6 with nothing queued and a's requests wait, the idle slot goes to a
    s.on_ack("b", s.epoch, 5, 0, now, 70, floor=1)
    s.on_ack("a", s.epoch, 10, 1, now, 70, floor=0)
    s.tick(now + 1.0, 71)
    assert dict(s.targets) == {"a": 11, "b": 5}


def _cut_off_b_with_a_stream(stream_b: int) -> Slicer:
    """a and b each run 4 of 8 slots; b's stream ``stream_b`` goes down (b alive, cut off)."""
    s = started(8, ["a", "b"])
    s.stream_up("b", 1.5, 5, stream_id=stream_b)
    for m in ("a", "b"):
        s.on_ack(m, s.epoch, 4, 0, 2.0, 10, kept=4, answers_sent_at=1.9)
    s.stream_down("b", 2.0, 11)
    return s


def test_a_master_that_names_its_lost_stream_released_frees_its_slots_without_a_sample() -> None:
    """b's etcd key names the stream it lost as released (its last request here ended, it places
    nothing more here until a new stream): its slots go to a at once, in its grace or after it,
    and no engine sample is needed."""
    s = _cut_off_b_with_a_stream(77)
    assert s.master_released("b", 77, 2.5, 12)  # still within b's grace
    assert dict(s.shares) == {"a": 8} and s.snapshot()["orphans"] == {}
    assert not s.waits_for_engine
    assert not s.master_released("b", 77, 2.6, 13)  # said once is enough

    s = _cut_off_b_with_a_stream(77)
    s.tick(3.0, 12)  # grace over: b's 4 slots are an orphan
    assert s.snapshot()["orphans"] == {"b": 4} and s.share_for("a") == 4
    assert s.master_released("b", 77, 3.5, 13)
    assert dict(s.shares) == {"a": 8} and s.snapshot()["orphans"] == {}


def test_a_released_stream_that_is_not_the_lost_one_changes_nothing() -> None:
    """The word names one stream: an older stream's (a key not yet rewritten after b came back and
    lost its new stream), any stream while b's is up, or an agent of an earlier release's (0)."""
    s = _cut_off_b_with_a_stream(78)
    s.tick(3.0, 12)
    assert not s.master_released("b", 77, 3.5, 13)  # the stream before
    assert not s.master_released("b", 0, 3.5, 13)
    assert not s.master_released("c", 78, 3.5, 13)  # no such master
    assert s.snapshot()["orphans"] == {"b": 4}
    # b's new stream comes up: the old stream's word is stale, the new stream's names nothing yet
    s.stream_up("b", 4.0, 14, stream_id=79)
    assert not s.master_released("b", 78, 4.1, 15)
    assert not s.master_released("b", 79, 4.1, 15)  # up on this side: b is still in the split
    assert "b" in s.members(4.1)
    # it goes down again, and then its key names it: it leaves at once, and comes back as new
    s.stream_down("b", 5.0, 16)
    assert s.master_released("b", 79, 5.1, 17)
    assert "b" not in s.members(5.1)
    s.stream_up("b", 6.0, 18, stream_id=80)
    assert "b" in s.members(6.0)


def test_a_release_named_after_the_agent_opened_a_new_stream_frees_nothing() -> None:
    """b's stream 77 went down and the agent opened 78 at once: its Register carried b's grant of
    the moment (b was still in its grace), so a word about 77 that comes in after it may not free
    those slots: b may take them up on 78. (The protocol model found this one.)"""
    s = _cut_off_b_with_a_stream(77)
    s.stream_opening("b", 78)
    assert not s.master_released("b", 77, 2.5, 12)
    assert s.share_for("b") == 4


def test_a_returning_master_is_granted_the_leases_it_still_runs_when_nothing_is_free() -> None:
    """b comes back with its 2 leases still running and a holds the rest: b's grant goes back to 2 at
    once (its bound counted them already), so it may replace them as they end. It stayed 0 until they
    ended, and then waited for the next grant (the protocol model's seed 108 with 10 s leases ended
    its run that way)."""
    s = started(4, ["a", "b"])
    s.on_ack("a", s.epoch, 2, 0, 2.0, 10)
    s.on_ack("b", s.epoch, 2, 0, 2.0, 10)
    s.stream_down("b", 2.0, 11)
    s.tick(3.0, 12)
    assert s.snapshot()["orphans"] == {"b": 2} and s.share_for("a") == 2
    s.stream_up("b", 4.0, 13)
    assert s.share_for("b") == 0  # nothing free yet: its Ack has not said what runs
    s.on_ack("b", s.epoch, 2, 0, 4.1, 14)
    assert s.snapshot()["orphans"] == {}
    assert dict(s.shares) == {"a": 2, "b": 2}


def test_a_released_stream_with_leases_still_running_frees_the_rest_and_then_them_as_they_end() -> None:
    """b's key names its lost stream with the slots its leases here still run: the agent frees what b
    held beyond them at once, then each slot as a later word says it ended; a word that says no less
    changes nothing."""
    s = _cut_off_b_with_a_stream(77)
    assert s.master_released("b", 77, 2.5, 12, running=3)
    assert s.snapshot()["orphans"] == {"b": 3} and s.share_for("a") == 5
    assert "b" not in s.members(2.5)
    assert not s.master_released("b", 77, 2.6, 13, running=3)
    assert s.master_released("b", 77, 2.7, 14, running=1)
    assert s.snapshot()["orphans"] == {"b": 1} and s.share_for("a") == 7
    assert s.master_released("b", 77, 2.9, 15, running=0)
    assert dict(s.shares) == {"a": 8} and s.snapshot()["orphans"] == {}
