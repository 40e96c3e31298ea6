"""Gang backfill and reservation (DESIGN §6), and the queued gangs a shrink may fail.

When the request DRR picked is a gang that is eligible but does not fit, later requests that do fit
may run ahead ("backfill"), charged to a budget of one decode wave of slots; when the budget is spent
the gang gets a reservation: nothing more bypasses it and freed slots wait for it (this may idle
slots on purpose: the price of never starving big n). Granting, cancelling, timing out, evicting or
shrinking the gang away clears that state.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from pdmaster.ticket import Ticket, TicketState

__all__ = ["Backfill", "SizeHeap"]

_QUEUED = TicketState.QUEUED


class Backfill:
    """The blocked gang, if any, the backfill budget it grants the others, and its reservation."""

    __slots__ = (
        "budget",
        "cand_miss",
        "cand_miss_ver",
        "cand_seen",
        "gang",
        "gang_miss",
        "gang_seen",
        "reserved",
        "used",
    )

    def __init__(self) -> None:
        self.gang: Ticket | None = None
        self.used = 0  # slots backfilled past the gang so far
        self.reserved = False  # nothing more bypasses the gang
        self.budget = 0  # slots that may backfill past a gang (backfill_waves x capacity)
        # The placement version at which the gang, and the backfill candidate DRR chose (its ticket
        # id) at which, last found no node: until the placement changes, asking again would find none
        # again (pdmaster.placement: only with pools, where a look costs more).
        self.gang_miss = -1
        self.cand_miss = 0
        self.cand_miss_ver = -1
        # The placement's raise count at which the gang, and the candidate ``cand_miss``, was known
        # to fit no node at all (-1: not known): until a node whose room grew since has it, asking
        # again finds none (Placement.still_none).
        self.gang_seen = -1
        self.cand_seen = -1

    def block(self, t: Ticket) -> None:
        """``t``, picked by DRR, does not fit: later requests may backfill within the budget."""
        self.gang = t
        self.used = 0
        self.reserved = self.budget <= 0
        self.gang_miss = -1
        self.gang_seen = -1

    def remaining(self) -> int:
        return self.budget - self.used

    def spend(self, slots: int) -> None:
        """``slots`` ran past the gang; a spent budget reserves the free slots for it."""
        self.used += slots
        if self.used >= self.budget:
            self.reserved = True

    def clear(self) -> None:
        self.gang = None
        self.used = 0
        self.reserved = False
        self.gang_miss = -1
        self.gang_seen = -1


class SizeHeap:
    """Queued tickets by a size (largest first), so a shrink fails exactly those that no longer fit.

    Entries are dropped lazily (a ticket that left the queue goes when it surfaces); ``n`` counts the
    live ones (the owner keeps it) and the heap is compacted when it grows past twice that.
    """

    __slots__ = ("heap", "n")

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, Ticket]] = []  # (-size, id, ticket)
        self.n = 0

    def push(self, size: int, t: Ticket) -> None:
        self.n += 1
        heapq.heappush(self.heap, (-size, t.id, t))
        if len(self.heap) > 2 * self.n + 64:
            self.compact()

    def compact(self) -> None:
        """Drop the entries of tickets that left the queue."""
        self.heap = [e for e in self.heap if e[2].state is _QUEUED]
        heapq.heapify(self.heap)

    def over(self, limit: float) -> Iterator[Ticket]:
        """Pop and yield the queued tickets larger than ``limit``, largest first. The caller takes
        each one out of the queue before asking for the next."""
        h = self.heap
        while h:
            e = h[0]
            t = e[2]
            if t.state is not _QUEUED:
                heapq.heappop(h)
            elif -e[0] > limit:
                heapq.heappop(h)
                yield t
            else:
                return
