"""Deficit round robin between the request classes, charged in slots."""

from __future__ import annotations

from pdmaster.admission_queue import ClassQueue
from pdmaster.drr import DeficitRoundRobin
from pdmaster.ticket import CLASS_ORDER, RequestClass, Ticket


def _queues(counts: dict[RequestClass, int]) -> list[ClassQueue]:
    qs = [ClassQueue(c) for c in CLASS_ORDER]
    tid = 0
    for q in qs:
        for _ in range(counts.get(q.cls, 0)):
            tid += 1
            t = Ticket(tid, 1, q.cls, None, 0.0)
            t.deadline = 1.0
            q.add(t)
            q.push_head(t)
    return qs


def test_weights_8_3_1_serve_8_then_3_then_1() -> None:
    C, P, K = CLASS_ORDER
    qs = _queues({C: 8, P: 3, K: 1})
    drr = DeficitRoundRobin({C: 8, P: 3, K: 1})
    served: list[RequestClass] = []
    while (pick := drr.pick(qs, None, None)) is not None:
        t, lone = pick
        qs[CLASS_ORDER.index(t.request_class)].take_head(t)
        drr.charge(t.request_class, t.slots, lone)
        served.append(t.request_class)
    assert served == [C] * 8 + [P] * 3 + [K]


def test_a_class_with_nothing_eligible_loses_its_credit_unless_kept() -> None:
    C, P, K = CLASS_ORDER
    drr = DeficitRoundRobin({C: 8, P: 3, K: 1})
    drr.deficit[P] = 5.0
    drr.deficit[K] = 2.0
    qs = _queues({C: 1})
    pick = drr.pick(qs, None, K)
    assert pick is not None and pick[1]  # the lone class is served at once
    assert drr.deficit[P] == 0.0 and drr.deficit[K] == 2.0


def test_limit_filters_heads_by_slots() -> None:
    qs = [ClassQueue(c) for c in CLASS_ORDER]
    t = Ticket(1, 4, CLASS_ORDER[0], None, 0.0)
    qs[0].add(t)
    qs[0].push_head(t)
    drr = DeficitRoundRobin(dict.fromkeys(CLASS_ORDER, 1.0))
    assert drr.pick(qs, 3, None) is None
    assert drr.pick(qs, 4, None) == (t, True)
