"""What a request still waits after admission before its first token: a learned line in the prompt
tokens its prefill node computes before its last one (``--admission-target-includes-prefill``).

Why. The admission target bounds the wait; the SLO clients hold a router to is the time to the first
token, which is that wait plus the request's prefill (its queue at the prefill engine, the compute
for the tokens no cache holds, the KV transfer, the first decode step). A 30 000-token prompt takes
most of a 2 s TTFT budget on its own while a short one takes almost none, so one wait target either
refuses short prompts that would have met the SLO or admits long ones that will not. With the
prefill counted, each request gets the wait its own prompt leaves (Mooncake's early rejection
predicts the TTFT the same way).

How. An exponentially weighted least-squares line ``seconds = a + b * tokens_ahead`` over the
requests served lately (``tokens_ahead``: the node's prefill backlog when the request was sent, this
master's and its engine's report, plus the request's uncached prompt tokens; ``pdmaster/routing.py``;
``a`` holds what does not grow with the tokens: the KV transfer, the first decode step). The
observation: their first output minus their grant, less any wait for a decode slot after the
prefill. With the backlog in ``x`` the line measures the engines' rate (``1 / b`` tokens a second)
rather than the load of the moment, so a burst of long prompts at one node raises the prediction for
that node's next request at once instead of some dozens of requests later, and routing sends it
elsewhere. It predicts 0 (the target stays a pure wait target) until it has seen ``MIN_SAMPLES``
requests, never less than 0, and falls back to the mean when every recent prompt had the same size.

The tail. The line is a mean: half the requests it admits at the edge of the target take longer than it
says, and the SLO is held at a high percentile. So the prediction admission uses adds ``spread`` times the
spread of the line's recent misses (each observation against the line as it stood before it, weighted as
the line is): where prefill times scatter (long prompts queued behind each other), the margin grows; where
the line fits, it vanishes.

Pure and clock-free: the pipeline feeds it durations it measured.
"""

from __future__ import annotations

import math

__all__ = ["MIN_SAMPLES", "SPREAD", "PrefillTime"]

MIN_SAMPLES = 8  # requests seen before a prediction counts
SPREAD = 1.3  # standard deviations of the line's misses added to its prediction (about a 90th percentile)


class PrefillTime:
    """Exponentially weighted least squares of the time to first output in the prompt tokens ahead."""

    __slots__ = ("_miss", "_mw", "_n", "_sw", "_sx", "_sxx", "_sxy", "_sy", "spread", "weight")

    def __init__(self, weight: float = 0.02, spread: float = SPREAD) -> None:
        if not 0 < weight <= 1:
            raise ValueError("weight must be within (0, 1]")
        if not spread >= 0:
            raise ValueError("spread must be at least 0")
        self.weight = weight  # of the newest observation
        self.spread = spread
        self._n = 0
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._miss = self._mw = 0.0  # weighted square misses of the line as it stood, and their weight

    @property
    def samples(self) -> int:
        return self._n

    def observe(self, tokens: float, seconds: float) -> None:
        """One served request: the prompt tokens ahead of its last one; seconds from grant to first output."""
        if not (tokens >= 0 and seconds >= 0):
            return
        keep = 1.0 - self.weight
        if (ab := self.line()) is not None:
            miss = seconds - ab[0] - ab[1] * tokens
            self._miss = self._miss * keep + miss * miss
            self._mw = self._mw * keep + 1.0
        self._sw = self._sw * keep + 1.0
        self._sx = self._sx * keep + tokens
        self._sy = self._sy * keep + seconds
        self._sxx = self._sxx * keep + tokens * tokens
        self._sxy = self._sxy * keep + tokens * seconds
        self._n += 1

    def line(self) -> tuple[float, float] | None:
        """(a, b): seconds = a + b * tokens; None before MIN_SAMPLES observations."""
        if self._n < MIN_SAMPLES:
            return None
        w = self._sw
        mx, my = self._sx / w, self._sy / w
        var = self._sxx / w - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):
            return my, 0.0  # every recent prompt the same size: the mean
        b = max(0.0, (self._sxy / w - mx * my) / var)
        return my - b * mx, b

    @property
    def miss_s(self) -> float:
        """The spread (root mean square) of the line's recent misses, in seconds."""
        return math.sqrt(self._miss / self._mw) if self._mw > 0.0 else 0.0

    def predict(self, tokens: float) -> float:
        """Seconds from grant to first output for a request with ``tokens`` prompt tokens ahead of its last
        one: the line plus ``spread`` times its recent misses, so that most requests take no longer."""
        ab = self.line()
        if ab is None:
            return 0.0
        return max(0.0, ab[0] + ab[1] * tokens + self.spread * self.miss_s)
