"""Per-engine circuit breakers: the master's passive view of whether an engine answers (pure).

DESIGN §7 "Engine faults": the master's own dispatches feed one breaker per node. Refused or reset
connections, timeouts and 5xx answers before the first byte are failures; a 200 is a success; a
client error (4xx) says nothing about the engine.

* **closed**: requests flow; ``failures`` failures in a row open it (a success resets the count), a
  refused connection at once;
* **open**: no request may use the node until ``backoff`` seconds have passed;
* **half-open**: exactly one trial request may use it: a success closes the breaker; a failure opens
  it again with the backoff doubled, capped at ``backoff_max``.

No thrashing: a breaker closed by one lucky trial keeps its backoff; if it opens again within
``backoff_max`` of closing (an engine that fails half of its requests passes trials half of the
time), the next open period doubles instead of starting over at ``backoff``. It starts over once the
engine has stayed good for ``backoff_max``, or when the agent reports the engine up again (``reset``).

Every permission (:meth:`CircuitBreaker.allow`) returns a token naming the breaker's state at the
time; an outcome recorded with a token of an earlier state is ignored, so a request that started
before the breaker opened cannot close it, and a half-open trial is the only request whose outcome
decides. No I/O and no clock of its own: the caller passes ``clock``.

Defaults: 3 failures (sglang-router / SMG trip after 10 failures in a 120 s window, but they retry a
request up to 5 times and count every attempt, so 10 is about two requests there; here a request is
tried at most ``1 + --max-retries`` times and the agent's liveness check already catches an engine
that is plainly dead, so the breaker is for what the check misses — an engine whose /health answers
while its requests fail — and three failed requests in a row is enough evidence). Backoff 1 s,
doubling to 30 s (SMG waits a fixed 60 s before a trial: with one trial request at a time the cost of
probing early is one failed request, against a minute of lost capacity when the engine is back).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "FAILURE_KINDS",
    "BreakerPolicy",
    "BreakerState",
    "CircuitBreaker",
    "EngineBreakers",
    "counts_as_failure",
]

# EngineError kinds that count against the engine (see ``counts_as_failure``).
FAILURE_KINDS = frozenset({"connect", "timeout", "closed"})


def counts_as_failure(kind: str, engine_status: int = 0) -> bool:
    """Whether an engine exchange that ended with ``kind`` (and the engine's HTTP status, 0 when it
    sent none) says the engine is failing: no connection, no answer in time, a connection closed
    under the request, or a 5xx. A 4xx (the client's fault, or a 429 the engine chose) does not."""
    return kind in FAILURE_KINDS or engine_status >= 500


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerPolicy:
    failures: int = 3
    backoff: float = 1.0
    backoff_max: float = 30.0

    def __post_init__(self) -> None:
        if self.failures < 1:
            raise ValueError("breaker failures must be at least 1")
        if not 0 < self.backoff <= self.backoff_max:
            raise ValueError("breaker backoff must be positive and at most the cap")


class CircuitBreaker:
    def __init__(self, policy: BreakerPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self._state = BreakerState.CLOSED
        self.generation = 0  # bumped on every state change; permissions carry it
        self.consecutive_failures = 0
        self.backoff = policy.backoff  # the wait of the current (or next) open period
        self.open_until = 0.0
        self.trial_in_flight = False
        self.last_error = ""
        self.opened = 0  # times it opened (for logs and tests)
        self.closed_at: float | None = None  # when a trial last closed it (None: never, or forgiven)

    # -- state --------------------------------------------------------------------------------
    @property
    def state(self) -> BreakerState:
        self.refresh()
        return self._state

    def refresh(self) -> bool:
        """Open → half-open once the backoff has passed; True when that happened now."""
        if self._state is BreakerState.OPEN and self.clock() >= self.open_until:
            self._move(BreakerState.HALF_OPEN)
            self.trial_in_flight = False
            return True
        return False

    @property
    def current(self) -> BreakerState:
        """The state as last moved, without moving it (listeners read this)."""
        return self._state

    @property
    def usable(self) -> bool:
        """Whether the node may take requests at all (closed, or half-open: its trial decides)."""
        return self.state is not BreakerState.OPEN

    def seconds_to_trial(self) -> float:
        return max(0.0, self.open_until - self.clock()) if self._state is BreakerState.OPEN else 0.0

    def _move(self, state: BreakerState) -> None:
        self._state = state
        self.generation += 1

    def _open(self, backoff: float) -> None:
        self.backoff = backoff
        self.open_until = self.clock() + backoff
        self.trial_in_flight = False
        self.opened += 1
        self._move(BreakerState.OPEN)

    # -- use ----------------------------------------------------------------------------------
    def allow(self) -> int | None:
        """Permission for one request, as a token for :meth:`record`; None when refused (open, or
        half-open with its one trial already in flight)."""
        if self._state is BreakerState.CLOSED:
            return self.generation  # every request asks twice (P and D): the common case first
        state = self.state
        if state is BreakerState.HALF_OPEN and not self.trial_in_flight:
            self.trial_in_flight = True
            return self.generation
        return None

    def record(self, token: int, ok: bool | None, error: str = "", decisive: bool = False) -> bool:
        """The outcome of a permitted request: True success, False failure, None neither (a client
        error, a cancellation). ``decisive``: a failure that needs no second opinion (the engine
        refused the connection: nothing listens), which opens a closed breaker at once. Returns True
        when the state changed."""
        if token != self.generation:
            return False  # permitted under an earlier state: that state is over
        state = self._state
        if state is BreakerState.CLOSED:
            if ok is True:
                self.consecutive_failures = 0
            elif ok is False:
                self.consecutive_failures += 1
                self.last_error = error
                if decisive or self.consecutive_failures >= self.policy.failures:
                    recently = self.closed_at is not None and (
                        self.clock() - self.closed_at < self.policy.backoff_max
                    )
                    self.closed_at = None
                    # Failing again soon after a trial closed it: keep doubling, do not start over.
                    self._open(
                        min(self.backoff * 2, self.policy.backoff_max) if recently else self.policy.backoff
                    )
                    return True
            return False
        if state is BreakerState.HALF_OPEN:
            if ok is None:
                self.trial_in_flight = False  # no verdict: the next request is the trial
                return False
            if ok:
                backoff = self.backoff
                self.reset()
                self.backoff = backoff  # remembered until the engine has stayed good (see above)
                self.closed_at = self.clock()
            else:
                self.last_error = error
                self._open(min(self.backoff * 2, self.policy.backoff_max))
            return True
        return False

    def reset(self) -> bool:
        """Closed, with a fresh count and backoff (a success, or other evidence the engine is back)."""
        changed = self._state is not BreakerState.CLOSED
        self.consecutive_failures = 0
        self.backoff = self.policy.backoff
        self.closed_at = None
        self.trial_in_flight = False
        if changed:
            self._move(BreakerState.CLOSED)
        return changed

    def as_json(self) -> dict[str, object]:
        return {
            "state": self.state.value,
            "consecutive_failures": self.consecutive_failures,
            "backoff_s": self.backoff,
            "seconds_to_trial": round(self.seconds_to_trial(), 3),
            "last_error": self.last_error,
            "opened": self.opened,
        }


# (node_id, breaker) after its state changed.
ChangeListener = Callable[[str, CircuitBreaker], None]


class EngineBreakers:
    """One breaker per node id, created on first use; ``on_change`` hears every state change."""

    def __init__(
        self,
        policy: BreakerPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_change: ChangeListener | None = None,
    ) -> None:
        self.policy = policy or BreakerPolicy()
        self.clock = clock
        self.on_change = on_change
        self.breakers: dict[str, CircuitBreaker] = {}

    def get(self, node_id: str) -> CircuitBreaker:
        b = self.breakers.get(node_id)
        if b is None:
            b = self.breakers[node_id] = CircuitBreaker(self.policy, self.clock)
        return b

    def _changed(self, node_id: str, b: CircuitBreaker) -> None:
        if self.on_change is not None:
            self.on_change(node_id, b)

    def refresh(self, node_id: str) -> None:
        b = self.breakers.get(node_id)
        if b is not None and b.refresh():
            self._changed(node_id, b)

    def allow(self, node_id: str) -> int | None:
        b = self.breakers.get(node_id) or self.get(node_id)
        was = b.generation
        token = b.allow()
        if b.generation != was:  # allow() moved it to half-open
            self._changed(node_id, b)
        return token

    def record(
        self, node_id: str, token: int, ok: bool | None, error: str = "", decisive: bool = False
    ) -> None:
        b = self.breakers.get(node_id) or self.get(node_id)
        if b.record(token, ok, error, decisive):
            self._changed(node_id, b)

    def reset(self, node_id: str) -> None:
        b = self.breakers.get(node_id)
        if b is not None and b.reset():
            self._changed(node_id, b)

    def state(self, node_id: str) -> BreakerState:
        b = self.breakers.get(node_id)
        return b.state if b is not None else BreakerState.CLOSED
