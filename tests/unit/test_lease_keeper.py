"""The lease keeper's renewal cadence, on a fake clock and a fake renewer (no etcd: what is checked
is only when the keeper asks)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from pdcoord import registration
from pdcoord.registration import LeaseKeeper


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class _SlowRenewer:
    """Each renewal is answered ``answer_s`` (fake) seconds after it was asked."""

    def __init__(self, clock: _Clock, answer_s: float) -> None:
        self.clock, self.answer_s = clock, answer_s
        self.asked_at: list[float] = []

    async def renew(self) -> int:
        self.asked_at.append(self.clock.now)
        self.clock.now += self.answer_s
        return 5

    def close(self) -> None:
        pass


class _Client:
    def __init__(self, renewer: _SlowRenewer) -> None:
        self._renewer = renewer

    def renewer(self, lease_id: int) -> _SlowRenewer:
        return self._renewer


async def test_a_late_answer_does_not_stretch_the_renewal_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    renewer = _SlowRenewer(clock, answer_s=1.2)
    real_sleep = asyncio.sleep
    slept: list[float] = []

    async def fake_sleep(delay: float, *args: Any) -> None:
        slept.append(delay)
        clock.now += delay
        await real_sleep(0)
        if len(renewer.asked_at) >= 5:
            raise asyncio.CancelledError

    # only the keeper's clock is fake: the event loop keeps the real one
    monkeypatch.setattr(registration, "time", SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(registration.asyncio, "sleep", fake_sleep)
    keeper = LeaseKeeper(_Client(renewer), 1, ttl=6)  # type: ignore[arg-type]
    with pytest.raises(asyncio.CancelledError):
        await keeper._run()
    gaps = [b - a for a, b in zip(renewer.asked_at, renewer.asked_at[1:], strict=False)]
    # every TTL/3 from one renewal's start to the next, however late the answer: the gap that used
    # to be interval + answer time (3.2 s here) reached the TTL on a busy etcd
    assert gaps == pytest.approx([2.0] * len(gaps))
    assert slept == pytest.approx([0.8] * len(slept))
