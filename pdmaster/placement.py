"""Where a lease runs: this master's share of each decode node and what it holds there (DESIGN §6).

The node ledger of admission: per node the share admission may place leases against, the node's full
capacity (which decides whether a request that fits no share is a 400 or a 429), and the slots this
master's leases hold there. A lease is placed on one node: active slots there + n <= the share.

Placement goes to the node with the most free slots, which spreads load and is the only node worth
checking for a gang. A heap of nodes by free slots finds it; an entry is live while its version is
the node's latest (``touch`` pushes a fresh one on every change), stale ones go when they surface and
the heap is compacted past four times the nodes. How many nodes have each share and full capacity is
counted, so their maxima cost O(distinct values), never a scan of the nodes.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

__all__ = ["Placement", "check_shares"]


def check_shares(shares: Mapping[str, int]) -> None:
    for node, s in shares.items():
        if int(s) != s or s < 0:
            raise ValueError(f"share of {node!r} must be a non-negative integer, got {s!r}")


def _uncount(counts: dict[int, int], value: int) -> None:
    n = counts[value] - 1
    if n:
        counts[value] = n
    else:
        del counts[value]


class Placement:
    """This master's shares per decode node and its active slots there."""

    __slots__ = (
        "_full_counts",
        "_node_ver",
        "_share_counts",
        "_ver",
        "active",
        "active_total",
        "capacity",
        "free_heap",
        "full",
        "full_total",
        "max_full",
        "max_share",
        "shares",
    )

    def __init__(self) -> None:
        self.shares: dict[str, int] = {}
        self.full: dict[str, int] = {}
        # How many nodes have each share / full capacity: their maxima in O(distinct values).
        self._share_counts: dict[int, int] = {}
        self._full_counts: dict[int, int] = {}
        self.active: dict[str, int] = {}
        self._node_ver: dict[str, int] = {}
        self._ver = 0
        self.free_heap: list[tuple[int, str, int]] = []  # (-free, node, ver)
        self.capacity = 0  # Σ shares
        self.full_total = 0  # Σ full capacity of the nodes this master holds a share on
        self.max_share = 0
        self.max_full = 0
        self.active_total = 0

    # ------------------------------------------------------------------ views

    def share_on(self, node: str) -> int:
        return self.shares.get(node, 0)

    def active_on(self, node: str) -> int:
        return self.active.get(node, 0)

    def holds(self, node: str) -> bool:
        """Whether this master holds a share or a lease on ``node``."""
        return bool(self.shares.get(node) or self.active.get(node))

    def fits_a_share(self, slots: int) -> bool:
        """Whether ``slots`` fit some node's share (when nothing runs there)."""
        return slots <= self.max_share

    def fits_a_node(self, slots: int) -> bool:
        """Whether ``slots`` fit some node's full capacity (else it never fits: a 400)."""
        return slots <= self.max_full

    def nodes_view(self) -> dict[str, dict[str, Any]]:
        nodes = sorted(set(self.shares) | {n for n, a in self.active.items() if a})
        return {
            n: {
                "share": self.shares.get(n, 0),
                "full_capacity": self.full.get(n, 0),
                "active": self.active.get(n, 0),
            }
            for n in nodes
        }

    # ------------------------------------------------------------------ free room

    def top_free(self) -> tuple[int, str | None]:
        """The node with the most free slots and how many (0, None: no node)."""
        h = self.free_heap
        nv = self._node_ver
        while h:
            e = h[0]
            if nv.get(e[1]) == e[2]:
                return -e[0], e[1]
            heapq.heappop(h)
        return 0, None

    def top_free_avoiding(self, avoid: frozenset[str]) -> tuple[int, str | None]:
        """The node with the most free slots outside ``avoid``: pops at most ``len(avoid)`` live
        entries (put back after), so the cost does not grow with the number of nodes."""
        h = self.free_heap
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

    # ------------------------------------------------------------------ changes

    def touch(self, node: str) -> None:
        """``node``'s free room changed: a fresh heap entry (or none, once nothing is held there)."""
        self._ver += 1  # global, so a node that leaves and comes back never revives stale entries
        ver = self._ver
        self._node_ver[node] = ver
        free = self.shares.get(node, 0) - self.active.get(node, 0)
        if node not in self.shares and not self.active.get(node):
            self.active.pop(node, None)
            self._node_ver.pop(node, None)
        else:
            heapq.heappush(self.free_heap, (-free, node, ver))
        if len(self.free_heap) > 4 * len(self._node_ver) + 64:
            self._compact()

    def _compact(self) -> None:
        nv = self._node_ver
        self.free_heap = [e for e in self.free_heap if nv.get(e[1]) == e[2]]
        heapq.heapify(self.free_heap)

    def take(self, node: str | None, slots: int) -> None:
        """A lease of ``slots`` placed on ``node`` (None: nowhere, in bypass mode)."""
        self.active_total += slots
        if node is not None:
            # touch(), inlined: this and give_back are on every decision's path
            active = self.active[node] = self.active.get(node, 0) + slots
            self._ver += 1
            self._node_ver[node] = ver = self._ver
            heapq.heappush(self.free_heap, (active - self.shares.get(node, 0), node, ver))
            if len(self.free_heap) > 4 * len(self._node_ver) + 64:
                self._compact()

    def give_back(self, node: str | None, slots: int) -> None:
        """A lease of ``slots`` on ``node`` ended."""
        self.active_total -= slots
        if node is not None:
            self.active[node] -= slots
            self.touch(node)

    def apply(self, changes: Mapping[str, int], node_capacity: Mapping[str, int] | None) -> bool:
        """Set the shares of the nodes in ``changes`` (0: no new work there) and their full capacity
        (``node_capacity``, defaulting to the share). Whether any share changed."""
        moved = False
        for node, s in changes.items():
            old_full = self.full.pop(node, None)
            if old_full is not None:
                _uncount(self._full_counts, old_full)
                self.full_total -= old_full
            if s > 0:
                full = max(int(node_capacity.get(node, s)) if node_capacity else s, s)
                self.full[node] = full
                self._full_counts[full] = self._full_counts.get(full, 0) + 1
                self.full_total += full
            old = self.shares.get(node, 0)
            if old == s:
                continue
            moved = True
            self.shares.pop(node, None)
            if old:
                _uncount(self._share_counts, old)
            if s > 0:
                self.shares[node] = s
                self._share_counts[s] = self._share_counts.get(s, 0) + 1
            self.capacity += s - old
            self.touch(node)
        self.max_full = max(self._full_counts, default=0)
        if moved:
            self.max_share = max(self._share_counts, default=0)
        return moved
