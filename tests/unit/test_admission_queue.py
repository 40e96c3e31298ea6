"""Ordering inside a class: arrivals, eligible heads by size, newest for eviction."""

from __future__ import annotations

from pdmaster.admission_queue import ClassQueue
from pdmaster.ticket import CLASS_ORDER, LOC_NOWHERE, Ticket, TicketState


def _t(tid: int, slots: int = 1, deadline: float = 1.0) -> Ticket:
    t = Ticket(tid, slots, CLASS_ORDER[2], None, 0.0)
    t.deadline = deadline
    return t


def test_heads_oldest_first_within_a_slot_limit() -> None:
    q = ClassQueue(CLASS_ORDER[2])
    a, b, c = _t(1, 4), _t(2, 1), _t(3, 1)
    for t in (a, b, c):
        q.add(t)
        q.push_head(t)
    assert q.peek_head(None) is a
    assert q.peek_head(3) is b
    q.take_head(b)
    assert q.peek_head(3) is c and q.heads_n == 2


def test_a_late_head_goes_before_younger_ones() -> None:
    q = ClassQueue(CLASS_ORDER[2])
    old, young = _t(1), _t(2)
    q.add(old)
    q.add(young)
    q.push_head(young)
    q.push_head(old)  # eligible later (its session's turn came)
    assert q.peek_head(None) is old


def test_first_deadline_and_newest_skip_tickets_that_left() -> None:
    q = ClassQueue(CLASS_ORDER[2])
    ts = [_t(i, 1, float(i)) for i in range(1, 4)]
    for t in ts:
        q.add(t)
    ts[0].state = TicketState.CANCELLED
    q.remove(ts[0])
    ts[2].state = TicketState.EVICTED
    q.remove(ts[2])
    assert q.first_deadline() is ts[1] and q.newest() is ts[1]
    assert q.n == 1 and q.slots == 1


def test_peek_head_after_heads_join_behind_or_ahead() -> None:
    q = ClassQueue(CLASS_ORDER[2])
    ts = [_t(i, 1 + (i % 2) * 3) for i in range(1, 9)]  # sizes 4, 1, 4, 1, ...
    for t in ts[:4]:
        q.add(t)
        q.push_head(t)
    assert q.peek_head(None) is ts[0] and q.peek_head(2) is ts[1]
    q.add(ts[4])
    q.push_head(ts[4])  # newer than a live head of its size: the answers stand
    assert q.peek_head(None) is ts[0] and q.peek_head(2) is ts[1]
    q.take_head(ts[0])
    q.take_head(ts[2])
    q.add(ts[5])
    q.push_head(ts[5])
    assert q.peek_head(None) is ts[1]
    q.remove(ts[1])
    ts[1].state = TicketState.CANCELLED
    ts[1]._loc = LOC_NOWHERE
    q.drop_head(ts[1])  # ended in place: a dead entry until it surfaces
    q.add(ts[7])
    q.push_head(ts[7])  # behind a dead entry: asked again
    assert q.peek_head(None) is ts[3] and q.peek_head(2) is ts[3]
    late = _t(0)  # older than every head (its session's turn came)
    q.add(late)
    q.push_head(late)
    assert q.peek_head(None) is late and q.peek_head(2) is late
