"""Gang backfill state and the queued tickets by size."""

from __future__ import annotations

from pdmaster.backfill import Backfill, SizeHeap
from pdmaster.ticket import CLASS_ORDER, Ticket, TicketState


def test_budget_spent_reserves_and_clear_resets() -> None:
    bf = Backfill()
    bf.budget = 3
    g = Ticket(1, 8, CLASS_ORDER[0], None, 0.0)
    bf.block(g)
    assert bf.gang is g and not bf.reserved and bf.remaining() == 3
    bf.spend(2)
    assert not bf.reserved
    bf.spend(1)
    assert bf.reserved
    bf.clear()
    assert bf.gang is None and bf.used == 0 and not bf.reserved
    bf.budget = 0
    bf.block(g)
    assert bf.reserved  # no budget: reserved at once


def test_size_heap_yields_the_queued_ones_over_a_limit_largest_first() -> None:
    h = SizeHeap()
    ts = [Ticket(i, n, CLASS_ORDER[0], None, 0.0) for i, n in enumerate((2, 8, 4, 6))]
    for t in ts:
        h.push(t.slots, t)
    ts[3].state = TicketState.CANCELLED
    h.n -= 1
    assert [t.slots for t in h.over(3)] == [8, 4]
    assert [t.slots for t in h.over(1)] == [2]
