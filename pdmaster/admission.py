"""Decode-capacity admission: a pure, synchronous, clock-injected state machine (DESIGN §6).

The core decides; the caller does the I/O. Every public call returns (and stores in
``last_changes``) the tickets whose state changed during the call, so an adapter can wake exactly the
affected waiters without scanning anything. Refusals carry a reason *code* and a retry hint; what a
code means to a client (HTTP status, message) is the adapter's business.

Data structures, chosen so that the cost of a decision does not grow with the queue: what joins and
leaves in arrival order (most tickets) costs O(1) amortized, the rest O(log n), and nothing scans:

* per class, one ``_ClassQueue`` that owns every queued ticket of that class: its counters, a deque in
  arrival order (ticket ids only grow and each class has one fixed timeout, so the deque is sorted
  both by age and by deadline: timeouts pop from its left, evictions take the newest from its right),
  and small side heaps for the tickets that joined the class later by promotion;
* per class and slot count, the *eligible heads*: requests without a session, or the oldest queued
  request of a session that holds no lease. Those that are eligible on arrival go to a FIFO deque;
  those that become eligible later (a session's next request, a promoted one) to a side heap by
  arrival order. Bucketing by slot count lets backfill find "the oldest that fits" in O(sizes);
* one heap of queued gangs by size (a shrink fails the ones that no longer fit) and a heap of nodes
  by free slots (placement on the node with the most free slots, which spreads load and is the only
  node worth checking for a gang);
* a short list of queued *resubmissions* (``submit(..., avoid=, deadline=)``: a request retried after its
  engine failed it). A resubmission already won its turn once and was charged for it, so it keeps its
  class and its absolute deadline and goes before every first-time waiter; it is never placed on a
  node it ``avoid``s (the one that failed it) and, while only such nodes have room, waits without
  holding anyone else up. Looking past the avoided nodes pops at most ``len(avoid)`` live entries off
  the node heap; a request without ``avoid`` pays nothing for this.

Tickets are removed lazily: an entry whose ticket has moved on is dropped when it surfaces, and a
structure that grows beyond twice its live size is compacted, so memory stays bounded.

A process that was frozen (SIGSTOP, a paused VM, a starved cgroup) wakes up believing in shares
the agents may have handed on meanwhile: they cut its streams while it did not answer, and the
stream ends are only read after it runs again. ``watch_pauses`` makes the core place nothing for a
while after such a pause, so those ends are seen before anything else is placed (see
``pdmaster.pausewatch``).
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "CLASS_ORDER",
    "AdmissionCore",
    "AdmissionPolicy",
    "Reason",
    "RequestClass",
    "Ticket",
    "TicketState",
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
EXPECTED_WAIT = "expected_wait"  # refused at once: its expected wait exceeds its class's target
HANDED_OFF = "handed_off"  # left the queue for a peer master's free room (pdmaster/spill.py)
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
    EXPECTED_WAIT,
    HANDED_OFF,
)

# The shortest wait a time-to-first-token target leaves a queued request whose prefill takes it all.
MIN_TARGET_WAIT_S = 0.05
# Releases seen before the completion rate is trusted to refuse anyone (see AdmissionPolicy.target_wait_s).
RATE_MIN_RELEASES = 8
# How long the masters' pooled load (set_peer_load) counts in the expected wait: their reports come every
# few tens of milliseconds while requests wait here; an older one describes a queue that has moved on.
PEER_LOAD_TTL_S = 0.5
_NO_QUEUED: dict[RequestClass, int] = {}  # no peers' queues (read only)


@dataclass(frozen=True, slots=True)
class Reason:
    """Why a ticket did not get (or lost) its place: an outcome code and a retry hint (None: never retry)."""

    code: str
    retry_after_s: float | None


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


# Where a queued ticket lives.
_NOWHERE = 0
_HEAD = 1  # among its class's eligible heads
_WAIT = 2  # in its session's deque, behind the session's lease or an older request
_GANG = 3  # the gang DRR picked that does not fit yet (backfill / reservation)
_RETRY = 4  # among the queued resubmissions
_NO_AVOID: frozenset[str] = frozenset()


class Ticket:
    """One request's claim on ``slots`` decode slots on a single node. The core mutates it in place."""

    __slots__ = (
        "_loc",
        "avoid",
        "deadline",
        "ended_at",
        "enqueued_at",
        "granted_at",
        "id",
        "node",
        "reason",
        "released",
        "request_class",
        "sent",
        "sent_gen",
        "session_id",
        "slots",
        "state",
        "unseen",
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
        # Its decode request went out to the engine (AdmissionCore.decode_sent), between the node's
        # Acks number sent_gen and sent_gen + 1 (AdmissionCore.kept_since).
        self.sent = False
        self.sent_gen = 0
        # The master no longer sees when this lease's decode ends (see AdmissionCore.end_unseen).
        self.unseen = False
        self.avoid = _NO_AVOID  # nodes this ticket is never placed on
        self._loc = _NOWHERE

    @property
    def wait_s(self) -> float | None:
        if self.granted_at is not None:
            return self.granted_at - self.enqueued_at
        if self.ended_at is not None:
            return self.ended_at - self.enqueued_at
        return None

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


def _live(t: Ticket, c: RequestClass) -> bool:
    """``t`` is still queued in class ``c`` (for lazily deleted entries)."""
    return t.state is _QUEUED and t.request_class is c


class _Heads:
    """The eligible heads of one class needing one slot count, oldest first.

    A ticket that is eligible on arrival is the newest of all, so appending keeps ``fifo`` sorted;
    one that becomes eligible later is older than some of those and goes to the ``late`` heap. The
    oldest head is the older of the two fronts. An entry is live while its ticket is a head of this
    class (a ticket is a head at most once per class). ``dead`` counts the entries left behind by
    heads that ended in place (cancelled, timed out, evicted, promoted): while it is 0 the fronts are
    live and need no check, which spares a look at a waiter that has long left the CPU cache.
    """

    __slots__ = ("cls", "dead", "fifo", "late", "n")

    def __init__(self, cls: RequestClass) -> None:
        self.cls = cls
        self.fifo: deque[Ticket] = deque()
        self.late: list[tuple[int, Ticket]] = []  # (id, ticket)
        self.n = 0  # live heads
        self.dead = 0  # entries of former heads still in fifo or late

    def push(self, t: Ticket) -> None:
        self.n += 1
        f = self.fifo
        if not f or f[-1].id < t.id:
            f.append(t)
        else:
            heapq.heappush(self.late, (t.id, t))

    def peek(self) -> Ticket:
        """The oldest live head (callers only ask when ``n`` > 0)."""
        f = self.fifo
        h = self.late
        if self.dead:
            c = self.cls
            while f and (f[0]._loc != _HEAD or f[0].request_class is not c):
                f.popleft()
                self.dead -= 1
            while h and (h[0][1]._loc != _HEAD or h[0][1].request_class is not c):
                heapq.heappop(h)
                self.dead -= 1
        if not h:
            return f[0]
        if not f or h[0][0] < f[0].id:
            return h[0][1]
        return f[0]

    def pop(self, t: Ticket) -> None:
        """Take ``t``, which ``peek`` just returned."""
        self.n -= 1
        f = self.fifo
        if f and f[0] is t:
            f.popleft()
        else:
            heapq.heappop(self.late)

    def drop(self) -> None:
        """A head stopped being one in place; its entry is dropped when it surfaces."""
        self.n -= 1
        self.dead += 1
        if not self.n:  # nothing live is left: free the dead entries now
            self.fifo.clear()
            self.late.clear()
            self.dead = 0
        elif self.dead > self.n + 64:
            c = self.cls
            self.fifo = deque(t for t in self.fifo if t._loc == _HEAD and t.request_class is c)
            self.late = [e for e in self.late if e[1]._loc == _HEAD and e[1].request_class is c]
            heapq.heapify(self.late)
            self.dead = 0


class _ClassQueue:
    """Every queued ticket of one class: counters, arrival order, promoted arrivals, eligible heads.

    ``arrivals`` holds the tickets that entered the queue in this class, in arrival order; since the
    class has one timeout and the clock does not go back, their deadlines are in the same order. A
    ticket promoted into the class is older than some of them and has its own deadline: it goes to
    the ``moved_*`` heaps instead (promotion is rare, so these stay small).
    """

    __slots__ = (
        "arrivals",
        "cls",
        "heads",
        "heads_n",
        "moved_by_deadline",
        "moved_newest",
        "n",
        "sizes",
        "slots",
    )

    def __init__(self, cls: RequestClass) -> None:
        self.cls = cls
        self.n = 0  # queued tickets
        self.slots = 0  # their slots
        self.arrivals: deque[Ticket] = deque()
        self.moved_by_deadline: list[tuple[float, int, Ticket]] = []
        self.moved_newest: list[tuple[int, Ticket]] = []  # (-id, ticket)
        self.heads: dict[int, _Heads] = {}  # slot count -> eligible heads of that size
        self.sizes: list[int] = []  # sorted slot counts with at least one live head
        self.heads_n = 0

    # --- membership

    def add(self, t: Ticket) -> None:
        self.n += 1
        self.slots += t.slots
        a = self.arrivals
        if a and a[-1].deadline > t.deadline:  # only a clock that went back gets here
            self.add_moved(t)
        else:
            a.append(t)

    def add_moved(self, t: Ticket) -> None:
        """``t`` joins out of arrival order (promotion): it goes to the side heaps."""
        heapq.heappush(self.moved_by_deadline, (t.deadline, t.id, t))
        heapq.heappush(self.moved_newest, (-t.id, t))

    def remove(self, t: Ticket) -> None:
        """``t`` left the class (its state or class already changed); its entries go lazily."""
        self.n -= 1
        self.slots -= t.slots
        a = self.arrivals
        c = self.cls
        # grants mostly take the oldest: trimming the front here keeps the deque short for free
        while a and (a[0].state is not _QUEUED or a[0].request_class is not c):
            a.popleft()
        if len(a) > 2 * self.n + 64:
            self.arrivals = deque(u for u in a if _live(u, c))
        if len(self.moved_newest) > 2 * self.n + 64:
            self.moved_newest = [e for e in self.moved_newest if _live(e[1], c)]
            heapq.heapify(self.moved_newest)
            self.moved_by_deadline = [e for e in self.moved_by_deadline if _live(e[2], c)]
            heapq.heapify(self.moved_by_deadline)

    # --- order

    def first_deadline(self) -> Ticket | None:
        """The queued ticket of this class with the earliest deadline."""
        a = self.arrivals
        c = self.cls
        while a and (a[0].state is not _QUEUED or a[0].request_class is not c):
            a.popleft()
        m = self.moved_by_deadline
        while m and (m[0][2].state is not _QUEUED or m[0][2].request_class is not c):
            heapq.heappop(m)
        if not m:
            return a[0] if a else None
        u = m[0][2]
        return u if not a or (u.deadline, u.id) < (a[0].deadline, a[0].id) else a[0]

    def newest(self) -> Ticket | None:
        """The most recent arrival still queued in this class (eviction goes newest first)."""
        a = self.arrivals
        c = self.cls
        while a and (a[-1].state is not _QUEUED or a[-1].request_class is not c):
            a.pop()
        m = self.moved_newest
        while m and (m[0][1].state is not _QUEUED or m[0][1].request_class is not c):
            heapq.heappop(m)
        if not m:
            return a[-1] if a else None
        u = m[0][1]
        return u if not a or u.id > a[-1].id else a[-1]

    # --- eligible heads

    def push_head(self, t: Ticket) -> None:
        t._loc = _HEAD
        self.heads_n += 1
        n = t.slots
        h = self.heads.get(n)
        if h is None:
            h = self.heads[n] = _Heads(self.cls)
        if not h.n:
            bisect.insort(self.sizes, n)
        h.push(t)

    def take_head(self, t: Ticket) -> None:
        """Take ``t``, which ``peek_head`` just returned, off the eligible heads."""
        self.heads_n -= 1
        t._loc = _NOWHERE
        h = self.heads[t.slots]
        h.pop(t)
        if not h.n:
            self.sizes.remove(t.slots)

    def drop_head(self, t: Ticket) -> None:
        """``t`` stops being a head where it is (it ended, or moved to another class)."""
        self.heads_n -= 1
        h = self.heads[t.slots]
        h.drop()
        if not h.n:
            self.sizes.remove(t.slots)

    def peek_head(self, limit: int | None) -> Ticket | None:
        """The oldest eligible head needing at most ``limit`` slots."""
        best: Ticket | None = None
        heads = self.heads
        for n in self.sizes:
            if limit is not None and n > limit:
                break
            t = heads[n].peek()
            if best is None or t.id < best.id:
                best = t
        return best


def _check_shares(shares: Mapping[str, int]) -> None:
    for node, s in shares.items():
        if int(s) != s or s < 0:
            raise ValueError(f"share of {node!r} must be a non-negative integer, got {s!r}")


def _rounded(x: float | None) -> float | None:
    return None if x is None or x == math.inf else round(x, 3)


def _uncount(counts: dict[int, int], value: int) -> None:
    n = counts[value] - 1
    if n:
        counts[value] = n
    else:
        del counts[value]


class AdmissionCore:
    """Bounded, fair, gang-aware admission in front of this master's decode shares."""

    def __init__(self, policy: AdmissionPolicy | None = None, *, clock: Callable[[], float]) -> None:
        self.policy = policy or AdmissionPolicy()
        self._clock = clock
        self._bypass = self.policy.bypass
        self._weights = {c: float(self.policy.weights[c]) for c in CLASS_ORDER}
        tw = self.policy.target_wait_s or {}
        # inf: no target for the class. A target also caps the class's wait timeout: a waiter that
        # has already missed it holds a client for nothing.
        self._targets = {c: float(tw.get(c, 0)) or math.inf for c in CLASS_ORDER}
        # What a granted request still waits after this queue before its engine work starts (two-stage
        # admission's decode stage, ``pdmaster.staged_admission``): part of the wait the target bounds.
        self.later_wait_s = 0.0
        self._waits = {c: min(float(self.policy.max_wait_s[c]), self._targets[c]) for c in CLASS_ORDER}
        # nodes
        self._shares: dict[str, int] = {}
        self._full: dict[str, int] = {}
        # How many nodes have each share / full capacity: their maxima in O(distinct values).
        self._share_counts: dict[int, int] = {}
        self._full_counts: dict[int, int] = {}
        self._active: dict[str, int] = {}
        # Slots ever granted per node (only grows): what masters of the previous release counted an
        # Ack's kept_slots from (registry.kept_slots; the protocol model's earlier-release masters).
        self._granted_on: dict[str, int] = {}
        # Slots of running leases whose decode end this master may not see in time (end_unseen):
        # not counted in an Ack's kept_slots.
        self._unseen_on: dict[str, int] = {}
        # Slots whose decode request went out and that are still held and seen, per node: an Ack's
        # kept_slots counts from these (``in_decode_on``).
        self._in_decode: dict[str, int] = {}
        # Per node: Acks built so far (kept_since), and the slots in decode at the last of them that
        # still are: an Ack's kept_slots, exact whatever turned over in between.
        self._ack_gen: dict[str, int] = {}
        self._old: dict[str, int] = {}
        self._node_ver: dict[str, int] = {}
        self._ver = 0
        self._free_heap: list[tuple[int, str, int]] = []  # (-free, node, ver)
        self._capacity = 0
        self._full_total = 0  # Σ full capacity of the nodes this master holds a share on
        self._masters = 0  # live masters in the cluster (0: unknown)
        self._bound = 0
        self._budget = 0
        self._max_share = 0
        self._max_full = 0
        self._active_total = 0
        self._retries: list[Ticket] = []  # queued resubmissions, oldest first
        # queue
        self._seq = 0
        self._queues: dict[RequestClass, _ClassQueue] = {c: _ClassQueue(c) for c in CLASS_ORDER}
        self._qlist = [self._queues[c] for c in CLASS_ORDER]  # indexed like CLASS_ORDER
        self._gangs: list[tuple[int, int, Ticket]] = []  # (-slots, id, ticket) for slots > 1
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
        # Completion rate: slots released, exponentially decayed with time constant _rate_tau (a
        # count, not a list: O(1) per release and per estimate).
        self._rate_tau = float(self.policy.rate_window_s)
        self._done_sum = 0.0  # decayed slots released, as of _done_at
        self._done_at = 0.0
        self._done_first = 0.0  # when the first release was seen (for the start-up correction)
        self._done_n = 0  # releases seen
        self._handed_sum = 0.0  # the part of _done_sum that went to peers (hand_off), as of _handed_at
        self._handed_at = 0.0
        # The peers' pooled load (set_peer_load) and when it was set: while fresh, an arrival's
        # expected wait is judged over this master and those peers together.
        self._peer_load: PeerLoad | None = None
        self._peer_load_at = -math.inf
        self._changes: list[Ticket] = []
        self._now = 0.0
        self.last_changes: list[Ticket] = []
        # pause guard (watch_pauses): no placement before _hold_until
        self._resumed_at: Callable[[float], float] | None = None
        self._pause_hold_s = 0.0
        self._hold_until = -math.inf
        self._holding = False
        self.pauses = 0  # holds started (a pause seen while holding extends the hold)

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

    def active_on(self, node: str) -> int:
        return self._active.get(node, 0)

    def share_on(self, node: str) -> int:
        """The share admission may place leases against on ``node`` now."""
        return self._shares.get(node, 0)

    def granted_on(self, node: str) -> int:
        """Slots granted on ``node`` since this core started (only grows)."""
        return self._granted_on.get(node, 0)

    def sure_on(self, node: str) -> int:
        """Slots of the leases on ``node`` whose decode end this master sees as it happens: all
        running leases but those marked with :meth:`end_unseen`, sent or not (what kept_slots counted
        from before :meth:`decode_sent`; the protocol model's earlier-release masters use it)."""
        return self._active.get(node, 0) - self._unseen_on.get(node, 0)

    def in_decode_on(self, node: str) -> int:
        """Slots of the leases on ``node`` that the engine surely holds and whose end the master sees:
        their decode request went out (:meth:`decode_sent`), they are not released, and not marked
        :meth:`end_unseen`. An Ack's kept_slots counts from these."""
        return self._in_decode.get(node, 0)

    def decode_sent(self, t: Ticket) -> None:
        """The lease's decode request went out to its engine (with SGLang's protocol right after the
        grant, with vLLM's after the prefill): from now on the engine holds it. Idempotent."""
        if t.state is not _GRANTED or t.released or t.sent or t.node is None:
            return
        t.sent = True
        t.sent_gen = self._ack_gen.get(t.node, 0)
        if not t.unseen:
            self._in_decode[t.node] = self._in_decode.get(t.node, 0) + t.slots

    def kept_since(self, node: str, gen: int | None) -> tuple[int, int]:
        """For an Ack on ``node``: the slots in decode there at the previous Ack (number ``gen``) that
        still are (so never more than :meth:`in_decode_on`, nor than the active slots), and this Ack's
        number. 0 when ``gen`` is None (a stream's first Ack) or is not the
        latest (another stream's Ack came in between)."""
        latest = self._ack_gen.get(node, 0)
        kept = self._old.get(node, 0) if gen is not None and gen == latest else 0
        self._ack_gen[node] = latest + 1
        self._old[node] = self._in_decode.get(node, 0)
        return kept, latest + 1

    def _leave_decode(self, t: Ticket, node: str) -> None:
        """A sent lease stops counting as in decode (released, or its end unseen)."""
        self._in_decode[node] -= t.slots
        if t.sent_gen < self._ack_gen.get(node, 0):
            self._old[node] -= t.slots  # it was in decode at the last Ack

    def end_unseen(self, t: Ticket) -> None:
        """The master stopped reading this lease's answer (a slow client): its decode may end in the
        engine before the master can tell, so from now on it no longer counts as surely running
        there. Idempotent; it lasts until the lease is released. Places nothing, changes no grant."""
        if t.state is not _GRANTED or t.released or t.unseen or t.node is None:
            return
        t.unseen = True
        self._unseen_on[t.node] = self._unseen_on.get(t.node, 0) + t.slots
        if t.sent:
            self._leave_decode(t, t.node)

    def can_start_now(self, slots: int, session_id: str | None = None) -> bool:
        """Whether a first-time request for ``slots`` would be granted at once: a node has the room,
        nothing of its session runs or waits here, no gang holds the free slots, no pause hold. (After
        every call nothing queued fits the free slots, so it would pass no one.)"""
        if self._bypass:
            return True
        if self._holding or self._reserved or (session_id is not None and session_id in self._sessions):
            return False
        free, node = self._top_free()
        return node is not None and free >= slots

    def waits_for_room(self, slots: int, session_id: str | None = None) -> bool:
        """Whether a first-time request for ``slots`` would wait here for room alone: no node has it
        free now (or a gang holds it, or a pause hold), while nothing of its session runs or waits
        here (a request behind its own session's turn waits for that, wherever it went)."""
        if session_id is not None and session_id in self._sessions:
            return False
        return not self.can_start_now(slots)

    def free_now(self) -> int:
        """The most slots one first-time request could be granted at once (on one node; 0 while a
        gang holds the free slots or a pause hold lasts): what another master may hand this one."""
        if self._bypass or self._holding or self._reserved:
            return 0
        return self._top_free()[0]

    def has_handoffs(self) -> bool:
        """Whether a first-time request waits here as an eligible head (cheap: what decides if asking
        the peers for room is worth it)."""
        return any(q.heads_n for q in self._qlist)

    def handoffs(self, max_slots: int, limit: int) -> list[Ticket]:
        """Up to ``limit`` queued requests another master could start at once instead, the earliest
        deadline first (the one closest to missing its target) among each class's ``limit`` oldest:
        eligible heads of any class, each of at most ``max_slots`` slots, neither a resubmission nor
        behind its own session's turn nor part of a gang. Looks only; :meth:`hand_off` takes one out."""
        out: list[Ticket] = []
        if limit <= 0 or max_slots <= 0:
            return out
        for q in self._qlist:
            if not q.heads_n:
                continue
            n = 0
            for t in q.arrivals:
                if (
                    t.state is _QUEUED
                    and t.request_class is q.cls
                    and t._loc == _HEAD
                    and t.slots <= max_slots
                ):
                    out.append(t)
                    n += 1
                    if n >= limit:
                        break
        out.sort(key=lambda t: (t.deadline, t.id))
        return out[:limit]

    def hand_off(self, t: Ticket) -> list[Ticket]:
        """Withdraw queued ``t``: another master starts it (``HANDED_OFF``). Should that master refuse,
        the request comes back as a resubmission with ``t.deadline`` and goes first.

        Its slots count in :meth:`completion_rate` as if released: the queue drains by hand-offs as
        by this master's own completions, and an expected wait that saw only the latter would refuse
        arrivals the peers' room is about to serve."""
        self._begin()
        if t.state is _QUEUED:
            self._finish(t, _CANCELLED, HANDED_OFF)
            self._count_done(t.slots, self._now, handed=True)
            pl = self._peer_load
            if pl is not None:  # it takes the peers' room it goes to
                self._peer_load = replace(pl, free=max(0, pl.free - t.slots))
            self._pump()
        return self._end()

    def wanted_slots(self) -> int:
        """Queued demand in slots (what the master reports to agents as ``wanted_slots``)."""
        return self._queued_slots

    def forget_node(self, node: str) -> bool:
        """Drop what this core keeps for ``node`` (its Ack bookkeeping) once it holds no share and no
        lease there: the master forgot the node (its agent left for good). False, and nothing
        dropped, while it still has either. A node that comes back starts afresh."""
        if self._shares.get(node) or self._active.get(node):
            return False
        for per_node in (self._granted_on, self._unseen_on, self._in_decode, self._ack_gen, self._old):
            per_node.pop(node, None)
        return True

    def refusal(self, slots: int) -> Reason | None:
        """Why :meth:`submit` would refuse ``slots`` at once whatever the queue holds (no capacity, or
        more than any share), or None. Lets an earlier stage refuse before doing work for nothing."""
        if self._bypass:
            return None
        if slots < 1:
            return self._reason(INVALID)
        if self._capacity == 0:
            return self._reason(NO_CAPACITY)
        if slots > self._max_share:
            return self._reason(UNSATISFIABLE if slots > self._max_full else CANNOT_FIT_NOW)
        return None

    @property
    def held_until(self) -> float:
        """Nothing is placed before this time (-inf: no hold). See :meth:`watch_pauses`."""
        return self._hold_until

    def placement_held(self) -> bool:
        """Whether this process stood still less than the hold ago (:meth:`watch_pauses`): a decode
        request placed before the pause must not go out then either."""
        if self._resumed_at is None:
            return False
        now = self._clock()
        return now < self._resumed_at(now) + self._pause_hold_s

    def next_deadline(self) -> float | None:
        """When :meth:`expire` has work: the first waiter's deadline, or the end of a hold."""
        t = self._first_deadline()
        d = t.deadline if t is not None else None
        if self._holding and (d is None or self._hold_until < d):
            return self._hold_until
        return d

    def misses_target(self, c: RequestClass, lead_s: float) -> bool:
        """Whether a request of class ``c`` whose first token comes ``lead_s`` after its grant would
        miss the class's target even if granted now (never, without a target)."""
        return lead_s + self.later_wait_s > self._targets[c]

    def wait_limit(self, c: RequestClass) -> float:
        """How long a first-time waiter of class ``c`` may wait: its class timeout, capped by the
        class's target when one is set."""
        return self._waits[c]

    def completion_rate(self, now: float | None = None, *, handed: bool = True) -> float | None:
        """Slots released per second, lately; None before :data:`RATE_MIN_RELEASES` releases.

        The larger of two estimates, so that a stale one never refuses anyone: the released slots
        decayed with time constant ``rate_window_s`` (corrected for a history shorter than that), and
        Little's law on the leases running now (active slots ÷ the mean hold time), which sees the
        turnover of a fleet that has just filled up before many of its leases have ended.
        ``handed=False``: without the slots handed to peers (:meth:`hand_off`), i.e. what this master
        serves itself.
        """
        if self._done_n < RATE_MIN_RELEASES:
            return None
        if now is None:
            now = self._clock()
        tau = self._rate_tau
        span = 1.0 - math.exp(-(now - self._done_first) / tau)
        if span <= 0.0:
            return math.inf
        done = self._done_sum * math.exp(-(now - self._done_at) / tau)
        if not handed and self._handed_sum:
            done = max(0.0, done - self._handed_sum * math.exp(-(now - self._handed_at) / tau))
        rate = done / (tau * span)
        if self._hold_ewma:
            rate = max(rate, self._active_total / self._hold_ewma)
        return rate

    def load(self) -> PeerLoad:
        """This master's load for its peers' pooled expected wait (see :class:`PeerLoad`)."""
        rate = self.completion_rate(handed=False)
        return PeerLoad(
            self.free_now(),
            {q.cls: q.slots for q in self._qlist if q.slots},
            rate if rate is not None and math.isfinite(rate) else 0.0,
            self._capacity,
        )

    def _fresh_peer_load(self, now: float) -> PeerLoad | None:
        """The peers' pooled load while it counts (:data:`PEER_LOAD_TTL_S`), else None."""
        pl = self._peer_load
        return pl if pl is not None and now - self._peer_load_at <= PEER_LOAD_TTL_S else None

    def _peer_load_view(self) -> dict[str, Any] | None:
        pl = self._fresh_peer_load(self._clock())
        if pl is None:
            return None
        return {
            "free": pl.free,
            "queued_slots": sum(pl.queued.values()),
            "rate_slots_per_s": _rounded(pl.rate),
        }

    def set_peer_load(self, load: PeerLoad | None) -> None:
        """The summed load of the peers this master hands waiters to (None: none known). For
        :data:`PEER_LOAD_TTL_S` after, :meth:`expected_wait` judges an arrival over them and this master
        together, as one master over their slots would: their queues stand ahead of it as this master's
        do, their free room and the slots they serve drain this queue too (hand-offs)."""
        self._peer_load = load
        self._peer_load_at = self._clock()

    def expected_wait(self, c: RequestClass, slots: int = 1, now: float | None = None) -> float | None:
        """Seconds an arrival of class ``c`` needing ``slots`` would wait; None: no estimate yet.

        The slots served before it, as DRR would serve them: every queued slot of its own class (FIFO,
        resubmissions included), and of each other class k the share DRR gives k while the
        arrival's class gets through those and the arrival's own slots — ``(Q_c + slots) * w_k / w_c``,
        at most what k has queued (a lower class gets its share too: DRR serves it in proportion, not
        after). Plus its own slots, minus the slots free now, over :meth:`completion_rate`. Arrivals
        after it (a higher class may still pass it) and session or gang blocking are left out: the
        estimate errs towards admitting. O(1): running totals per class.

        With a fresh peer load (:meth:`set_peer_load`) the queues, the free slots and the rate are
        this master's and the peers' summed (the rate without hand-offs, which the peers serve):
        a clump that landed here is judged against the turnover of every master it can move to.
        """
        if now is None:
            now = self._clock()
        w = self._weights
        pl = self._fresh_peer_load(now)
        pq = pl.queued if pl is not None else _NO_QUEUED
        own = self._queues[c].slots + pq.get(c, 0)
        turn = own + slots
        ahead = float(own)
        for q in self._qlist:
            if q.cls is not c and (n := q.slots + pq.get(q.cls, 0)):
                ahead += min(n, turn * w[q.cls] / w[c])
        need = (
            ahead + slots - max(0, self._capacity - self._active_total) - (pl.free if pl is not None else 0)
        )
        if need <= 0:
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
        return need / rate

    def snapshot(self) -> dict[str, Any]:
        nodes = sorted(set(self._shares) | {n for n, a in self._active.items() if a})
        g = self._gang
        return {
            "bypass": self._bypass,
            "capacity": self._capacity,
            "active": self._active_total,
            # leases the master stopped reading for a slow client (end_unseen)
            "unseen_slots": sum(self._unseen_on.values()),
            "queue_bound_slots": self._bound,
            "masters": self._masters,
            "queued_requests": self._queued_n,
            "queued_slots": self._queued_slots,
            "wanted_slots": self._queued_slots,
            "sessions": len(self._sessions),
            "queued_retries": len(self._retries),
            "placement_held_s": round(max(0.0, self._hold_until - self._clock()), 3),
            "pauses": self.pauses,
            "completion_rate_slots_per_s": _rounded(self.completion_rate()),
            "peer_load": self._peer_load_view(),
            "classes": {
                c.value: {
                    "queued_requests": self._queues[c].n,
                    "queued_slots": self._queues[c].slots,
                    "eligible_heads": self._queues[c].heads_n,
                    "deficit": self._deficit[c],
                    "weight": self._weights[c],
                    "max_wait_s": self._waits[c],
                    "target_wait_s": None if self._targets[c] == math.inf else self._targets[c],
                    # what a one-slot arrival of the class would be told now (None: no estimate)
                    "expected_wait_s": _rounded(self.expected_wait(c)),
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
            "outcomes": {c.value: dict(v) for c, v in self._outcomes.items()},
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
        _check_shares(shares)
        changes = {n: int(s) for n, s in shares.items()}
        for node in self._shares:
            changes.setdefault(node, 0)
        return self._apply_shares(changes, node_capacity)

    def update_shares(
        self, changes: Mapping[str, int], node_capacity: Mapping[str, int] | None = None
    ) -> list[Ticket]:
        """Like :meth:`set_shares` for the nodes in ``changes`` only (0: the node takes no new work);
        the others keep their shares. O(len(changes)): a master hears of a thousand nodes' changes
        in small batches."""
        self._begin()
        _check_shares(changes)
        return self._apply_shares({n: int(s) for n, s in changes.items()}, node_capacity)

    def watch_pauses(self, resumed_at: Callable[[float], float], hold_s: float) -> None:
        """Place nothing for ``hold_s`` after this process was found not running for a while.

        ``resumed_at(now)`` returns when the latest such pause ended (-inf: none yet; ``now`` while
        one is still being noticed). Every call checks it before it decides, so a placement made by
        the first callback that runs after a pause is held too. Waiters keep their deadlines; when
        the hold ends, :meth:`next_deadline` says so and :meth:`expire` places what fits. No effect
        in bypass mode (nothing is limited there).
        """
        if not hold_s >= 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s!r}")
        if self._bypass:
            return
        self._resumed_at = resumed_at
        self._pause_hold_s = float(hold_s)

    def set_masters(self, masters: int) -> None:
        """How many masters share the fleet (0: unknown). See :meth:`_queue_bound`."""
        if masters < 0:
            raise ValueError(f"masters must be >= 0, got {masters!r}")
        self._masters = int(masters)
        # A smaller bound refuses new arrivals; what is queued stays (it was accepted).
        self._bound = self._queue_bound()

    def _queue_bound(self) -> int:
        """``queue_waves`` times the larger of the capacity held and this master's even part of it.

        Under a demand split the share a master holds follows the demand it reports (running +
        queued). A bound on the share alone would close that loop: a master whose share fell could
        queue only about what it holds, refuse the rest and so never report the demand that would
        win its share back. Its even part (the full capacity of its nodes ÷ the live masters) keeps
        the queue as long as a static split would, whatever the demand split holds right now.
        """
        held = self._capacity
        even = self._full_total // self._masters if self._masters else 0
        return math.floor(self.policy.queue_waves * max(held, even) + 1e-9)

    def _pooled_bound(self) -> int:
        """The queue bound for a first-time arrival: with a fresh peer load (:meth:`set_peer_load`),
        ``queue_waves`` over the slots of this master and those peers together, less what the peers
        queue, as one master over them would bound its queue; never below this master's own bound."""
        if self._peer_load is None:  # no peers (spilling off): no call on a queued arrival's path
            return self._bound
        pl = self._fresh_peer_load(self._now)
        if pl is None or not pl.capacity:
            return self._bound
        pooled = math.floor(self.policy.queue_waves * (self._capacity + pl.capacity) + 1e-9)
        return max(self._bound, pooled - sum(pl.queued.values()))

    def _apply_shares(
        self, changes: Mapping[str, int], node_capacity: Mapping[str, int] | None
    ) -> list[Ticket]:
        moved = False
        for node, s in changes.items():
            old_full = self._full.pop(node, None)
            if old_full is not None:
                _uncount(self._full_counts, old_full)
                self._full_total -= old_full
            if s > 0:
                full = max(int(node_capacity.get(node, s)) if node_capacity else s, s)
                self._full[node] = full
                self._full_counts[full] = self._full_counts.get(full, 0) + 1
                self._full_total += full
            old = self._shares.get(node, 0)
            if old == s:
                continue
            moved = True
            self._shares.pop(node, None)
            if old:
                _uncount(self._share_counts, old)
            if s > 0:
                self._shares[node] = s
                self._share_counts[s] = self._share_counts.get(s, 0) + 1
            self._capacity += s - old
            self._touch_node(node)
        self._max_full = max(self._full_counts, default=0)
        if not moved:
            return self._end()
        self._bound = self._queue_bound()
        self._budget = math.floor(self.policy.backfill_waves * self._capacity + 1e-9)
        self._max_share = max(self._share_counts, default=0)
        if not self._bypass and self._queued_n:
            if self._capacity == 0:
                for c in reversed(CLASS_ORDER):
                    q = self._queues[c]
                    while (t := q.newest()) is not None:
                        self._finish(t, _REJECTED, NO_CAPACITY)
            else:
                h = self._gangs
                while h:
                    t = h[0][2]
                    if t.state is not _QUEUED:
                        heapq.heappop(h)
                    elif t.slots > self._max_share:
                        heapq.heappop(h)
                        code = UNSATISFIABLE if t.slots > self._max_full else CANNOT_FIT_NOW
                        self._finish(t, _REJECTED, code)
                    else:
                        break
                self._trim(self._bound)
        self._pump()
        return self._end()

    def submit(
        self,
        slots: int = 1,
        request_class: RequestClass = RequestClass.COLD,
        session_id: str | None = None,
        *,
        avoid: frozenset[str] = _NO_AVOID,
        deadline: float | None = None,
        lead_s: float = 0.0,
        at_once: bool = False,
    ) -> Ticket:
        """Ask for ``slots`` slots on one node. The ticket comes back granted, queued or rejected.

        ``at_once``: granted now or refused now (``expected_wait``), never queued: a request another
        master spilled here (pdmaster/spill.py) takes only room this master has now, and never waits
        ahead of or beside this master's own clients.

        ``lead_s``: what the request will still wait after its grant before its first token; added
        to its expected wait where that is checked against its class's target (0: a pure wait target),
        and taken off the wait it may queue for (at least ``MIN_TARGET_WAIT_S``).

        A request retried after an engine failed it is *resubmitted*: ``avoid`` names the nodes it
        is never placed on, ``deadline`` (the clock's time base) the absolute deadline it keeps from
        its first admission (already past: it is granted only if a node has room now, else it times
        out at once; absent: the class's wait from now). Either one makes the ticket a resubmission:
        it goes before every first-time waiter, is not charged to its class again and is not
        serialised behind its session again (it had the session's turn; ``session_id`` is ignored).
        """
        self._begin()
        now = self._now
        self._seq += 1
        n = int(slots)
        rc = request_class if type(request_class) is RequestClass else RequestClass(request_class)
        resubmit = bool(avoid) or deadline is not None
        t = Ticket(self._seq, n, rc, None if resubmit else session_id, now)
        if avoid:
            t.avoid = avoid
        if n < 1 or n != slots:
            return self._refuse(t, INVALID)
        if self._bypass:
            _, node = self._free_for(t)
            if node is None:
                _, node = self._top_free()  # no limit to keep: somewhere rather than nowhere
            self._grant_new(t, node)
            self._end()
            return t
        if self._capacity == 0:
            return self._refuse(t, NO_CAPACITY)
        if slots > self._max_share:
            return self._refuse(t, UNSATISFIABLE if slots > self._max_full else CANNOT_FIT_NOW)
        if resubmit:
            return self._resubmit(t, now + self._waits[rc] if deadline is None else deadline)
        s = self._sessions.get(session_id) if session_id is not None else None
        if at_once:
            if not self.can_start_now(t.slots, session_id):
                return self._refuse(t, EXPECTED_WAIT, self._retry_hint(0.0))
            self._grant_new(t, self._top_free()[1])
            self._end()
            return t
        target = self._targets[rc]
        if target != math.inf and (wait := self._over_target(t, s, target, lead_s)) is not None:
            return self._refuse(t, EXPECTED_WAIT, self._retry_hint(wait))
        overflow = self._queued_slots + t.slots - self._pooled_bound()
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
            lower = self._qlist[_RANK[t.request_class] + 1 :]
            if sum(q.slots for q in lower) < overflow:  # replacement is all-or-nothing
                return self._refuse(t, QUEUE_FULL)
            for q in reversed(lower):
                while overflow > 0 and (v := q.newest()) is not None:
                    overflow -= v.slots
                    self._finish(v, _EVICTED, EVICTED)
            s = self._sessions.get(session_id) if session_id is not None else None
        self._enqueue(t, s, now, lead_s)
        self._pump()
        self._end()
        return t

    def _over_target(self, t: Ticket, s: _Session | None, target: float, lead_s: float) -> float | None:
        """The arrival's expected wait (plus ``lead_s``) when that exceeds ``target`` and it could not
        run right now."""
        if s is None and not self._reserved:
            free, node = self._top_free()
            if node is not None and free >= t.slots:
                # After every call nothing queued fits the free slots (or a gang is being backfilled),
                # so this arrival runs at once: never refuse it.
                return None
        wait = self.expected_wait(t.request_class, t.slots, self._now)
        if wait is not None:
            wait += self.later_wait_s + lead_s
        return wait if wait is not None and wait > target else None

    def _retry_hint(self, wait: float) -> Reason:
        p = self.policy
        return Reason(EXPECTED_WAIT, min(p.retry_after_max_s, max(p.retry_after_min_s, wait)))

    def _resubmit(self, t: Ticket, deadline: float) -> Ticket:
        t.deadline = deadline  # kept even when granted at once, so a further retry carries it on
        free, node = self._free_for(t)
        if node is not None and free >= t.slots:
            # The queue is stable (no resubmission fits anywhere it may go), so nothing is overtaken.
            self._place(t, node, t.enqueued_at)
            self._end()
            return t
        if deadline <= self._now:
            self._refuse(t, TIMEOUT)
            t.state = _EXPIRED
            return t
        overflow = self._queued_slots + t.slots - self._bound
        if overflow > 0:
            # It goes before the first-time waiters of its class, so it may displace them like a
            # higher class would: newest first, lowest class first, all-or-nothing.
            same_or_lower = self._qlist[_RANK[t.request_class] :]
            if sum(q.slots for q in same_or_lower) < overflow:
                return self._refuse(t, QUEUE_FULL)
            for q in reversed(same_or_lower):
                while overflow > 0 and (v := q.newest()) is not None:
                    overflow -= v.slots
                    self._finish(v, _EVICTED, EVICTED)
        q = self._queues[t.request_class]
        q.n += 1
        q.slots += t.slots
        q.add_moved(t)  # its deadline is out of arrival order
        self._queued_n += 1
        self._queued_slots += t.slots
        if t.slots > 1:
            self._gang_n += 1
            self._push_gang(t)
        t._loc = _RETRY
        self._retries.append(t)
        self._pump()  # an eviction may have ended a reservation
        self._end()
        return t

    def _count_done(self, slots: int, now: float, handed: bool = False) -> None:
        """``slots`` left for good: the completion rate's decayed sum (``handed``: to a peer)."""
        if handed:
            tau = self._rate_tau
            self._handed_sum = self._handed_sum * math.exp(-(now - self._handed_at) / tau) + slots
            self._handed_at = now
        if self._done_n:
            self._done_sum = self._done_sum * math.exp(-(now - self._done_at) / self._rate_tau) + slots
        else:
            self._done_sum = slots
            self._done_first = now
        self._done_at = now
        self._done_n += 1

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
        self._count_done(t.slots, now)
        node = t.node
        if node is not None:
            self._active[node] -= t.slots
            if t.unseen:
                self._unseen_on[node] -= t.slots
            elif t.sent:
                self._leave_decode(t, node)
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
        # earliest deadline first across the classes, so ``last_changes`` lists them in that order
        while (t := self._first_deadline()) is not None and t.deadline <= now:
            self._finish(t, _EXPIRED, TIMEOUT)
        if self._holding and now >= self._hold_until:
            self._holding = False
            self._pump()
        elif self._changes:
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

    # ------------------------------------------------------------------ internals: bookkeeping

    def _begin(self) -> None:
        self._changes = []
        now = self._now = self._clock()  # one clock read per call: grants and ends share a timestamp
        if self._resumed_at is not None:
            until = self._resumed_at(now) + self._pause_hold_s
            if until > self._hold_until:
                if not self._holding or now >= self._hold_until:
                    self.pauses += 1
                self._hold_until = until
                self._holding = True

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
        return Reason(code, retry)

    def _refuse(self, t: Ticket, code: str, reason: Reason | None = None) -> Ticket:
        t.state = _REJECTED
        t.reason = reason or self._reason(code)
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
            self._free_heap = [e for e in self._free_heap if nv.get(e[1]) == e[2]]
            heapq.heapify(self._free_heap)

    def _top_free(self) -> tuple[int, str | None]:
        if self._now < self._hold_until:
            return 0, None
        h = self._free_heap
        nv = self._node_ver
        while h:
            e = h[0]
            if nv.get(e[1]) == e[2]:
                return -e[0], e[1]
            heapq.heappop(h)
        return 0, None

    def _top_free_avoiding(self, avoid: frozenset[str]) -> tuple[int, str | None]:
        """The node with the most free slots outside ``avoid``: pops at most ``len(avoid)`` live
        entries (put back after), so the cost does not grow with the number of nodes."""
        if self._now < self._hold_until:
            return 0, None
        h = self._free_heap
        nv = self._node_ver
        skipped: list[tuple[int, str, int]] = []
        best: tuple[int, str | None] = (0, None)
        while h:
            e = h[0]
            if nv.get(e[1]) != e[2]:
                heapq.heappop(h)
            elif e[1] in avoid:
                skipped.append(heapq.heappop(h))
            else:
                best = (-e[0], e[1])
                break
        for e in skipped:
            heapq.heappush(h, e)
        return best

    def _free_for(self, t: Ticket) -> tuple[int, str | None]:
        return self._top_free_avoiding(t.avoid) if t.avoid else self._top_free()

    def _enqueue(self, t: Ticket, s: _Session | None, now: float, lead_s: float = 0.0) -> None:
        c = t.request_class
        q = self._queues[c]
        wait = self._waits[c]
        if lead_s > 0.0 and self._targets[c] != math.inf:
            # A time-to-first-token target: once the wait has used what the prefill leaves of it,
            # the request would miss it when served, and its slot is better spent on another.
            wait = min(wait, max(MIN_TARGET_WAIT_S, self._targets[c] - lead_s))
        t.deadline = now + wait
        self._queued_n += 1
        self._queued_slots += t.slots
        q.add(t)
        if t.slots > 1:
            self._gang_n += 1
            self._push_gang(t)
        if t.session_id is None:
            q.push_head(t)
            return
        if s is None:
            s = self._sessions[t.session_id] = _Session()
        blocked = s.active is not None or s.live > 0
        s.queue.append(t)
        s.live += 1
        if blocked:
            t._loc = _WAIT
        else:
            q.push_head(t)

    def _push_gang(self, t: Ticket) -> None:
        heapq.heappush(self._gangs, (-t.slots, t.id, t))
        if len(self._gangs) > 2 * self._gang_n + 64:
            self._gangs = [e for e in self._gangs if e[2].state is _QUEUED]
            heapq.heapify(self._gangs)

    def _refresh_session(self, sid: str, s: _Session) -> None:
        q = s.queue
        while q and q[0].state is not _QUEUED:
            q.popleft()
        if not q:
            if s.active is None:
                del self._sessions[sid]
        elif s.active is None and q[0]._loc == _WAIT:
            self._queues[q[0].request_class].push_head(q[0])

    def _clear_gang(self) -> None:
        self._gang = None
        self._bf_used = 0
        self._reserved = False

    def _dequeue(self, t: Ticket) -> None:
        """Queue bookkeeping for a ticket that leaves the queue (granted or not); its state is set."""
        self._queues[t.request_class].remove(t)
        self._queued_n -= 1
        self._queued_slots -= t.slots
        if t.slots > 1:
            self._gang_n -= 1
        loc = t._loc
        t._loc = _NOWHERE
        if loc == _HEAD:
            self._queues[t.request_class].drop_head(t)
        elif loc == _GANG:
            self._clear_gang()
        elif loc == _RETRY:
            self._retries.remove(t)  # a short list: resubmissions are few
        sid = t.session_id
        if sid is not None:
            s = self._sessions[sid]
            s.live -= 1
            if t.state is _GRANTED:
                s.active = t
            self._refresh_session(sid, s)

    def _finish(self, t: Ticket, state: TicketState, code: str) -> None:
        """A queued ticket ends without a grant."""
        t.state = state
        t.reason = self._reason(code)
        t.ended_at = self._now
        self._dequeue(t)
        self._outcomes[t.request_class][code] += 1
        self._changes.append(t)

    def _place(self, t: Ticket, node: str | None, now: float) -> None:
        t.state = _GRANTED
        t.node = node
        t.granted_at = now
        if node is not None:
            self._active[node] = self._active.get(node, 0) + t.slots
            self._granted_on[node] = self._granted_on.get(node, 0) + t.slots
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
        """Grant a queued ticket (the head ``_pick`` chose, or the blocked gang)."""
        t.state = _GRANTED
        self._dequeue(t)
        self._place(t, node, self._now)

    def _first_deadline(self) -> Ticket | None:
        # The adapter asks after every call, so the common case is inlined: the front of each class's
        # arrivals is live (grants trim it) and nothing was promoted.
        best: Ticket | None = None
        for q in self._qlist:
            if q.moved_by_deadline:
                t = q.first_deadline()
            else:
                a = q.arrivals
                c = q.cls
                while a and (a[0].state is not _QUEUED or a[0].request_class is not c):
                    a.popleft()
                t = a[0] if a else None
            if t is not None and (
                best is None or t.deadline < best.deadline or (t.deadline == best.deadline and t.id < best.id)
            ):
                best = t
        return best

    def _trim(self, bound: int) -> None:
        for q in reversed(self._qlist):
            while self._queued_slots > bound and (t := q.newest()) is not None:
                self._finish(t, _EVICTED, EVICTED)

    def _reclass(self, t: Ticket, c: RequestClass) -> None:
        old = self._queues[t.request_class]
        new = self._queues[c]
        t.request_class = c
        old.remove(t)
        t.deadline = max(t.deadline, t.enqueued_at + self._waits[c])
        new.n += 1
        new.slots += t.slots
        new.add_moved(t)
        if t._loc == _HEAD:
            old.drop_head(t)
            new.push_head(t)

    # ------------------------------------------------------------------ internals: scheduling

    def _pick(self, limit: int | None) -> tuple[Ticket, bool] | None:
        """DRR over classes with an eligible head costing at most ``limit``; returns (head, lone)."""
        heads: list[Ticket | None] = [None, None, None]
        n = 0
        n_any = 0
        only = 0
        g = self._gang
        for i, q in enumerate(self._qlist):
            if not q.heads_n:
                if g is None or g.request_class is not q.cls:
                    self._deficit[q.cls] = 0.0  # nothing eligible: no credit hoarding
                continue
            n_any += 1
            h = q.peek_head(limit)
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

    def _grant_retry(self) -> bool:
        """Grant the oldest queued resubmission that has room on a node it does not avoid."""
        for t in self._retries:
            free, node = self._free_for(t)
            if node is not None and free >= t.slots:
                self._grant(t, node)  # not charged: it paid for its turn when first granted
                return True
        return False

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
            if self._retries and self._grant_retry():
                continue
            g = self._gang
            if g is not None:
                if g.slots <= free:
                    self._charge(g.request_class, g.slots, False)
                    self._grant(g, node)  # clears the backfill state
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
                self._queues[t.request_class].take_head(t)
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
            self._queues[t.request_class].take_head(t)
            if t.slots <= free:
                self._charge(t.request_class, t.slots, lone)
                self._grant(t, node)
                continue
            # DRR chose a gang that does not fit: later requests may backfill, within a budget.
            t._loc = _GANG
            self._gang = t
            self._bf_used = 0
            self._reserved = self._budget <= 0
