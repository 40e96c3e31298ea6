"""The token bucket that limits how fast one agent stream may send messages."""

from __future__ import annotations

import pytest

from pdmaster.ratelimit import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_steady_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(5, clock=clock)
    assert [bucket.take() for _ in range(6)] == [True] * 5 + [False]  # one second's worth of burst
    clock.now += 0.2  # one token back at 5/s
    assert bucket.take() and not bucket.take()
    clock.now += 60  # idle time never saves more than the burst
    assert sum(bucket.take() for _ in range(20)) == 5


def test_sustained_rate_at_the_limit_is_never_refused() -> None:
    clock = Clock()
    bucket = TokenBucket(2, clock=clock)
    for _ in range(100):
        clock.now += 0.5
        assert bucket.take()


def test_fractional_rate_and_bad_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(0.5, clock=clock)
    assert bucket.take() and not bucket.take()  # burst is at least one message
    clock.now += 1.9
    assert not bucket.take()
    clock.now += 0.2
    assert bucket.take()
    with pytest.raises(ValueError):
        TokenBucket(0)
