"""Decode-capacity admission: a pure, synchronous, clock-injected state machine (DESIGN §6).

The core decides; the caller does the I/O. Every public call returns (and stores in
``last_changes``) the tickets whose state changed during the call, so an adapter can wake exactly the
affected waiters without scanning anything.

Data structures, chosen so that no decision scans the queue (every operation is O(log n) amortized):

* per class, a heap (by arrival order) of *eligible heads* only: requests without a session, or the
  oldest queued request of a session that holds no lease. Followers of a session wait in that
  session's deque and enter the class heap when they become its head;
* per class, a max-heap by arrival order of every queued ticket (eviction: lowest class, newest first);
* one heap of deadlines and one heap of queued gangs by size (shrink fails the ones that no longer fit);
* a heap of nodes by free slots (placement on the node with the most free slots, which spreads load and
  is the only node worth checking for a gang).

All heaps use lazy deletion: an entry carries the ticket's generation and is dropped when it surfaces
stale; a heap that grows beyond twice its live size is compacted, so memory stays bounded.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CLASS_ORDER",
    "AdmissionCore",
    "AdmissionPolicy",
    "Reason",
    "RequestClass",
    "SessionTracker",
    "Ticket",
    "TicketState",
    "classify_request",
]


class RequestClass(enum.StrEnum):
    """Priority classes, highest first (see CLASS_ORDER)."""

    CONTINUATION = "continuation"
    PROBABLE_CACHE_HIT = "probable_cache_hit"
    COLD = "cold"


CLASS_ORDER: tuple[RequestClass, ...] = (
    RequestClass.CONTINUATION,
    RequestClass.PROBABLE_CACHE_HIT,
    RequestClass.COLD,
)
_RANK: dict[RequestClass, int] = {c: i for i, c in enumerate(CLASS_ORDER)}


class TicketState(enum.StrEnum):
    QUEUED = "queued"
    GRANTED = "granted"
    REJECTED = "rejected"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    EVICTED = "evicted"


# Module constants: enum attribute access is slow in the hot path.
_QUEUED = TicketState.QUEUED
_GRANTED = TicketState.GRANTED
_REJECTED = TicketState.REJECTED
_EXPIRED = TicketState.EXPIRED
_CANCELLED = TicketState.CANCELLED
_EVICTED = TicketState.EVICTED
_CONT = RequestClass.CONTINUATION

# Outcome codes (also the Prometheus ``outcome`` label values).
GRANTED = "granted"
QUEUE_FULL = "queue_full"
TIMEOUT = "timeout"
EVICTED = "evicted"
CANCELLED = "cancelled"
UNSATISFIABLE = "unsatisfiable"
NO_CAPACITY = "no_capacity"
CANNOT_FIT_NOW = "cannot_fit_now"
INVALID = "invalid"
OUTCOMES: tuple[str, ...] = (
    GRANTED,
    QUEUE_FULL,
    TIMEOUT,
    EVICTED,
    CANCELLED,
    UNSATISFIABLE,
    NO_CAPACITY,
    CANNOT_FIT_NOW,
    INVALID,
)

_MESSAGES: dict[str, str] = {
    QUEUE_FULL: "decode admission queue is full",
    TIMEOUT: "timed out waiting for decode capacity",
    EVICTED: "removed from the decode admission queue to make room for higher-priority requests",
    CANCELLED: "request cancelled while waiting for decode capacity",
    UNSATISFIABLE: "request needs more decode slots than any decode node has",
    NO_CAPACITY: "no decode capacity available",
    CANNOT_FIT_NOW: "request needs more decode slots than this master currently holds on any decode node",
    INVALID: "invalid slot count",
}
_HTTP: dict[str, int] = {UNSATISFIABLE: 400, INVALID: 400, NO_CAPACITY: 503}


@dataclass(frozen=True, slots=True)
class Reason:
    """Why a ticket did not get (or lost) its place: machine code, text, HTTP status and retry hint."""

    code: str
    message: str
    http_status: int
    retry_after_s: float | None


def _default_weights() -> dict[RequestClass, float]:
    return {RequestClass.CONTINUATION: 8, RequestClass.PROBABLE_CACHE_HIT: 3, RequestClass.COLD: 1}


def _default_waits() -> dict[RequestClass, float]:
    return {RequestClass.CONTINUATION: 30.0, RequestClass.PROBABLE_CACHE_HIT: 15.0, RequestClass.COLD: 5.0}


@dataclass(frozen=True)
class AdmissionPolicy:
    """Tunables. ``queue_waves``/``backfill_waves`` are multiples of the current capacity in slots."""

    weights: Mapping[RequestClass, float] = field(default_factory=_default_weights)
    max_wait_s: Mapping[RequestClass, float] = field(default_factory=_default_waits)
    queue_waves: float = 1.0
    backfill_waves: float = 1.0
    bypass: bool = False
    retry_after_min_s: float = 1.0
    retry_after_max_s: float = 30.0

    def __post_init__(self) -> None:
        for c in CLASS_ORDER:
            if c not in self.weights or not self.weights[c] > 0:
                raise ValueError(f"weights[{c.name}] must be > 0")
            if c not in self.max_wait_s or not self.max_wait_s[c] > 0:
                raise ValueError(f"max_wait_s[{c.name}] must be > 0")
        if not self.queue_waves >= 0 or not self.backfill_waves >= 0:
            raise ValueError("queue_waves and backfill_waves must be >= 0")
        if not 0 < self.retry_after_min_s <= self.retry_after_max_s:
            raise ValueError("need 0 < retry_after_min_s <= retry_after_max_s")


# Where a queued ticket lives.
_NOWHERE = 0
_HEAD = 1  # in its class's heap of eligible heads
_WAIT = 2  # in its session's deque, behind the session's lease or an older request
_GANG = 3  # the gang DRR picked that does not fit yet (backfill / reservation)


class Ticket:
    """One request's claim on ``slots`` decode slots on a single node. The core mutates it in place."""

    __slots__ = (
        "_gen",
        "_loc",
        "deadline",
        "ended_at",
        "enqueued_at",
        "granted_at",
        "id",
        "node",
        "reason",
        "released",
        "request_class",
        "session_id",
        "slots",
        "state",
    )

    def __init__(
        self, tid: int, slots: int, request_class: RequestClass, session_id: str | None, now: float
    ) -> None:
        self.id = tid  # also the arrival order
        self.slots = slots
        self.request_class = request_class
        self.session_id = session_id
        self.state = _QUEUED
        self.node: str | None = None
        self.reason: Reason | None = None
        self.enqueued_at = now
        self.deadline = math.inf
        self.granted_at: float | None = None
        self.ended_at: float | None = None
        self.released = False
        self._gen = 0
        self._loc = _NOWHERE

    @property
    def wait_s(self) -> float | None:
        if self.granted_at is not None:
            return self.granted_at - self.enqueued_at
        if self.ended_at is not None:
            return self.ended_at - self.enqueued_at
        return None

    @property
    def done(self) -> bool:
        """True once the ticket has ended: refused/expired/cancelled/evicted, or granted and released."""
        return self.state is not _QUEUED and (self.state is not _GRANTED or self.released)

    def __repr__(self) -> str:
        extra = f" node={self.node}" if self.node else (f" reason={self.reason.code}" if self.reason else "")
        return (
            f"Ticket(#{self.id} {self.request_class.name} n={self.slots} "
            f"session={self.session_id} {self.state.value}{extra})"
        )


class _Session:
    __slots__ = ("active", "live", "queue")

    def __init__(self) -> None:
        self.active: Ticket | None = None
        self.queue: deque[Ticket] = deque()  # arrival order; dead entries are dropped lazily
        self.live = 0


_Entry = tuple[Any, ...]


def _compact(heap: list[_Entry], valid: Callable[[_Entry], bool]) -> None:
    heap[:] = [e for e in heap if valid(e)]
    heapq.heapify(heap)


def _queued_valid(e: _Entry) -> bool:
    t: Ticket = e[-1]
    return t._gen == e[-2] and t.state is _QUEUED


def _head_valid(e: _Entry) -> bool:
    t: Ticket = e[-1]
    return t._gen == e[-2] and t._loc == _HEAD and t.state is _QUEUED


class AdmissionCore:
    """Bounded, fair, gang-aware admission in front of this master's decode shares."""

    def __init__(self, policy: AdmissionPolicy | None = None, *, clock: Callable[[], float]) -> None:
        self.policy = policy or AdmissionPolicy()
        self._clock = clock
        self._bypass = self.policy.bypass
        self._weights = {c: float(self.policy.weights[c]) for c in CLASS_ORDER}
        self._waits = {c: float(self.policy.max_wait_s[c]) for c in CLASS_ORDER}
        # nodes
        self._shares: dict[str, int] = {}
        self._full: dict[str, int] = {}
        self._active: dict[str, int] = {}
        self._node_ver: dict[str, int] = {}
        self._ver = 0
        self._free_heap: list[_Entry] = []  # (-free, node, ver)
        self._capacity = 0
        self._bound = 0
        self._budget = 0
        self._max_share = 0
        self._max_full = 0
        self._active_total = 0
        # queue
        self._seq = 0
        # eligible heads per class, bucketed by slot count so backfill finds "the oldest that fits"
        # in O(distinct sizes) instead of stalling behind a gang: size -> heap of (id, gen, t)
        self._heads: dict[RequestClass, dict[int, list[_Entry]]] = {c: {} for c in CLASS_ORDER}
        self._head_sizes: dict[RequestClass, list[int]] = {c: [] for c in CLASS_ORDER}  # sorted, live only
        self._head_size_n: dict[RequestClass, dict[int, int]] = {c: {} for c in CLASS_ORDER}
        self._heads_n: dict[RequestClass, int] = dict.fromkeys(CLASS_ORDER, 0)
        self._newest: dict[RequestClass, list[_Entry]] = {c: [] for c in CLASS_ORDER}  # (-id, gen, t)
        self._deadlines: list[_Entry] = []  # (deadline, id, gen, t)
        self._gangs: list[_Entry] = []  # (-slots, id, gen, t) for slots > 1
        self._q_n: dict[RequestClass, int] = dict.fromkeys(CLASS_ORDER, 0)
        self._q_slots: dict[RequestClass, int] = dict.fromkeys(CLASS_ORDER, 0)
        self._queued_n = 0
        self._queued_slots = 0
        self._gang_n = 0
        self._sessions: dict[str, _Session] = {}
        # deficit round robin
        self._deficit: dict[RequestClass, float] = dict.fromkeys(CLASS_ORDER, 0.0)
        self._cur = 0
        self._started = False
        # gang backfill / reservation
        self._gang: Ticket | None = None
        self._bf_used = 0
        self._reserved = False
        # bookkeeping
        self._outcomes: dict[RequestClass, dict[str, int]] = {
            c: dict.fromkeys(OUTCOMES, 0) for c in CLASS_ORDER
        }
        self._hold_ewma: float | None = None
        self._changes: list[Ticket] = []
        self._now = 0.0
        self.last_changes: list[Ticket] = []

    # ------------------------------------------------------------------ read-only views

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def active(self) -> int:
        return self._active_total

    @property
    def queued_slots(self) -> int:
        return self._queued_slots

    @property
    def queued_requests(self) -> int:
        return self._queued_n

    @property
    def queue_bound(self) -> int:
        """Queue bound in slots: ``queue_waves`` decode waves of the current capacity."""
        return self._bound

    @property
    def backfill_budget(self) -> int:
        return self._budget

    @property
    def bypass(self) -> bool:
        return self._bypass

    def active_on(self, node: str) -> int:
        return self._active.get(node, 0)

    def share_of(self, node: str) -> int:
        return self._shares.get(node, 0)

    def shares(self) -> dict[str, int]:
        return dict(self._shares)

    def wanted_slots(self) -> int:
        """Queued demand in slots (what the master reports to agents as ``wanted_slots``)."""
        return self._queued_slots

    def max_free(self) -> int:
        return max(0, self._top_free()[0])

    def next_deadline(self) -> float | None:
        h = self._deadlines
        while h and not _queued_valid(h[0]):
            heapq.heappop(h)
        return h[0][0] if h else None

    def outcome_counts(self) -> dict[str, dict[str, int]]:
        return {c.value: dict(v) for c, v in self._outcomes.items()}

    def snapshot(self) -> dict[str, Any]:
        nodes = sorted(set(self._shares) | {n for n, a in self._active.items() if a})
        g = self._gang
        return {
            "bypass": self._bypass,
            "capacity": self._capacity,
            "active": self._active_total,
            "queue_bound_slots": self._bound,
            "queued_requests": self._queued_n,
            "queued_slots": self._queued_slots,
            "wanted_slots": self._queued_slots,
            "sessions": len(self._sessions),
            "classes": {
                c.value: {
                    "queued_requests": self._q_n[c],
                    "queued_slots": self._q_slots[c],
                    "eligible_heads": self._heads_n[c],
                    "deficit": self._deficit[c],
                    "weight": self._weights[c],
                    "max_wait_s": self._waits[c],
                }
                for c in CLASS_ORDER
            },
            "drr": {"current": CLASS_ORDER[self._cur].value, "turn_started": self._started},
            "backfill": {
                "gang_ticket": g.id if g else None,
                "gang_slots": g.slots if g else 0,
                "gang_class": g.request_class.value if g else None,
                "used_slots": self._bf_used,
                "budget_slots": self._budget,
                "reserved": self._reserved,
            },
            "nodes": {
                n: {
                    "share": self._shares.get(n, 0),
                    "full_capacity": self._full.get(n, 0),
                    "active": self._active.get(n, 0),
                }
                for n in nodes
            },
            "outcomes": self.outcome_counts(),
        }

    # ------------------------------------------------------------------ commands

    def set_shares(
        self, shares: Mapping[str, int], node_capacity: Mapping[str, int] | None = None
    ) -> list[Ticket]:
        """Set this master's share per decode node (nodes absent or 0 take no new work).

        ``node_capacity`` is each node's full ``running_max_req_size`` (defaults to the share): it
        decides whether a request that does not fit any share is a 400 (never fits) or a 429.
        Setting the same effective shares again is a no-op: DRR and backfill state are untouched.
        """
        self._begin()
        eff: dict[str, int] = {}
        for node, s in shares.items():
            if int(s) != s or s < 0:
                raise ValueError(f"share of {node!r} must be a non-negative integer, got {s!r}")
            if s > 0:
                eff[node] = int(s)
        full = {n: max(int(node_capacity.get(n, s)) if node_capacity else s, s) for n, s in eff.items()}
        self._full = full
        self._max_full = max(full.values(), default=0)
        if eff == self._shares:
            return self._end()
        for node in set(self._shares) | set(eff):
            if self._shares.get(node) == eff.get(node):
                continue  # untouched: a share change on one node of a thousand costs O(1) heap work
            self._shares.pop(node, None)
            if node in eff:
                self._shares[node] = eff[node]
            self._touch_node(node)
        self._capacity = sum(eff.values())
        self._bound = math.floor(self.policy.queue_waves * self._capacity + 1e-9)
        self._budget = math.floor(self.policy.backfill_waves * self._capacity + 1e-9)
        self._max_share = max(eff.values(), default=0)
        if not self._bypass and self._queued_n:
            if self._capacity == 0:
                for c in reversed(CLASS_ORDER):
                    while (t := self._newest_of(c)) is not None:
                        self._finish(t, _REJECTED, NO_CAPACITY)
            else:
                h = self._gangs
                while h:
                    e = h[0]
                    if not _queued_valid(e):
                        heapq.heappop(h)
                    elif -e[0] > self._max_share:
                        heapq.heappop(h)
                        t = e[-1]
                        code = UNSATISFIABLE if t.slots > self._max_full else CANNOT_FIT_NOW
                        self._finish(t, _REJECTED, code)
                    else:
                        break
                self._trim(self._bound)
        self._pump()
        return self._end()

    def submit(
        self, slots: int = 1, request_class: RequestClass = RequestClass.COLD, session_id: str | None = None
    ) -> Ticket:
        """Ask for ``slots`` slots on one node. The ticket comes back granted, queued or rejected."""
        self._begin()
        now = self._now
        self._seq += 1
        n = int(slots)
        rc = request_class if type(request_class) is RequestClass else RequestClass(request_class)
        t = Ticket(self._seq, n, rc, session_id, now)
        if n < 1 or n != slots:
            return self._refuse(t, INVALID)
        if self._bypass:
            _, node = self._top_free()
            self._grant_new(t, node)
            self._end()
            return t
        if self._capacity == 0:
            return self._refuse(t, NO_CAPACITY)
        if slots > self._max_share:
            return self._refuse(t, UNSATISFIABLE if slots > self._max_full else CANNOT_FIT_NOW)
        s = self._sessions.get(session_id) if session_id is not None else None
        overflow = self._queued_slots + t.slots - self._bound
        if overflow > 0:
            free, node = self._top_free()
            if s is None and not self._reserved and free >= t.slots:
                # Idle fill. After every call the queue is stable: nothing queued fits now (or the
                # blocked gang is being backfilled), so these slots would otherwise stay idle.
                g = self._gang
                if g is None:
                    self._grant_new(t, node)
                    self._end()
                    return t
                if t.slots <= self._budget - self._bf_used:
                    self._deficit[t.request_class] -= t.slots  # backfill is charged like any grant
                    self._grant_new(t, node)
                    self._bf_used += t.slots
                    if self._bf_used >= self._budget:
                        self._reserved = True
                    self._end()
                    return t
            rank = _RANK[t.request_class]
            lower = sum(self._q_slots[c] for c in CLASS_ORDER[rank + 1 :])
            if lower < overflow:  # replacement is all-or-nothing
                return self._refuse(t, QUEUE_FULL)
            for c in reversed(CLASS_ORDER[rank + 1 :]):
                while overflow > 0 and (v := self._newest_of(c)) is not None:
                    overflow -= v.slots
                    self._finish(v, _EVICTED, EVICTED)
            s = self._sessions.get(session_id) if session_id is not None else None
        self._enqueue(t, s, now)
        self._pump()
        self._end()
        return t

    def release(self, t: Ticket) -> list[Ticket]:
        """Return a granted lease's slots. Idempotent; a no-op for tickets that were never granted."""
        self._begin()
        if t.state is not _GRANTED or t.released:
            return self._end()
        t.released = True
        now = self._now
        t.ended_at = now
        if t.granted_at is not None:
            held = now - t.granted_at
            self._hold_ewma = held if self._hold_ewma is None else 0.9 * self._hold_ewma + 0.1 * held
        node = t.node
        if node is not None:
            self._active[node] -= t.slots
            self._touch_node(node)
        self._active_total -= t.slots
        if t.session_id is not None:
            s = self._sessions.get(t.session_id)
            if s is not None and s.active is t:
                s.active = None
                self._refresh_session(t.session_id, s)
        self._pump()
        return self._end()

    def cancel(self, t: Ticket) -> list[Ticket]:
        """Withdraw a waiter (client went away). A granted ticket is released instead."""
        if t.state is _GRANTED:
            return self.release(t)
        self._begin()
        if t.state is _QUEUED:
            self._finish(t, _CANCELLED, CANCELLED)
            self._pump()
        return self._end()

    def expire(self) -> list[Ticket]:
        """Time out every waiter whose deadline is at or before the clock's now."""
        self._begin()
        now = self._now
        h = self._deadlines
        while h:
            e = h[0]
            if not _queued_valid(e):
                heapq.heappop(h)
                continue
            if e[0] > now:
                break
            heapq.heappop(h)
            self._finish(e[-1], _EXPIRED, TIMEOUT)
        if self._changes:
            self._pump()
        return self._end()

    def promote_session(self, session_id: str) -> list[Ticket]:
        """The session produced its first valid output: its waiters become CONTINUATION."""
        self._begin()
        s = self._sessions.get(session_id)
        if s is not None and s.live:
            for t in s.queue:
                if t.state is _QUEUED and t.request_class is not _CONT:
                    self._reclass(t, _CONT)
            self._pump()
        return self._end()

    def pump(self) -> list[Ticket]:
        """Re-run the scheduler (normally never needed: every command already does)."""
        self._begin()
        self._pump()
        return self._end()

    # ------------------------------------------------------------------ internals: bookkeeping

    def _begin(self) -> None:
        self._changes = []
        self._now = self._clock()  # one clock read per call: grants and ends share a timestamp

    def _end(self) -> list[Ticket]:
        self.last_changes = self._changes
        return self._changes

    def _retry_after(self) -> float:
        p = self.policy
        if self._hold_ewma is None or self._capacity == 0:
            return p.retry_after_min_s
        waves = 1.0 + self._queued_slots / self._capacity
        return min(p.retry_after_max_s, max(p.retry_after_min_s, self._hold_ewma * waves))

    def _reason(self, code: str) -> Reason:
        retry = None if code in (UNSATISFIABLE, INVALID) else self._retry_after()
        return Reason(code, _MESSAGES[code], _HTTP.get(code, 429), retry)

    def _refuse(self, t: Ticket, code: str) -> Ticket:
        t.state = _REJECTED
        t.reason = self._reason(code)
        t.ended_at = t.enqueued_at
        self._outcomes[t.request_class][code] += 1
        self._changes.append(t)
        self._end()
        return t

    def _touch_node(self, node: str) -> None:
        self._ver += 1  # global, so a node that leaves and comes back never revives stale entries
        ver = self._ver
        self._node_ver[node] = ver
        free = self._shares.get(node, 0) - self._active.get(node, 0)
        if node not in self._shares and not self._active.get(node):
            self._active.pop(node, None)
            self._node_ver.pop(node, None)
        else:
            heapq.heappush(self._free_heap, (-free, node, ver))
        if len(self._free_heap) > 4 * len(self._node_ver) + 64:
            nv = self._node_ver
            _compact(self._free_heap, lambda e: nv.get(e[1]) == e[2])

    def _top_free(self) -> tuple[int, str | None]:
        h = self._free_heap
        nv = self._node_ver
        while h:
            e = h[0]
            if nv.get(e[1]) == e[2]:
                return -e[0], e[1]
            heapq.heappop(h)
        return 0, None

    def _push(self, heap: list[_Entry], entry: _Entry, live: int, valid: Callable[[_Entry], bool]) -> None:
        heapq.heappush(heap, entry)
        if len(heap) > 2 * live + 64:
            _compact(heap, valid)

    def _push_head(self, t: Ticket) -> None:
        c = t.request_class
        n = t.slots
        t._loc = _HEAD
        self._heads_n[c] += 1
        counts = self._head_size_n[c]
        k = counts.get(n, 0) + 1
        counts[n] = k
        if k == 1:
            bisect.insort(self._head_sizes[c], n)
        heap = self._heads[c].get(n)
        if heap is None:
            heap = self._heads[c][n] = []
        self._push(heap, (t.id, t._gen, t), k, _head_valid)

    def _drop_head(self, c: RequestClass, n: int) -> None:
        """A head of class ``c`` and size ``n`` stopped being one (its heap entry may stay, stale)."""
        self._heads_n[c] -= 1
        counts = self._head_size_n[c]
        k = counts[n] - 1
        if k:
            counts[n] = k
        else:
            del counts[n]
            self._head_sizes[c].remove(n)
            self._heads[c][n].clear()  # nothing live is left in it

    def _push_queued(self, t: Ticket) -> None:
        c = t.request_class
        self._push(self._deadlines, (t.deadline, t.id, t._gen, t), self._queued_n, _queued_valid)
        self._push(self._newest[c], (-t.id, t._gen, t), self._q_n[c], _queued_valid)
        if t.slots > 1:
            self._push(self._gangs, (-t.slots, t.id, t._gen, t), self._gang_n, _queued_valid)

    def _enqueue(self, t: Ticket, s: _Session | None, now: float) -> None:
        c = t.request_class
        t.deadline = now + self._waits[c]
        self._queued_n += 1
        self._queued_slots += t.slots
        self._q_n[c] += 1
        self._q_slots[c] += t.slots
        if t.slots > 1:
            self._gang_n += 1
        self._push_queued(t)
        if t.session_id is None:
            self._push_head(t)
            return
        if s is None:
            s = self._sessions[t.session_id] = _Session()
        blocked = s.active is not None or s.live > 0
        s.queue.append(t)
        s.live += 1
        if blocked:
            t._loc = _WAIT
        else:
            self._push_head(t)

    def _refresh_session(self, sid: str, s: _Session) -> None:
        q = s.queue
        while q and q[0].state is not _QUEUED:
            q.popleft()
        if not q:
            if s.active is None:
                del self._sessions[sid]
        elif s.active is None and q[0]._loc == _WAIT:
            self._push_head(q[0])

    def _clear_gang(self) -> None:
        self._gang = None
        self._bf_used = 0
        self._reserved = False

    def _finish(self, t: Ticket, state: TicketState, code: str) -> None:
        """A queued ticket ends without a grant."""
        c = t.request_class
        loc = t._loc
        t.state = state
        t.reason = self._reason(code)
        t.ended_at = self._now
        self._queued_n -= 1
        self._queued_slots -= t.slots
        self._q_n[c] -= 1
        self._q_slots[c] -= t.slots
        if t.slots > 1:
            self._gang_n -= 1
        if loc == _HEAD:
            self._drop_head(c, t.slots)
        elif loc == _GANG:
            self._clear_gang()
        t._loc = _NOWHERE
        t._gen += 1
        if t.session_id is not None:
            s = self._sessions[t.session_id]
            s.live -= 1
            self._refresh_session(t.session_id, s)
        self._outcomes[c][code] += 1
        self._changes.append(t)

    def _place(self, t: Ticket, node: str | None, now: float) -> None:
        t.state = _GRANTED
        t.node = node
        t.granted_at = now
        if node is not None:
            self._active[node] = self._active.get(node, 0) + t.slots
            self._touch_node(node)
        self._active_total += t.slots
        self._outcomes[t.request_class][GRANTED] += 1
        self._changes.append(t)

    def _grant_new(self, t: Ticket, node: str | None) -> None:
        """Grant an arrival that never entered the queue (idle fill, bypass)."""
        if t.session_id is not None and not self._bypass:
            s = self._sessions.get(t.session_id)
            if s is None:
                s = self._sessions[t.session_id] = _Session()
            if s.active is None:
                s.active = t
        self._place(t, node, t.enqueued_at)

    def _grant(self, t: Ticket, node: str) -> None:
        """Grant a queued ticket that was already taken off its heap (or was the blocked gang)."""
        c = t.request_class
        self._queued_n -= 1
        self._queued_slots -= t.slots
        self._q_n[c] -= 1
        self._q_slots[c] -= t.slots
        if t.slots > 1:
            self._gang_n -= 1
        t._loc = _NOWHERE
        t._gen += 1
        if t.session_id is not None:
            s = self._sessions[t.session_id]
            q = s.queue
            while q[0].state is not _QUEUED:
                q.popleft()
            q.popleft()  # the session's head is the ticket being granted
            s.live -= 1
            s.active = t
        self._place(t, node, self._now)

    def _newest_of(self, c: RequestClass) -> Ticket | None:
        h = self._newest[c]
        while h:
            if _queued_valid(h[0]):
                t: Ticket = h[0][-1]
                return t
            heapq.heappop(h)
        return None

    def _trim(self, bound: int) -> None:
        for c in reversed(CLASS_ORDER):
            while self._queued_slots > bound and (t := self._newest_of(c)) is not None:
                self._finish(t, _EVICTED, EVICTED)

    def _reclass(self, t: Ticket, c: RequestClass) -> None:
        old = t.request_class
        self._q_n[old] -= 1
        self._q_slots[old] -= t.slots
        self._q_n[c] += 1
        self._q_slots[c] += t.slots
        t.request_class = c
        t._gen += 1
        t.deadline = max(t.deadline, t.enqueued_at + self._waits[c])
        self._push_queued(t)
        if t._loc == _HEAD:
            self._drop_head(old, t.slots)
            self._push_head(t)

    # ------------------------------------------------------------------ internals: scheduling

    def _peek_head(self, c: RequestClass, limit: int | None) -> Ticket | None:
        """The oldest eligible head of class ``c`` needing at most ``limit`` slots."""
        best: Ticket | None = None
        heaps = self._heads[c]
        for n in self._head_sizes[c]:
            if limit is not None and n > limit:
                break
            h = heaps[n]
            while not _head_valid(h[0]):  # a live size always has a valid entry
                heapq.heappop(h)
            t: Ticket = h[0][-1]
            if best is None or t.id < best.id:
                best = t
        return best

    def _take_head(self, t: Ticket) -> None:
        heapq.heappop(self._heads[t.request_class][t.slots])  # t is that heap's valid top
        self._drop_head(t.request_class, t.slots)

    def _pick(self, limit: int | None) -> tuple[Ticket, bool] | None:
        """DRR over classes with an eligible head costing at most ``limit``; returns (head, lone)."""
        heads: list[Ticket | None] = [None, None, None]
        n = 0
        n_any = 0
        only = 0
        g = self._gang
        for i, c in enumerate(CLASS_ORDER):
            if not self._heads_n[c]:
                if g is None or g.request_class is not c:
                    self._deficit[c] = 0.0  # nothing eligible: no credit hoarding
                continue
            n_any += 1
            h = self._peek_head(c, limit)
            if h is None:
                continue
            heads[i] = h
            n += 1
            only = i
        if n == 0:
            return None
        if n == 1:
            # A lone candidate never waits for credit (never idle slots). It is free only when no
            # other class has anything eligible; if others merely do not fit now it runs into debt,
            # which keeps long-run slot shares at the weights.
            lone_head = heads[only]
            assert lone_head is not None
            return lone_head, n_any == 1
        d = self._deficit
        w = self._weights
        visits = 0
        while True:
            i = self._cur
            c = CLASS_ORDER[i]
            h = heads[i]
            if h is not None:
                if not self._started:
                    d[c] += w[c]
                    self._started = True
                if h.slots <= d[c]:
                    return h, False
            self._cur = (i + 1) % 3
            self._started = False
            visits += 1
            if visits % 3 == 0:
                # Every candidate got a quantum and none can pay: skip the rounds in which nothing
                # would happen (keeps a big gang behind small weights O(1)).
                k = min(
                    math.ceil((hh.slots - d[CLASS_ORDER[j]]) / w[CLASS_ORDER[j]])
                    for j, hh in enumerate(heads)
                    if hh is not None
                )
                if k > 1:
                    for j, hh in enumerate(heads):
                        if hh is not None:
                            d[CLASS_ORDER[j]] += (k - 1) * w[CLASS_ORDER[j]]

    def _charge(self, c: RequestClass, slots: int, lone: bool) -> None:
        if lone:
            self._deficit[c] = max(0.0, self._deficit[c] - slots)
        else:
            self._deficit[c] -= slots

    def _pump(self) -> None:
        if self._bypass:
            return
        while self._queued_n:
            free, node = self._top_free()
            if free <= 0 or node is None:
                return
            g = self._gang
            if g is not None:
                if g.slots <= free:
                    self._clear_gang()
                    self._charge(g.request_class, g.slots, False)
                    self._grant(g, node)
                    continue
                if self._reserved:
                    return  # freed slots wait for the gang
                remaining = self._budget - self._bf_used
                if remaining <= 0:
                    self._reserved = True
                    return
                pick = self._pick(min(free, remaining))
                if pick is None:
                    return
                t, lone = pick
                self._take_head(t)
                self._charge(t.request_class, t.slots, lone)
                self._grant(t, node)
                self._bf_used += t.slots
                if self._bf_used >= self._budget:
                    self._reserved = True
                continue
            pick = self._pick(None)
            if pick is None:
                return
            t, lone = pick
            self._take_head(t)
            if t.slots <= free:
                self._charge(t.request_class, t.slots, lone)
                self._grant(t, node)
                continue
            # DRR chose a gang that does not fit: later requests may backfill, within a budget.
            t._loc = _GANG
            self._gang = t
            self._bf_used = 0
            self._reserved = self._budget <= 0


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
    if tracker is not None and tracker.is_continuation(session_id):
        return RequestClass.CONTINUATION
    if cache_hit_ratio is not None and cache_hit_ratio >= hit_threshold:
        return RequestClass.PROBABLE_CACHE_HIT
    return RequestClass.COLD
