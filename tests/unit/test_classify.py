"""Session tracker and request classification."""

from __future__ import annotations

from pdmaster.admission import RequestClass
from pdmaster.classify import SessionTracker, classify_request

CONT = RequestClass.CONTINUATION
PROB = RequestClass.PROBABLE_CACHE_HIT
COLD = RequestClass.COLD


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_session_tracker_ttl_lru_and_classification() -> None:
    clock = Clock()
    tr = SessionTracker(clock=clock, ttl_s=10, max_sessions=2)
    assert classify_request("a", None, tr) is COLD
    assert classify_request("a", 0.5, tr) is PROB and classify_request("a", 0.49, tr) is COLD
    assert tr.observe_output("a") is True and tr.observe_output("a") is False
    assert classify_request("a", None, tr) is CONT
    tr.observe_output("b")
    tr.observe_output("c")  # LRU bound 2: "a" goes
    assert not tr.is_continuation("a") and tr.is_continuation("c") and len(tr) == 2
    clock.now += 10
    assert not tr.is_continuation("b") and not tr.is_continuation(None)


def test_observe_output_drops_expired_sessions_and_refreshes_ttl() -> None:
    clock = Clock()
    tr = SessionTracker(clock=clock, ttl_s=10)
    tr.observe_output("a")
    clock.now += 6
    tr.observe_output("b")
    tr.observe_output("a")  # refreshed: now expires after "b"
    clock.now += 6
    assert tr.observe_output("c") is True
    assert tr.is_continuation("a") and tr.is_continuation("b") and len(tr) == 3
    clock.now += 5  # "b" (observed at +6) is past its TTL, "a" (refreshed at +6) too
    tr.observe_output("d")
    assert len(tr) == 2 and tr.is_continuation("c") and tr.is_continuation("d")


def test_classification_without_tracker_or_session() -> None:
    assert classify_request(None, None, None) is COLD
    assert classify_request("s", 0.9, None) is PROB
    assert classify_request(None, 0.2, SessionTracker(clock=Clock())) is COLD
    assert classify_request("s", 0.7, None, hit_threshold=0.8) is COLD
