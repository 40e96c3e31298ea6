"""Ordering inside one request class: FIFO queues, sessions and eligible heads (DESIGN §6).

Fairness *between* classes is :mod:`pdmaster.drr`'s business; this module only keeps each class's
waiters in order so that the oldest eligible one is found without a scan:

* one :class:`ClassQueue` per class owns every queued ticket of that class: its counters, a deque in
  arrival order (ticket ids only grow and each class has one fixed timeout, so the deque is sorted
  both by age and by deadline: timeouts pop from its left, evictions take the newest from its right),
  and small side heaps for the tickets that joined the class later by promotion;
* per class and slot count, the *eligible heads* (:class:`Heads`): requests without a session, or the
  oldest queued request of a session that holds no lease. Those that are eligible on arrival go to a
  FIFO deque; those that become eligible later (a session's next request, a promoted one) to a side
  heap by arrival order. Bucketing by slot count lets backfill find "the oldest that fits" in O(sizes);
* a :class:`Session` keeps one session's queued requests in arrival order and its one lease.

Tickets are removed lazily: an entry whose ticket has moved on is dropped when it surfaces, and a
structure that grows beyond twice its live size is compacted, so memory stays bounded.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque

from pdmaster.ticket import LOC_HEAD, LOC_NOWHERE, RequestClass, Ticket, TicketState

__all__ = ["MEMO_ALL", "ClassQueue", "Heads", "Session"]

_QUEUED = TicketState.QUEUED  # module constant: enum attribute access is slow in the hot path
_HEAD = LOC_HEAD
_NOWHERE = LOC_NOWHERE
MEMO_ALL = 1 << 30  # ClassQueue.memo_k when the remembered answer is over every size


class Session:
    """One session's queued requests (strictly serial, FIFO) and the lease it holds, if any."""

    __slots__ = ("active", "live", "queue")

    def __init__(self) -> None:
        self.active: Ticket | None = None
        self.queue: deque[Ticket] = deque()  # arrival order; dead entries are dropped lazily
        self.live = 0


def _live(t: Ticket, c: RequestClass) -> bool:
    """``t`` is still queued in class ``c`` (for lazily deleted entries)."""
    return t.state is _QUEUED and t.request_class is c


class Heads:
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


class ClassQueue:
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
        "memo",
        "memo_k",
        "moved_by_deadline",
        "moved_newest",
        "n",
        "sizes",
        "slots",
        "tokens",
    )

    def __init__(self, cls: RequestClass) -> None:
        self.cls = cls
        self.n = 0  # queued tickets
        self.slots = 0  # their slots
        self.tokens = 0  # their KV tokens
        self.arrivals: deque[Ticket] = deque()
        self.moved_by_deadline: list[tuple[float, int, Ticket]] = []
        self.moved_newest: list[tuple[int, Ticket]] = []  # (-id, ticket)
        self.heads: dict[int, Heads] = {}  # slot count -> eligible heads of that size
        self.sizes: list[int] = []  # sorted slot counts with at least one live head
        self.heads_n = 0
        # peek_head's last answer, for the smallest ``memo_k`` sizes (MEMO_ALL: every size; -1: none);
        # a change of the heads that could change it forgets it (a head joining behind a live one of
        # its size cannot). DRR asks again and again while nothing changes (a blocked gang's backfill).
        self.memo_k = -1
        self.memo: Ticket | None = None

    # --- membership

    def add(self, t: Ticket) -> None:
        self.n += 1
        self.slots += t.slots
        self.tokens += t.tokens
        a = self.arrivals
        if a and a[-1].deadline > t.deadline:  # only a clock that went back gets here
            self.add_moved(t)
        else:
            a.append(t)

    def count(self, t: Ticket) -> None:
        """``t`` joins the class out of arrival order (promotion, resubmission): count it, then
        :meth:`add_moved`."""
        self.n += 1
        self.slots += t.slots
        self.tokens += t.tokens

    def add_moved(self, t: Ticket) -> None:
        """``t`` joins out of arrival order (promotion): it goes to the side heaps."""
        heapq.heappush(self.moved_by_deadline, (t.deadline, t.id, t))
        heapq.heappush(self.moved_newest, (-t.id, t))

    def remove(self, t: Ticket) -> None:
        """``t`` left the class (its state or class already changed); its entries go lazily."""
        self.n -= 1
        self.slots -= t.slots
        self.tokens -= t.tokens
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
            h = self.heads[n] = Heads(self.cls)
        if not h.n:
            bisect.insort(self.sizes, n)
            self.memo_k = -1
            h.push(t)
            return
        f = h.fifo
        if f and not h.dead and f[-1].id < t.id:
            # Heads.push, inlined: behind a live head of its size (no dead entries: the back of
            # ``fifo`` is one) it is nobody's oldest, so peek_head's last answer stands.
            h.n += 1
            f.append(t)
            return
        self.memo_k = -1
        h.push(t)

    def take_head(self, t: Ticket) -> None:
        """Take ``t``, which ``peek_head`` just returned, off the eligible heads."""
        self.heads_n -= 1
        self.memo_k = -1
        t._loc = _NOWHERE
        h = self.heads[t.slots]
        h.pop(t)
        if not h.n:
            self.sizes.remove(t.slots)

    def drop_head(self, t: Ticket) -> None:
        """``t`` stops being a head where it is (it ended, or moved to another class)."""
        self.heads_n -= 1
        self.memo_k = -1
        h = self.heads[t.slots]
        h.drop()
        if not h.n:
            self.sizes.remove(t.slots)

    def peek_head(self, limit: int | None) -> Ticket | None:
        """The oldest eligible head needing at most ``limit`` slots."""
        sizes = self.sizes
        if not sizes:
            return None
        k = MEMO_ALL if limit is None or sizes[-1] <= limit else bisect.bisect_right(sizes, limit)
        if k == self.memo_k:
            return self.memo
        best: Ticket | None = None
        heads = self.heads
        for i in range(len(sizes) if k == MEMO_ALL else k):
            t = heads[sizes[i]].peek()
            if best is None or t.id < best.id:
                best = t
        self.memo_k = k
        self.memo = best
        return best
