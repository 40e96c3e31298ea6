"""Session tracker: which ``X-Session-Id`` values have produced valid output (DESIGN §6).

A session seen with valid output within the TTL makes its next requests CONTINUATION. Pure and
clock-injected; bounded by an LRU so a flood of distinct ids cannot grow memory without limit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class SessionTracker:
    def __init__(
        self, *, ttl_s: float = 1800.0, max_sessions: int = 100_000, clock: Callable[[], float]
    ) -> None:
        if max_sessions <= 0:
            raise ValueError("max_sessions must be positive")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # session -> last valid output time

    def __len__(self) -> int:
        return len(self._seen)

    def is_continuation(self, session_id: str | None) -> bool:
        if not session_id:
            return False
        at = self._seen.get(session_id)
        if at is None:
            return False
        if self.clock() - at > self.ttl_s:
            del self._seen[session_id]
            return False
        return True

    def observe_output(self, session_id: str | None) -> bool:
        """Record valid output; True when this is the session's first (so queued work is promoted)."""
        if not session_id:
            return False
        first = not self.is_continuation(session_id)
        self._seen[session_id] = self.clock()
        self._seen.move_to_end(session_id)
        while len(self._seen) > self.max_sessions:
            self._seen.popitem(last=False)
        return first
