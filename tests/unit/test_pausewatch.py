"""PauseWatch: a gap between two beats is a pause of the whole process."""

from __future__ import annotations

import math
import time

import pytest

from pdmaster.pausewatch import PauseWatch


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_a_late_beat_is_a_pause_that_ended_then() -> None:
    clock = Clock()
    seen: list[float] = []
    w = PauseWatch(gap_s=1.0, every_s=0.1, clock=clock, on_pause=seen.append)
    for _ in range(5):
        clock.now += 0.3
        w.beat(clock.now)
    assert w.resumed_at(clock.now) == -math.inf and w.pauses == 0
    clock.now += 2.5
    w.beat(clock.now)
    assert w.resumed_at(clock.now) == clock.now and w.pauses == 1 and w.longest_s == pytest.approx(2.5)
    assert seen == [pytest.approx(2.5)]
    resumed = clock.now
    clock.now += 0.2
    w.beat(clock.now)
    assert w.resumed_at(clock.now) == resumed and w.pauses == 1


def test_a_pause_the_thread_has_not_seen_yet_counts_from_now() -> None:
    """After a pause the main thread may run before the watch thread: the old beat tells it."""
    clock = Clock()
    w = PauseWatch(gap_s=1.0, every_s=0.1, clock=clock)
    w.beat(clock.now)
    assert w.resumed_at(clock.now + 0.9) == -math.inf
    assert w.resumed_at(clock.now + 1.2) == clock.now + 1.2


def test_the_thread_beats_and_stops() -> None:
    w = PauseWatch(gap_s=1.0, every_s=0.02)
    w.start()
    try:
        first = w._beat
        deadline = time.monotonic() + 10
        while w._beat == first and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w._beat > first
    finally:
        w.stop()
    assert w._thread is None


def test_bad_periods_are_refused() -> None:
    with pytest.raises(ValueError, match="every_s"):
        PauseWatch(gap_s=1.0, every_s=1.0)
