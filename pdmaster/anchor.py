"""The decode node a master anchors to: where it asks the agent to keep a slot whatever its demand.

Agents that follow demand give every master a floor, so that an idle master can serve its next
request at once. A floor on every node costs a fleet one idle slot per master and node (on 8-slot
engines with four masters, half of every engine while the masters wait for work); a master needs
one slot of the fleet for that, not one per node. So a master asks for its floor (``Ack.floor_slots``
= 1) on one decode node only and for none elsewhere, and its queue's demand brings it the rest.

The node is chosen by rendezvous hashing of (master, node) over the decode nodes that can take
work: stable while they stay, spread over the fleet across masters, and moved only when the anchor
itself goes. Pure: no I/O, the caller passes the clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

# How long a choice stands before the nodes are looked at again (the look is O(nodes)).
RECHECK_S = 0.5


def score(master_id: str, node_id: str) -> int:
    """Rendezvous weight of ``node_id`` for ``master_id`` (sha256, stable across processes)."""
    digest = hashlib.sha256(f"{master_id}\0{node_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


class Anchor:
    def __init__(self, master_id: str, recheck_s: float = RECHECK_S) -> None:
        self.master_id = master_id
        self.recheck_s = recheck_s
        self._node: str | None = None
        self._until = float("-inf")
        self._scores: dict[str, int] = {}

    def node(self, candidates: Iterable[str], now: float) -> str | None:
        """The anchor among ``candidates`` (decode nodes that can take work), looked at again at
        most every ``recheck_s``; None when there is none."""
        if now < self._until:
            return self._node
        self._until = now + self.recheck_s
        best: str | None = None
        best_score = -1
        scores = self._scores
        for n in candidates:
            s = scores.get(n)
            if s is None:
                s = scores[n] = score(self.master_id, n)
            if s > best_score or (s == best_score and best is not None and n < best):
                best, best_score = n, s
        self._node = best
        return best

    def floor_on(self, node_id: str, candidates: Iterable[str], now: float) -> int:
        """``Ack.floor_slots`` for ``node_id``: 1 on the anchor, 0 elsewhere."""
        return 1 if node_id == self.node(candidates, now) else 0

    def forget(self, node_id: str) -> None:
        """A node left for good: drop its cached weight (and the choice, if it was the anchor)."""
        self._scores.pop(node_id, None)
        if node_id == self._node:
            self._until = float("-inf")
