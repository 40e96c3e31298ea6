"""Admission tunables (DESIGN §6): class weights and wait timeouts, queue and backfill bounds, the
target wait, and the bypass switch. ``pdmaster.admission_controller`` builds one from the flags."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdmaster.ticket import CLASS_ORDER, RequestClass

__all__ = ["MIN_TARGET_WAIT_S", "AdmissionPolicy"]

# The shortest wait a time-to-first-token target leaves a queued request whose prefill takes it all.
MIN_TARGET_WAIT_S = 0.05


def _default_weights() -> dict[RequestClass, float]:
    return {RequestClass.CONTINUATION: 8, RequestClass.PROBABLE_CACHE_HIT: 3, RequestClass.COLD: 1}


def _default_waits() -> dict[RequestClass, float]:
    return {RequestClass.CONTINUATION: 30.0, RequestClass.PROBABLE_CACHE_HIT: 15.0, RequestClass.COLD: 5.0}


@dataclass(frozen=True)
class AdmissionPolicy:
    """Tunables. ``queue_waves``/``backfill_waves`` are multiples of the current capacity in slots.

    ``target_wait_s`` (None, or a class's 0: off) is an SLO on the wait: an arrival whose expected wait
    (:meth:`AdmissionCore.expected_wait`) exceeds its class's target is refused at once
    (``expected_wait``) instead of holding its client until it times out, and the class's wait
    timeout is capped by the target. ``rate_window_s`` is the time constant of the completion rate
    the estimate divides by.
    """

    weights: Mapping[RequestClass, float] = field(default_factory=_default_weights)
    max_wait_s: Mapping[RequestClass, float] = field(default_factory=_default_waits)
    queue_waves: float = 1.0
    backfill_waves: float = 1.0
    bypass: bool = False
    retry_after_min_s: float = 1.0
    retry_after_max_s: float = 30.0
    target_wait_s: Mapping[RequestClass, float] | None = None
    rate_window_s: float = 10.0
    # Two-stage admission (``pdmaster.staged_admission``; not the core's business): the prefill work
    # that may run beyond the decode capacity, as a fraction of it. 0: one stage.
    prefill_lookahead: float = 0.0
    # The target bounds the expected wait plus the caller's ``lead_s`` (the request's expected time
    # from its grant to its first token, ``pdmaster.prefill_time``): a time-to-first-token target.
    target_includes_prefill: bool = False

    def __post_init__(self) -> None:
        for c in CLASS_ORDER:
            if c not in self.weights or not self.weights[c] > 0:
                raise ValueError(f"weights[{c.name}] must be > 0")
            if c not in self.max_wait_s or not self.max_wait_s[c] > 0:
                raise ValueError(f"max_wait_s[{c.name}] must be > 0")
            if self.target_wait_s is not None and not self.target_wait_s.get(c, 0) >= 0:
                raise ValueError(f"target_wait_s[{c.name}] must be >= 0 (0: off)")
        if not self.rate_window_s > 0:
            raise ValueError("rate_window_s must be > 0")
        if not 0 <= self.prefill_lookahead <= 1:
            raise ValueError("prefill_lookahead must be within [0, 1]")
        if not self.queue_waves >= 0 or not self.backfill_waves >= 0:
            raise ValueError("queue_waves and backfill_waves must be >= 0")
        if not 0 < self.retry_after_min_s <= self.retry_after_max_s:
            raise ValueError("need 0 < retry_after_min_s <= retry_after_max_s")
