"""Request classification (DESIGN §6): which admission class a request belongs to. Pure, clock-injected.

A session becomes a CONTINUATION once a valid output has been observed for it; the tracker remembers
such sessions for a TTL and keeps at most ``max_sessions`` of them (least recently seen go first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pdmaster.admission import RequestClass

__all__ = ["SessionTracker", "classify_request"]


class SessionTracker:
    """Sessions with an observed valid output (→ CONTINUATION), TTL- and LRU-bounded."""

    def __init__(
        self, *, clock: Callable[[], float], ttl_s: float = 1800.0, max_sessions: int = 100_000
    ) -> None:
        self._clock = clock
        self._ttl = ttl_s
        self._max = max_sessions
        self._seen: OrderedDict[str, float] = OrderedDict()  # session -> expiry, oldest first

    def __len__(self) -> int:
        return len(self._seen)

    def observe_output(self, session_id: str) -> bool:
        """Record a valid output; True when the session was not known as a continuation before."""
        now = self._clock()
        self._evict_expired(now)
        fresh = session_id not in self._seen
        self._seen[session_id] = now + self._ttl
        self._seen.move_to_end(session_id)
        while len(self._seen) > self._max:
            self._seen.popitem(last=False)
        return fresh

    def is_continuation(self, session_id: str | None) -> bool:
        if session_id is None:
            return False
        exp = self._seen.get(session_id)
        if exp is None:
            return False
        if exp <= self._clock():
            del self._seen[session_id]
            return False
        return True

    def _evict_expired(self, now: float) -> None:
        # every entry gets the same TTL and is moved to the end when refreshed, so expiries are
        # in order and the scan stops at the first live one
        s = self._seen
        while s:
            sid, exp = next(iter(s.items()))
            if exp > now:
                break
            del s[sid]


def classify_request(
    session_id: str | None,
    cache_hit_ratio: float | None,
    tracker: SessionTracker | None,
    *,
    hit_threshold: float = 0.5,
) -> RequestClass:
    """CONTINUATION for a known session, PROBABLE_CACHE_HIT at an estimated hit ratio ≥ the threshold."""
    if tracker is not None and tracker.is_continuation(session_id):
        return RequestClass.CONTINUATION
    if cache_hit_ratio is not None and cache_hit_ratio >= hit_threshold:
        return RequestClass.PROBABLE_CACHE_HIT
    return RequestClass.COLD
