"""Protocol rules of the master's node registry (DESIGN §5), on the pure core."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pdmaster.coordination import CoordinationService, _Stream
from pdmaster.metrics import MasterMetrics
from pdmaster.registry import DECODE, PREFILL, GrantResult, NodeRegistry, ProtocolError, kept_slots


def reg(
    r: NodeRegistry,
    node: str = "d1",
    cap: int = 8,
    grant: tuple[int, int] | None = (4, 10),
    role: str = DECODE,
):
    return r.register(
        node_id=node, role=role, endpoint="http://127.0.0.1:1", running_max_req_size=cap, grant=grant
    )


def test_capacity_is_sum_of_decode_shares_over_live_streams() -> None:
    r = NodeRegistry()
    seen: list[dict[str, int]] = []
    r.subscribe(seen.append)
    _, s1 = reg(r, "d1", 8, (4, 10))
    reg(r, "d2", 5, (3, 10))
    reg(r, "p1", 8, (8, 10), role=PREFILL)
    assert r.capacity == 7
    assert seen[-1] == {"d1": 4, "d2": 3}
    r.disconnect("d1", s1)
    assert r.capacity == 3  # zeroed the moment the stream drops
    assert seen[-1] == {"d2": 3}


def test_legacy_agent_counts_as_full_capacity() -> None:
    r = NodeRegistry()
    node, _ = reg(r, "old", 6, None)
    assert node.legacy and r.capacity == 6


def test_stale_epoch_ignored_and_counted_equal_epoch_other_share_refused() -> None:
    r = NodeRegistry()
    _, s = reg(r, "d1", 8, (4, 10))
    assert r.apply_grant("d1", s, 5, 11) is GrantResult.APPLIED
    assert r.apply_grant("d1", s, 2, 9) is GrantResult.STALE
    assert r.nodes["d1"].share == 5 and r.nodes["d1"].stale_reports == 1 and r.stale_total == 1
    assert r.apply_grant("d1", s, 5, 11) is GrantResult.UNCHANGED
    with pytest.raises(ProtocolError) as exc:
        r.apply_grant("d1", s, 6, 11)
    assert exc.value.code == "FAILED_PRECONDITION"


def test_epoch_only_change_does_not_notify_admission() -> None:
    r = NodeRegistry()
    seen: list[dict[str, int]] = []
    r.subscribe(seen.append)
    _, s = reg(r, "d1", 8, (4, 10))
    n = len(seen)
    assert r.apply_grant("d1", s, 4, 12) is GrantResult.APPLIED
    assert len(seen) == n


def test_refusals() -> None:
    r = NodeRegistry(max_node_capacity=16)
    reg(r, "d1", 8)
    with pytest.raises(ProtocolError) as e:
        reg(r, "d1", 8)
    assert e.value.code == "ALREADY_EXISTS" and "d1" in e.value.message
    with pytest.raises(ProtocolError) as e:
        reg(r, "big", 17)
    assert e.value.code == "OUT_OF_RANGE" and "--max-node-capacity" in e.value.message
    with pytest.raises(ProtocolError):
        reg(r, "d2", 8, (9, 1))  # share above capacity
    with pytest.raises(ProtocolError):
        r.register(node_id="x", role="gpu", endpoint="http://a", running_max_req_size=1)
    with pytest.raises(ProtocolError):
        r.register(node_id="x", role=DECODE, endpoint="ftp://a", running_max_req_size=1)


def test_reconnect_after_drop_takes_new_epoch() -> None:
    r = NodeRegistry()
    _, s = reg(r, "d1", 8, (4, 10))
    r.disconnect("d1", s)
    node, s2 = reg(r, "d1", 8, (8, 20))
    assert s2 != s and node.share == 8 and r.capacity == 8
    r.disconnect("d1", s)  # the old stream's late cleanup must not hit the new one
    assert r.capacity == 8


def test_change_listeners_hear_only_the_nodes_that_changed_with_their_capacity() -> None:
    r = NodeRegistry(defer=lambda fn: None)  # batched: told at flush(), as before an Ack
    _, s1 = reg(r, "d1", 8, (4, 10))
    seen: list[dict[str, tuple[int, int]]] = []
    r.subscribe_changes(lambda changes: seen.append(dict(changes)))
    assert seen == [{"d1": (4, 8)}]  # at once: everything held now
    _, s2 = reg(r, "d2", 6, (3, 10))
    reg(r, "p1", 8, (8, 10), role=PREFILL)
    assert r.apply_grant("d1", s1, 2, 11) is GrantResult.APPLIED
    assert r.apply_grant("d1", s1, 2, 12) is GrantResult.APPLIED  # epoch only: nothing to tell
    r.flush()
    assert seen[-1] == {"d2": (3, 6), "d1": (2, 8)}
    r.disconnect("d2", s2)
    r.flush()
    assert seen[-1] == {"d2": (0, 0)}
    r.flush()  # nothing pending: no call
    assert len(seen) == 3
    # A node that comes back with another capacity: admission must hear the new one (400 vs 429).
    r.disconnect("d1", s1)
    reg(r, "d1", 4, (2, 20))
    r.flush()
    assert seen[-1] == {"d1": (2, 4)}


def test_kept_slots_are_the_held_slots_not_granted_since_the_previous_ack() -> None:
    assert kept_slots(5, 10, None) == 0  # a stream's first Ack keeps nothing
    assert kept_slots(5, 10, 10) == 5  # nothing granted since: every lease was held then
    assert kept_slots(5, 12, 10) == 3  # two granted since: at least three were held then
    assert kept_slots(2, 20, 10) == 0  # more granted than held: nothing can be said


def test_an_ack_carries_what_the_core_says_was_kept() -> None:
    """kept_slots comes from the admission core (``AdmissionCore.kept_since``) with the stream's
    mark, which the next Ack passes back."""
    calls: list[tuple[str, int | None]] = []
    counts = {"active": 5, "kept": 3}

    def kept(node: str, mark: int | None) -> tuple[int, int]:
        calls.append((node, mark))
        return counts["kept"], len(calls)

    metrics = MasterMetrics(CollectorRegistry(), "m")
    svc = CoordinationService(
        "m", NodeRegistry(), metrics, slots=lambda _node: (counts["active"], 0), kept=kept
    )
    st = _Stream("d1", 1, decode=True)
    msg, mark = svc._ack("d1", 7, 1, None, st)
    assert msg.ack.active_slots == 5 and msg.ack.kept_slots == 3 and mark == 1
    assert not msg.ack.draining and not st.said_draining
    counts["kept"] = 4
    msg, mark = svc._ack("d1", 7, 2, mark, st)
    assert msg.ack.kept_slots == 4 and mark == 2 and calls == [("d1", None), ("d1", 1)]
    without = CoordinationService("m", NodeRegistry(), metrics, slots=lambda _: (5, 0))
    assert not without._ack("d1", 7, 1, None, st)[0].ack.HasField("kept_slots")  # as an earlier release
