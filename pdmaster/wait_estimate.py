"""The load signal of admission: completion rate, expected wait and the peers' pooled load (DESIGN §6).

An arrival's expected wait is the slots served before it over the rate slots are released at; with a
fresh load pooled from the peer masters (:class:`PeerLoad`, ``pdmaster.spill``) it is judged over
this master and those peers together. Everything here is O(1) per event: running totals and a
decayed count, never a list of releases or a scan of the queue.

Where nodes publish KV pools (DESIGN §13) tokens may bind before slots: the same estimate is made in
tokens (the queued tokens DRR serves first, plus the arrival's, less the free tokens of this master's
token shares, over the tokens released per second) and the larger of the two is the expected wait.
The peers report no tokens: the token estimate is this master's alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from pdmaster.admission_queue import ClassQueue
from pdmaster.placement import Placement
from pdmaster.ticket import RequestClass

__all__ = ["PEER_LOAD_TTL_S", "RATE_MIN_RELEASES", "PeerLoad", "WaitEstimate"]

# Releases seen before the completion rate is trusted to refuse anyone (see AdmissionPolicy.target_wait_s).
RATE_MIN_RELEASES = 8
# How long the masters' pooled load (set_peer_load) counts in the expected wait: their reports come every
# few tens of milliseconds while requests wait here; an older one describes a queue that has moved on.
PEER_LOAD_TTL_S = 0.5
_NO_QUEUED: dict[RequestClass, int] = {}  # no peers' queues (read only)


@dataclass(frozen=True, slots=True)
class PeerLoad:
    """A master's load as its peers pool it (``/spill/room``, ``pdmaster.spill``), or several summed:
    room one request could start in at once, queued slots per class, the slots per second it serves
    (its completion rate without what it handed to others, which the taker counts) and the slots it
    holds."""

    free: int = 0
    queued: Mapping[RequestClass, int] = field(default_factory=dict)
    rate: float = 0.0
    capacity: int = 0

    def __add__(self, other: PeerLoad) -> PeerLoad:
        q = dict(self.queued)
        for c, n in other.queued.items():
            q[c] = q.get(c, 0) + n
        return PeerLoad(self.free + other.free, q, self.rate + other.rate, self.capacity + other.capacity)


def rounded(x: float | None) -> float | None:
    return None if x is None or x == math.inf else round(x, 3)


class WaitEstimate:
    """Completion rate, mean hold time, the peers' pooled load and the expected wait built on them.

    Reads the class queues (queued slots per class) and the placement (capacity and active slots) it
    is given; it is told of every release (:meth:`released`) and hand-off (:meth:`count_done`)."""

    __slots__ = (
        "_done_at",
        "_done_first",
        "_done_sum",
        "_handed_at",
        "_handed_sum",
        "_placement",
        "_queues",
        "_tau",
        "_tok_sum",
        "_weights",
        "done_n",
        "hold_ewma",
        "peer_load",
        "peer_load_at",
    )

    def __init__(
        self,
        rate_window_s: float,
        weights: Mapping[RequestClass, float],
        queues: Mapping[RequestClass, ClassQueue],
        placement: Placement,
    ) -> None:
        self._weights = weights
        self._queues = queues
        self._placement = placement
        self.hold_ewma: float | None = None  # mean time a lease is held (exponentially weighted)
        # Completion rate: slots released, exponentially decayed with time constant _tau (a count,
        # not a list: O(1) per release and per estimate).
        self._tau = float(rate_window_s)
        self._done_sum = 0.0  # decayed slots released, as of _done_at
        self._tok_sum = 0.0  # decayed tokens released, as of _done_at
        self._done_at = 0.0
        self._done_first = 0.0  # when the first release was seen (for the start-up correction)
        self.done_n = 0  # releases seen
        self._handed_sum = 0.0  # the part of _done_sum that went to peers (hand_off), as of _handed_at
        self._handed_at = 0.0
        # The peers' pooled load (set_peer_load) and when it was set: while fresh, an arrival's
        # expected wait is judged over this master and those peers together.
        self.peer_load: PeerLoad | None = None
        self.peer_load_at = -math.inf

    # ------------------------------------------------------------------ inputs

    def released(self, slots: int, now: float, held: float | None, tokens: int = 0) -> None:
        """A lease of ``slots`` and ``tokens`` ended after being held ``held`` seconds (None: not
        known)."""
        if held is not None:
            self.hold_ewma = held if self.hold_ewma is None else 0.9 * self.hold_ewma + 0.1 * held
        # count_done(slots, now, tokens=tokens), inlined: it is on every release's path
        if self.done_n:
            decay = math.exp(-(now - self._done_at) / self._tau)
            self._done_sum = self._done_sum * decay + slots
            if tokens or self._tok_sum:
                self._tok_sum = self._tok_sum * decay + tokens
        else:
            self._done_sum = slots
            self._tok_sum = tokens
            self._done_first = now
        self._done_at = now
        self.done_n += 1

    def count_done(self, slots: int, now: float, handed: bool = False, tokens: int = 0) -> None:
        """``slots`` and ``tokens`` left for good: the completion rate's decayed sums (``handed``:
        to a peer; counted in tokens too, whose rate is this master's turnover including hand-offs)."""
        if handed:
            tau = self._tau
            self._handed_sum = self._handed_sum * math.exp(-(now - self._handed_at) / tau) + slots
            self._handed_at = now
        if self.done_n:
            decay = math.exp(-(now - self._done_at) / self._tau)
            self._done_sum = self._done_sum * decay + slots
            self._tok_sum = self._tok_sum * decay + tokens
        else:
            self._done_sum = slots
            self._tok_sum = tokens
            self._done_first = now
        self._done_at = now
        self.done_n += 1

    def set_peer_load(self, load: PeerLoad | None, now: float) -> None:
        self.peer_load = load
        self.peer_load_at = now

    def take_peer_room(self, slots: int) -> None:
        """A waiter handed to the peers takes their room."""
        pl = self.peer_load
        if pl is not None:
            self.peer_load = replace(pl, free=max(0, pl.free - slots))

    # ------------------------------------------------------------------ estimates

    def retry_after(self, lo: float, hi: float, queued_slots: int) -> float:
        """A retry hint: the mean hold time times the waves queued, within [lo, hi]."""
        capacity = self._placement.capacity
        if self.hold_ewma is None or capacity == 0:
            return lo
        waves = 1.0 + queued_slots / capacity
        return min(hi, max(lo, self.hold_ewma * waves))

    def completion_rate(self, now: float, *, handed: bool = True) -> float | None:
        """Slots released per second, lately; None before :data:`RATE_MIN_RELEASES` releases
        (see ``AdmissionCore.completion_rate``)."""
        if self.done_n < RATE_MIN_RELEASES:
            return None
        tau = self._tau
        span = 1.0 - math.exp(-(now - self._done_first) / tau)
        if span <= 0.0:
            return math.inf
        done = self._done_sum * math.exp(-(now - self._done_at) / tau)
        if not handed and self._handed_sum:
            done = max(0.0, done - self._handed_sum * math.exp(-(now - self._handed_at) / tau))
        rate = done / (tau * span)
        if self.hold_ewma:
            rate = max(rate, self._placement.active_total / self.hold_ewma)
        return rate

    def token_rate(self, now: float) -> float | None:
        """Tokens released per second, lately, like :meth:`completion_rate` in slots (with hand-offs;
        Little's law on the tokens running now as its floor); None before
        :data:`RATE_MIN_RELEASES` releases."""
        if self.done_n < RATE_MIN_RELEASES:
            return None
        tau = self._tau
        span = 1.0 - math.exp(-(now - self._done_first) / tau)
        if span <= 0.0:
            return math.inf
        rate = self._tok_sum * math.exp(-(now - self._done_at) / tau) / (tau * span)
        if self.hold_ewma:
            rate = max(rate, self._placement.active_tokens_total / self.hold_ewma)
        return rate

    def fresh_peer_load(self, now: float) -> PeerLoad | None:
        """The peers' pooled load while it counts (:data:`PEER_LOAD_TTL_S`), else None."""
        pl = self.peer_load
        return pl if pl is not None and now - self.peer_load_at <= PEER_LOAD_TTL_S else None

    def peer_load_view(self, now: float) -> dict[str, Any] | None:
        pl = self.fresh_peer_load(now)
        if pl is None:
            return None
        return {
            "free": pl.free,
            "queued_slots": sum(pl.queued.values()),
            "rate_slots_per_s": rounded(pl.rate),
        }

    def pooled_bound(self, bound: int, queue_waves: float, now: float) -> int:
        """The queue bound for a first-time arrival: with a fresh peer load, ``queue_waves`` over the
        slots of this master and those peers together, less what the peers queue, as one master over
        them would bound its queue; never below this master's own ``bound``."""
        if self.peer_load is None:  # no peers (spilling off): no call on a queued arrival's path
            return bound
        pl = self.fresh_peer_load(now)
        if pl is None or not pl.capacity:
            return bound
        pooled = math.floor(queue_waves * (self._placement.capacity + pl.capacity) + 1e-9)
        return max(bound, pooled - sum(pl.queued.values()))

    def expected_wait(self, c: RequestClass, slots: int, now: float, tokens: int = 0) -> float | None:
        """Seconds an arrival of class ``c`` needing ``slots`` and ``tokens`` would wait; None: no
        estimate yet (see ``AdmissionCore.expected_wait``): the larger of the estimates in slots and,
        where this master holds token shares, in tokens."""
        w = self._weights
        pl = self.fresh_peer_load(now)
        pq = pl.queued if pl is not None else _NO_QUEUED
        own_q = self._queues[c]
        own = own_q.slots + pq.get(c, 0)
        turn = own + slots
        ahead = float(own)
        for q in self._queues.values():  # in CLASS_ORDER
            if q.cls is not c and (n := q.slots + pq.get(q.cls, 0)):
                ahead += min(n, turn * w[q.cls] / w[c])
        p = self._placement
        need = ahead + slots - max(0, p.capacity - p.active_total) - (pl.free if pl is not None else 0)
        need_tokens = self._token_need(c, own_q, slots, tokens) if p.token_capacity else 0.0
        if need <= 0 and need_tokens <= 0:
            return 0.0
        rate = self.completion_rate(now)
        if pl is not None:
            # What this master serves itself plus what the peers serve; never below this master's own
            # turnover (hand-offs included): a peer that reports no rate (a master of an earlier
            # release, or one just started) must not make the estimate longer.
            pooled = (self.completion_rate(now, handed=False) or 0.0) + pl.rate
            if rate is None or pooled > rate:
                rate = pooled
        if rate is None or rate <= 0.0:
            return None
        wait = max(0.0, need) / rate
        if need_tokens > 0:
            token_rate = self.token_rate(now)
            if token_rate is not None and token_rate > 0.0:
                wait = max(wait, need_tokens / token_rate)
        return wait

    def _token_need(self, c: RequestClass, own_q: ClassQueue, slots: int, tokens: int) -> float:
        """The tokens to free before an arrival of class ``c`` (``slots``, ``tokens``) is served, as DRR
        serves the queued slots (this master's queues alone): all of its own class's, and of each
        other class the part of its tokens that DRR serves with the share in slots it gives it."""
        w = self._weights
        turn = own_q.slots + slots
        ahead = float(own_q.tokens)
        for q in self._queues.values():
            if q.cls is not c and q.tokens and q.slots:
                ahead += q.tokens * min(1.0, turn * w[q.cls] / w[c] / q.slots)
        p = self._placement
        return ahead + tokens - max(0, p.token_capacity - p.pooled_active_tokens)
