"""A token bucket, for limiting how fast one agent stream may send reports."""

from __future__ import annotations

import time
from collections.abc import Callable


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up; :meth:`take` spends one if there is one."""

    def __init__(self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic):
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self.rate = rate
        # One second's worth by default: a legitimate agent's burst (a share change right after a
        # periodic report) always fits.
        self.burst = max(1.0, burst if burst is not None else rate)
        self._clock = clock
        self._tokens = self.burst
        self._last = clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
