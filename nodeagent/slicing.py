"""Share slicing and epochs: the pure core of the node agent (DESIGN §4).

No I/O and no clock of its own: callers pass ``now`` (seconds, monotonic) and ``time_ns`` values,
which keeps every decision reproducible in tests and simulations.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


def rotation_start(node_id: str, masters: int) -> int:
    """Stable position where the remainder slots start for this node (sha256, not ``hash()``)."""
    if masters <= 0:
        return 0
    digest = hashlib.sha256(node_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % masters


def slice_shares(capacity: int, masters: Iterable[str], node_id: str) -> dict[str, int]:
    """Split ``capacity`` over ``masters`` deterministically; the shares sum to ``capacity``.

    Every share is ``capacity // M`` or one more. The ``capacity % M`` extra slots go to the masters
    at sorted positions ``(start + k) % M``: a fixed "lowest ids first" rule would hand the lowest
    master up to one extra slot on every node of the fleet; rotating by a hash of the node id evens
    that out across nodes.
    """
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    ordered = sorted(set(masters))
    m = len(ordered)
    if m == 0:
        return {}
    base, rem = divmod(capacity, m)
    shares = dict.fromkeys(ordered, base)
    start = rotation_start(node_id, m)
    for k in range(rem):
        shares[ordered[(start + k) % m]] += 1
    return shares


def next_epoch(previous: int, time_ns: int, stored: int = 0) -> int:
    """Strictly increasing across changes and agent restarts (DESIGN §4)."""
    return max(previous + 1, time_ns, stored + 1)


@dataclass
class MasterView:
    """What the agent knows of one master."""

    in_etcd: bool = False
    connected: bool = False
    # When the stream went down (monotonic seconds); None while connected or never connected.
    down_since: float | None = None


@dataclass
class Slicer:
    """Tracks membership and stream state; decides the current shares and their epoch.

    ``masters_in_etcd`` comes from the etcd watch; ``stream_up``/``stream_down`` from the gRPC
    streams. A master is part of the split while its etcd key exists and its stream is up, has not
    been up yet (it just appeared: give the stream a chance), or has been down for less than
    ``grace_s``. ``tick(now)`` re-evaluates grace expiry; every change of the effective master set
    advances the epoch.
    """

    node_id: str
    capacity: int
    grace_s: float = 1.0
    epoch: int = 0
    views: dict[str, MasterView] = field(default_factory=dict)
    _members: tuple[str, ...] = ()
    _shares: dict[str, int] = field(default_factory=dict)

    def set_masters(self, master_ids: Iterable[str], now: float, time_ns: int) -> bool:
        wanted = set(master_ids)
        for mid in wanted:
            view = self.views.setdefault(mid, MasterView())
            if not view.in_etcd:
                view.in_etcd = True
                # A master that (re)appears in etcd gets a fresh grace window for its stream.
                if not view.connected:
                    view.down_since = now
        for mid, view in list(self.views.items()):
            if mid not in wanted:
                view.in_etcd = False
                if not view.connected:
                    del self.views[mid]
        return self._recompute(now, time_ns)

    def stream_up(self, master_id: str, now: float, time_ns: int) -> bool:
        view = self.views.setdefault(master_id, MasterView())
        view.connected = True
        view.down_since = None
        return self._recompute(now, time_ns)

    def stream_down(self, master_id: str, now: float, time_ns: int) -> bool:
        view = self.views.get(master_id)
        if view is None:
            return False
        if view.connected:
            view.connected = False
            view.down_since = now
        if not view.in_etcd:
            del self.views[master_id]
        return self._recompute(now, time_ns)

    def set_capacity(self, capacity: int, now: float, time_ns: int) -> bool:
        if capacity == self.capacity:
            return False
        self.capacity = capacity
        return self._recompute(now, time_ns, force=True)

    def tick(self, now: float, time_ns: int) -> bool:
        """Apply grace expiry; True when the shares changed."""
        return self._recompute(now, time_ns)

    def next_grace_deadline(self) -> float | None:
        """When the next grace window ends (so the caller can wake exactly then)."""
        deadlines = [
            v.down_since + self.grace_s
            for v in self.views.values()
            if v.in_etcd and not v.connected and v.down_since is not None
        ]
        return min(deadlines) if deadlines else None

    def restore_epoch(self, stored: int) -> None:
        """Seed from the last epoch persisted in etcd so a restarted agent keeps increasing."""
        self.epoch = max(self.epoch, stored)

    def members(self, now: float) -> tuple[str, ...]:
        out = []
        for mid, v in self.views.items():
            if not v.in_etcd:
                continue
            if v.connected or (v.down_since is not None and now - v.down_since < self.grace_s):
                out.append(mid)
        return tuple(sorted(out))

    @property
    def shares(self) -> Mapping[str, int]:
        return self._shares

    def share_for(self, master_id: str) -> int:
        return self._shares.get(master_id, 0)

    def _recompute(self, now: float, time_ns: int, force: bool = False) -> bool:
        members = self.members(now)
        if members == self._members and not force and self.epoch:
            return False
        self._members = members
        self._shares = slice_shares(self.capacity, members, self.node_id)
        self.epoch = next_epoch(self.epoch, time_ns)
        return True
