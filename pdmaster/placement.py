"""Where a lease runs: this master's share of each decode node and what it holds there (DESIGN §6, §13).

The node ledger of admission, and the one place where capacity is a vector. Per node: the share of
slots admission may place leases against, the node's full slot capacity (which decides whether a
request that fits no share is a 400 or a 429), and, when the node publishes a KV pool, this master's
token share of it and the whole pool; and what this master's leases hold there in slots and tokens.
A lease of n slots and k tokens is placed on one node where active slots + n <= the slot share and,
on a node with a pool, active tokens + k <= the token share. A node without a pool has no token
limit: there a lease is placed on slots alone, exactly as before pools existed.

Without pools, placement goes to the node with the most free slots, which spreads load and is the
only node worth checking for a gang. With pools, it goes to the node with the most free tokens among
the nodes with a pool that fit the lease in slots too; failing that, to the node with the most free
slots that fits it (any token charge fits a node without a pool). Two lazy heaps find those nodes: one
of every node by free slots, one of the nodes with a pool by free tokens. Each is walked from its top
while the free room there still covers the lease, past at most :data:`LOOKAHEAD` nodes that fit
one dimension and not the other (popped and put back). An entry is live while its version is the
node's latest (``touch`` pushes fresh ones on every change), stale ones go when they surface, and each
heap is compacted past four times the nodes. So a decision costs O(LOOKAHEAD log nodes) amortized and
never scans the nodes; the price is that a node beyond the lookahead that would fit is not found (the
ticket waits for the next change, or backfill runs past it). How many nodes have each share and full
capacity is counted, so their maxima cost O(distinct values).

A lease that found no node need not be looked for again until room grows where it could fit:
taking room never makes a lease fit, and a release frees room on one node only. So when
:meth:`Placement.fit` found no node at all (:attr:`Placement.exact`: every node with the room in one
dimension was looked at, none past the lookahead), :meth:`Placement.still_none` tells in O(1) per
release since whether that is still so, from the nodes whose room grew since (a share change
forgets them all).

Whether a request could fit some node when nothing runs (:meth:`Placement.refusal_code`) is judged
per dimension: its slots against the largest slot share and its tokens against the largest token
share, unless a node without a pool is held (no token limit there). When the largest slot share and
the largest token share are on different nodes, a request that no single node's shares could hold
may so enter the queue; it waits, as a gang does, until it fits or times out.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pdmaster.ticket import CANNOT_FIT_NOW, NO_AVOID, NO_CAPACITY, TOO_MANY_TOKENS, UNSATISFIABLE

__all__ = ["Placement", "check_shares"]

_Entry = tuple[int, str, int]  # (-free, node, version)
# Nodes looked at past a heap's top that have the room in one dimension but not the other.
LOOKAHEAD = 4


def check_shares(shares: Mapping[str, int], what: str = "share") -> None:
    for node, s in shares.items():
        if int(s) != s or s < 0:
            raise ValueError(f"{what} of {node!r} must be a non-negative integer, got {s!r}")


def _count(counts: dict[int, int], value: int) -> None:
    counts[value] = counts.get(value, 0) + 1


def _uncount(counts: dict[int, int], value: int) -> None:
    n = counts[value] - 1
    if n:
        counts[value] = n
    else:
        del counts[value]


def _top(h: list[_Entry], nv: dict[str, int], avoid: frozenset[str]) -> tuple[int, str | None]:
    """The live entry with the most free room outside ``avoid``: pops stale entries, and at most
    ``len(avoid)`` live ones (put back after), so the cost does not grow with the number of nodes."""
    skipped: list[_Entry] = []
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


def _first(
    h: list[_Entry], nv: dict[str, int], avoid: frozenset[str], need: int, ok: Callable[[str], bool]
) -> tuple[str | None, bool]:
    """The first live node outside ``avoid``, most free room first, with at least ``need`` free and
    ``ok``, and whether every node with ``need`` free was looked at (False: :data:`LOOKAHEAD` nodes
    failed ``ok`` and the walk gave up)."""
    skipped: list[_Entry] = []
    found: str | None = None
    whole = True
    misses = 0
    while h:
        e = h[0]
        node = e[1]
        if nv.get(node) != e[2]:
            heapq.heappop(h)
            continue
        if node in avoid:
            skipped.append(heapq.heappop(h))
            continue
        if -e[0] < need:
            break
        if ok(node):
            found = node
            break
        misses += 1
        if misses > LOOKAHEAD:
            whole = False
            break
        skipped.append(heapq.heappop(h))
    for e in skipped:
        heapq.heappush(h, e)
    return found, whole


class Placement:
    """This master's shares per decode node (slots, and tokens where the node has a pool) and what its
    leases hold there."""

    __slots__ = (
        "_full_counts",
        "_poolless_counts",
        "_share_counts",
        "_tfull_counts",
        "_tshare_counts",
        "active",
        "active_tokens_total",
        "active_total",
        "capacity",
        "exact",
        "free_heap",
        "full",
        "full_total",
        "max_full",
        "max_share",
        "max_tfull",
        "node_ver",
        "pooled_active_tokens",
        "raised",
        "raises",
        "shares",
        "tactive",
        "tfull",
        "token_capacity",
        "token_heap",
        "token_limit",
        "tshares",
        "ver",
    )

    def __init__(self) -> None:
        # slots
        self.shares: dict[str, int] = {}
        self.full: dict[str, int] = {}
        # How many nodes have each share / full capacity: their maxima in O(distinct values).
        self._share_counts: dict[int, int] = {}
        self._full_counts: dict[int, int] = {}
        self.active: dict[str, int] = {}
        self.capacity = 0  # Σ shares
        self.full_total = 0  # Σ full capacity of the nodes this master holds a share on
        self.max_share = 0
        self.max_full = 0
        self.active_total = 0
        # tokens: only nodes with a pool (and a slot share) are in tshares / tfull
        self.tshares: dict[str, int] = {}
        self.tfull: dict[str, int] = {}
        self._tshare_counts: dict[int, int] = {}
        self._tfull_counts: dict[int, int] = {}
        self._poolless_counts: dict[int, int] = {}  # slot shares of the held nodes without a pool
        self.tactive: dict[str, int] = {}  # tokens charged per node (with a pool or not)
        self.token_capacity = 0  # Σ token shares
        self.pooled_active_tokens = 0  # Σ tactive over the nodes in tshares
        self.active_tokens_total = 0  # Σ tactive
        self.max_tfull = 0
        # The most tokens a lease may charge and still fit a share when nothing runs: the largest
        # token share, or inf while a node without a pool is held (no token limit there).
        self.token_limit: float = math.inf
        # heaps
        self.node_ver: dict[str, int] = {}
        self.ver = 0  # grows with every change of any node's free room (a touch)
        self.free_heap: list[_Entry] = []  # every node: (-free slots, node, ver)
        self.token_heap: list[_Entry] = []  # nodes with a pool: (-free tokens, node, ver)
        # Room that grew (see :meth:`still_none`): how many times, and on which nodes lately.
        self.raises = 0
        self.raised: list[str] = []  # the nodes of the latest raises, newest last
        # After fit found no node: whether no node at all has the room (every walk looked at every
        # node with the room in its dimension), rather than the walk gave up past the lookahead.
        self.exact = False

    # ------------------------------------------------------------------ views

    def share_on(self, node: str) -> int:
        return self.shares.get(node, 0)

    def active_on(self, node: str) -> int:
        return self.active.get(node, 0)

    def token_share_on(self, node: str) -> int | None:
        return self.tshares.get(node)

    def active_tokens_on(self, node: str) -> int:
        return self.tactive.get(node, 0)

    def holds(self, node: str) -> bool:
        """Whether this master holds a share or a lease on ``node``."""
        return bool(self.shares.get(node) or self.active.get(node))

    def fits_a_share(self, slots: int, tokens: int = 0) -> bool:
        """Whether a lease could fit some share when nothing runs there (per dimension, see the
        module)."""
        return slots <= self.max_share and tokens <= self.token_limit

    def refusal_code(self, slots: int, tokens: int = 0) -> str | None:
        """Why a lease of ``slots`` and ``tokens`` is refused whatever the queue holds, or None:
        ``no_capacity``; ``unsatisfiable`` (more slots than any node has), ``too_many_tokens`` (more
        tokens than any node's whole pool, no node without a pool held), both final; or
        ``cannot_fit_now`` (it fits a whole node but no share this master holds now)."""
        if self.capacity == 0:
            return NO_CAPACITY
        if slots > self.max_full:
            return UNSATISFIABLE
        if tokens > self.token_limit and tokens > self.max_tfull:
            return TOO_MANY_TOKENS
        if not self.fits_a_share(slots, tokens):
            return CANNOT_FIT_NOW
        return None

    def nodes_view(self) -> dict[str, dict[str, Any]]:
        nodes = sorted(set(self.shares) | {n for n, a in self.active.items() if a})
        out: dict[str, dict[str, Any]] = {}
        for n in nodes:
            v: dict[str, Any] = {
                "share": self.shares.get(n, 0),
                "full_capacity": self.full.get(n, 0),
                "active": self.active.get(n, 0),
                # None: the node publishes no pool (slots only there)
                "token_share": self.tshares.get(n),
                "token_full": self.tfull.get(n),
                "active_tokens": self.tactive.get(n, 0),
            }
            out[n] = v
        return out

    # ------------------------------------------------------------------ free room

    def top_free(self) -> tuple[int, str | None]:
        """The node with the most free slots and how many (0, None: no node)."""
        h = self.free_heap
        nv = self.node_ver
        while h:
            e = h[0]
            if nv.get(e[1]) == e[2]:
                return -e[0], e[1]
            heapq.heappop(h)
        return 0, None

    def top_free_avoiding(self, avoid: frozenset[str]) -> tuple[int, str | None]:
        """The node with the most free slots outside ``avoid`` (see :func:`_top`)."""
        return _top(self.free_heap, self.node_ver, avoid)

    def fit(self, slots: int, tokens: int, avoid: frozenset[str] = NO_AVOID) -> str | None:
        """The node a lease of ``slots`` and ``tokens`` goes to now, outside ``avoid``; None: none of
        the nodes checked has the room (see the module), and then :attr:`exact` says whether no node
        outside ``avoid`` has it at all."""
        nv = self.node_ver
        tshares = self.tshares
        if not tshares:  # no pool anywhere: slots alone, the top of the slot heap
            f, node = _top(self.free_heap, nv, avoid) if avoid else self.top_free()
            if node is not None and f >= slots:
                return node
            self.exact = True
            return None
        shares = self.shares
        active = self.active
        h = self.token_heap
        while h and nv.get(h[0][1]) != h[0][2]:
            heapq.heappop(h)
        if h and not avoid:
            # The common cases at the top of the token heap, without a walk: no node with a pool has
            # the tokens free, or the one with the most has the slots too.
            e = h[0]
            if -e[0] < tokens:
                if not self._poolless_counts:
                    self.exact = True
                    return None
                return self._poolless(slots, avoid)
            if shares[e[1]] - active.get(e[1], 0) >= slots:
                return e[1]
        tactive = self.tactive

        def slots_fit(n: str) -> bool:
            return shares[n] - active.get(n, 0) >= slots

        def tokens_fit(n: str) -> bool:
            ts = tshares.get(n)
            return ts is None or tactive.get(n, 0) + tokens <= ts

        node, whole = _first(self.token_heap, nv, avoid, tokens, slots_fit)
        if node is not None:
            return node
        if whole:
            # Every node with a pool and the tokens free was looked at: only a node without a pool
            # is left to find (none held: none at all, which keeps a token-bound miss O(1)).
            if not self._poolless_counts:
                self.exact = True
                return None
            return self._poolless(slots, avoid)
        node, self.exact = _first(self.free_heap, nv, avoid, slots, tokens_fit)
        return node

    def _poolless(self, slots: int, avoid: frozenset[str]) -> str | None:
        """The node without a pool with the most free slots, if it has ``slots`` free (no node with
        a pool has the room)."""
        tshares = self.tshares
        node, self.exact = _first(self.free_heap, self.node_ver, avoid, slots, lambda n: n not in tshares)
        return node

    def still_none(self, slots: int, tokens: int, seen: int) -> bool:
        """Whether :meth:`fit` (without ``avoid``) surely finds no node for ``slots`` and ``tokens``
        now, given that no node had the room when :attr:`raises` was ``seen``. Taking room never
        makes a lease fit, so only the nodes whose room grew since need a look: O(their number), and
        False (ask :meth:`fit`) when those are no longer all known (a share change, or many)."""
        n = self.raises - seen
        if n == 1:  # the common case: one release since
            node = self.raised[-1] if self.raised else None
            if node is None or self.shares.get(node, 0) - self.active.get(node, 0) < slots:
                return node is not None
            ts = self.tshares.get(node)
            return ts is not None and self.tactive.get(node, 0) + tokens > ts
        if not n:
            return True
        raised = self.raised
        if n > len(raised):
            return False
        shares = self.shares
        active = self.active
        tshares = self.tshares
        for node in raised[-n:]:
            if shares.get(node, 0) - active.get(node, 0) >= slots:
                ts = tshares.get(node)
                if ts is None or self.tactive.get(node, 0) + tokens <= ts:
                    return False
        return True

    # ------------------------------------------------------------------ changes

    def touch(self, node: str) -> None:
        """``node``'s free room changed: fresh heap entries (or none, once nothing is held there)."""
        self.ver += 1  # global, so a node that leaves and comes back never revives stale entries
        ver = self.ver
        self.node_ver[node] = ver
        if node not in self.shares and not self.active.get(node):
            self.active.pop(node, None)
            self.tactive.pop(node, None)
            self.node_ver.pop(node, None)
        else:
            free = self.shares.get(node, 0) - self.active.get(node, 0)
            heapq.heappush(self.free_heap, (-free, node, ver))
            ts = self.tshares.get(node)
            if ts is not None:
                heapq.heappush(self.token_heap, (self.tactive.get(node, 0) - ts, node, ver))
        most = 4 * len(self.node_ver) + 64
        if len(self.free_heap) > most or len(self.token_heap) > most:
            self._compact()

    def _compact(self) -> None:
        nv = self.node_ver
        self.free_heap = [e for e in self.free_heap if nv.get(e[1]) == e[2]]
        heapq.heapify(self.free_heap)
        self.token_heap = [e for e in self.token_heap if nv.get(e[1]) == e[2]]
        heapq.heapify(self.token_heap)

    def take(self, node: str | None, slots: int, tokens: int = 0) -> None:
        """A lease of ``slots`` and ``tokens`` placed on ``node`` (None: nowhere, in bypass mode)."""
        self.active_total += slots
        if node is None:
            return
        active = self.active[node] = self.active.get(node, 0) + slots
        share = self.shares.get(node)
        tshares = self.tshares
        if tokens or tshares:
            ts = tshares.get(node)
            if tokens:
                self.tactive[node] = self.tactive.get(node, 0) + tokens
                self.active_tokens_total += tokens
                if ts is not None:
                    self.pooled_active_tokens += tokens
            if share is None:
                self.touch(node)
                return
            # touch(), inlined: fresh entries in both heaps
            self.ver += 1
            nv = self.node_ver
            nv[node] = ver = self.ver
            fh = self.free_heap
            heapq.heappush(fh, (active - share, node, ver))
            th = self.token_heap
            if ts is not None:
                heapq.heappush(th, (self.tactive.get(node, 0) - ts, node, ver))
            most = 4 * len(nv) + 64
            if len(fh) > most or len(th) > most:
                self._compact()
            return
        # No pool anywhere and no tokens: touch(), inlined (on every decision's path).
        self.ver += 1
        self.node_ver[node] = ver = self.ver
        heapq.heappush(self.free_heap, (active - (share or 0), node, ver))
        if len(self.free_heap) > 4 * len(self.node_ver) + 64:
            self._compact()

    def give_back(self, node: str | None, slots: int, tokens: int = 0) -> None:
        """A lease of ``slots`` and ``tokens`` on ``node`` ended."""
        self.active_total -= slots
        if node is None:
            return
        active = self.active[node] = self.active[node] - slots
        tshares = self.tshares
        if tokens:
            self.tactive[node] -= tokens
            self.active_tokens_total -= tokens
            if node in tshares:
                self.pooled_active_tokens -= tokens
        share = self.shares.get(node)
        if share is None or tshares:
            if share is None:
                self.touch(node)
            else:
                # touch(), inlined: fresh entries in both heaps
                self.ver += 1
                nv = self.node_ver
                nv[node] = ver = self.ver
                fh = self.free_heap
                heapq.heappush(fh, (active - share, node, ver))
                th = self.token_heap
                ts = tshares.get(node)
                if ts is not None:
                    heapq.heappush(th, (self.tactive.get(node, 0) - ts, node, ver))
                most = 4 * len(nv) + 64
                if len(fh) > most or len(th) > most:
                    self._compact()
            # Room grew here (still_none). Not noted without pools: no one asks then, and the share
            # change that brings a pool resets what is known.
            self.raises += 1
            raised = self.raised
            raised.append(node)
            if len(raised) > 64:
                del raised[:32]
            return
        # A node with a share and no pool anywhere: touch(), inlined (on every release's path).
        self.ver += 1
        self.node_ver[node] = ver = self.ver
        heapq.heappush(self.free_heap, (active - share, node, ver))
        if len(self.free_heap) > 4 * len(self.node_ver) + 64:
            self._compact()

    def apply(
        self,
        changes: Mapping[str, int],
        node_capacity: Mapping[str, int] | None,
        token_shares: Mapping[str, int] | None = None,
        token_full: Mapping[str, int] | None = None,
        token_nodes: Iterable[str] = (),
    ) -> bool:
        """Set the shares of the nodes in ``changes`` (0: no new work there), their full capacity
        (``node_capacity``, defaulting to the share), their token shares (``token_shares``: absent,
        or no mapping at all, means no pool) and whole pools (``token_full``, defaulting to the token
        share). ``token_nodes``: nodes outside ``changes`` whose token share alone is set (their slot
        share stays). Whether any share changed."""
        moved = False
        for node, s in changes.items():
            ts = token_shares.get(node) if token_shares else None
            moved |= self._apply_one(node, s, node_capacity, ts, token_full)
        for node in token_nodes:
            if node not in changes:
                s = self.shares.get(node, 0)
                ts = token_shares.get(node) if token_shares else None
                keep = {node: self.full.get(node, s)}
                nc = node_capacity if node_capacity and node in node_capacity else keep
                moved |= self._apply_one(node, s, nc, ts, token_full)
        self.max_full = max(self._full_counts, default=0)
        self.max_tfull = max(self._tfull_counts, default=0)
        if moved:
            self.max_share = max(self._share_counts, default=0)
            self.token_limit = (
                math.inf if self._poolless_counts else float(max(self._tshare_counts, default=0))
            )
        return moved

    def _apply_one(
        self,
        node: str,
        s: int,
        node_capacity: Mapping[str, int] | None,
        ts: int | None,
        token_full: Mapping[str, int] | None,
    ) -> bool:
        old_full = self.full.pop(node, None)
        if old_full is not None:
            _uncount(self._full_counts, old_full)
            self.full_total -= old_full
        old_tfull = self.tfull.pop(node, None)
        if old_tfull is not None:
            _uncount(self._tfull_counts, old_tfull)
        if s <= 0:
            ts = None  # no new work there: no token share either
        if s > 0:
            full = max(int(node_capacity.get(node, s)) if node_capacity else s, s)
            self.full[node] = full
            _count(self._full_counts, full)
            self.full_total += full
            if ts is not None:
                tf = max(int(token_full.get(node, ts)) if token_full else ts, ts)
                self.tfull[node] = tf
                _count(self._tfull_counts, tf)
        old = self.shares.get(node, 0)
        old_ts = self.tshares.get(node)
        if old == s and old_ts == ts:
            return False
        if old:
            _uncount(self._share_counts, old)
            if old_ts is None:
                _uncount(self._poolless_counts, old)
        if old_ts is not None:
            _uncount(self._tshare_counts, old_ts)
            self.token_capacity -= old_ts
            self.pooled_active_tokens -= self.tactive.get(node, 0)
        self.shares.pop(node, None)
        self.tshares.pop(node, None)
        if s > 0:
            self.shares[node] = s
            _count(self._share_counts, s)
            if ts is None:
                _count(self._poolless_counts, s)
            else:
                self.tshares[node] = ts
                _count(self._tshare_counts, ts)
                self.token_capacity += ts
                self.pooled_active_tokens += self.tactive.get(node, 0)
        self.capacity += s - old
        self.touch(node)
        # Room changed either way: what still_none knows since any earlier raise is void.
        self.raises += 1
        self.raised.clear()
        return True
