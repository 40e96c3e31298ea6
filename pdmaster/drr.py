"""Fairness between request classes: deficit round robin, charged in slots (DESIGN §6).

Which waiter of a class comes first is the class queue's business (:mod:`pdmaster.admission_queue`);
this policy only chooses the class. Quanta are the class weights (default 8:3:1). A class with
nothing eligible gets its deficit reset (no credit hoarding); a lone eligible class is served
without waiting for credit (never leave slots idle). Capacity 1 with 8 CONTINUATION + 3 PROBABLE +
1 COLD queued grants exactly 8, then 3, then 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from pdmaster.admission_queue import MEMO_ALL, ClassQueue
from pdmaster.ticket import CLASS_ORDER, RequestClass, Ticket

__all__ = ["DeficitRoundRobin"]


class DeficitRoundRobin:
    """DRR state over :data:`CLASS_ORDER`: a deficit per class, the class whose turn it is, and
    whether that turn already got its quantum."""

    __slots__ = ("cur", "deficit", "started", "weights")

    def __init__(self, weights: Mapping[RequestClass, float]) -> None:
        self.weights = {c: float(weights[c]) for c in CLASS_ORDER}
        self.deficit: dict[RequestClass, float] = dict.fromkeys(CLASS_ORDER, 0.0)
        self.cur = 0  # index into CLASS_ORDER
        self.started = False

    def pick(
        self, queues: Sequence[ClassQueue], limit: int | None, keep: RequestClass | None
    ) -> tuple[Ticket, bool] | None:
        """The head DRR serves next among the classes' eligible heads costing at most ``limit`` slots
        (None: any), and whether its class was the only one with anything eligible (``lone``).
        ``queues`` is indexed like CLASS_ORDER; ``keep``: a class whose deficit is kept even with
        nothing eligible (the blocked gang's: it waits for its turn's credit)."""
        heads: list[Ticket | None] = [None, None, None]
        n = 0
        n_any = 0
        only = 0
        d = self.deficit
        i = -1
        for q in queues:
            i += 1
            if not q.heads_n:
                if keep is not q.cls:
                    d[q.cls] = 0.0  # nothing eligible: no credit hoarding
                continue
            n_any += 1
            # ClassQueue.peek_head's remembered answer, without the call when it stands
            if q.memo_k == MEMO_ALL and (limit is None or q.sizes[-1] <= limit):
                h = q.memo
            else:
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
        w = self.weights
        visits = 0
        while True:
            i = self.cur
            c = CLASS_ORDER[i]
            h = heads[i]
            if h is not None:
                if not self.started:
                    d[c] += w[c]
                    self.started = True
                if h.slots <= d[c]:
                    return h, False
            self.cur = (i + 1) % 3
            self.started = False
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

    def charge(self, c: RequestClass, slots: int, lone: bool = False) -> None:
        """Charge a grant of ``slots`` to class ``c`` (a lone class never goes below 0)."""
        if lone:
            self.deficit[c] = max(0.0, self.deficit[c] - slots)
        else:
            self.deficit[c] -= slots
