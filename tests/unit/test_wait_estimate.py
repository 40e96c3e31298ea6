"""The load signal: completion rate, expected wait, peers' pooled load."""

from __future__ import annotations

import pytest

from pdmaster.admission_queue import ClassQueue
from pdmaster.placement import Placement
from pdmaster.ticket import CLASS_ORDER, Ticket
from pdmaster.wait_estimate import PEER_LOAD_TTL_S, RATE_MIN_RELEASES, PeerLoad, WaitEstimate


def _estimate() -> tuple[WaitEstimate, dict, Placement]:
    queues = {c: ClassQueue(c) for c in CLASS_ORDER}
    pl = Placement()
    pl.apply({"a": 4}, None)
    weights = {c: w for c, w in zip(CLASS_ORDER, (8.0, 3.0, 1.0), strict=True)}
    return WaitEstimate(10.0, weights, queues, pl), queues, pl


def test_no_rate_before_enough_releases_then_a_decayed_rate() -> None:
    est, _, _ = _estimate()
    for i in range(RATE_MIN_RELEASES - 1):
        est.released(1, float(i), 1.0)
    assert est.completion_rate(10.0) is None
    est.released(1, 7.0, 1.0)
    rate = est.completion_rate(7.0)
    assert rate is not None and rate > 0


def test_expected_wait_counts_the_queue_ahead_over_the_rate() -> None:
    est, queues, pl = _estimate()
    for _ in range(RATE_MIN_RELEASES):
        est.released(1, 0.0, 1.0)
    pl.take("a", 4)  # full
    cold = CLASS_ORDER[2]
    t = Ticket(1, 1, cold, None, 0.0)
    t.deadline = 5.0
    queues[cold].add(t)
    rate = est.completion_rate(1.0)
    assert rate is not None
    assert est.expected_wait(cold, 1, 1.0) == pytest.approx(2 / rate)
    # a fresh peer load with free room drains it too
    est.set_peer_load(PeerLoad(free=5, rate=0.0, capacity=4), 1.0)
    assert est.expected_wait(cold, 1, 1.0) == 0.0
    later = 1.0 + PEER_LOAD_TTL_S + 0.1  # stale: this master alone again
    later_rate = est.completion_rate(later)
    assert later_rate is not None
    assert est.expected_wait(cold, 1, later) == pytest.approx(2 / later_rate)
    est.take_peer_room(5)
    assert est.peer_load is not None and est.peer_load.free == 0


def test_pooled_bound_never_below_the_own_bound() -> None:
    est, _, _ = _estimate()
    assert est.pooled_bound(7, 1.0, 0.0) == 7
    est.set_peer_load(PeerLoad(capacity=10, queued={CLASS_ORDER[0]: 2}), 0.0)
    assert est.pooled_bound(4, 1.0, 0.0) == 4 + 10 - 2
    assert est.pooled_bound(4, 1.0, 1.0) == 4  # stale
