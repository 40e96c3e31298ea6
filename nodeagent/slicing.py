"""Share slicing and epochs: the pure core of the node agent (DESIGN §4).

No I/O and no clock of its own: callers pass ``now`` (seconds, monotonic) and ``time_ns`` values,
which keeps every decision reproducible in tests and simulations.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from nodeagent.handover import STARTUP, Handover
from pdcoord.keepalive import UNADVERTISED_DETECT_S


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


def share_table(masters: Iterable[str], capacities: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """master -> node -> its static share when exactly ``masters`` are live (``slice_shares`` per node)."""
    names = list(masters)
    table: dict[str, dict[str, int]] = {m: {} for m in names}
    for node, cap in capacities.items():
        for m, s in slice_shares(cap, names, node).items():
            table[m][node] = s
    return table


def demand_shares(
    capacity: int,
    demands: Mapping[str, int],
    node_id: str,
    floor: int | Mapping[str, int] = 1,
    top_up: bool = False,
) -> dict[str, int]:
    """Split ``capacity`` by demand: a floor for every master, then max-min fair by demand.

    Every master first gets ``min(floor, capacity // M)`` (``floor`` may be given per master). The
    rest is water-filled over what each wants beyond its floor (nobody gets more than it asks while
    another still waits), and slots that nobody asks for are spread evenly with :func:`slice_shares`,
    so the node stays work-conserving: an idle burst finds headroom on every master. With ``top_up``
    those slots first raise every master towards its even share (largest shortfall first), which
    makes the split exactly the even one when only some masters ask for their even share (a join
    window on an idle node).
    Deterministic; the shares sum to ``capacity``.
    """
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    ordered = sorted(demands)
    m = len(ordered)
    if m == 0:
        return {}
    most = capacity // m
    if isinstance(floor, int):
        floors = dict.fromkeys(ordered, min(max(floor, 0), most))
    else:
        floors = {k: min(max(int(floor.get(k, 0)), 0), most) for k in ordered}
    shares = dict(floors)
    rest = capacity - sum(floors.values())
    need = {k: max(0, int(demands[k]) - floors[k]) for k in ordered}
    pending = sorted((k for k in ordered if need[k] > 0), key=lambda k: (need[k], k))
    while pending and rest > 0:
        level = rest // len(pending)
        if level == 0:
            # Fewer slots than claimants: one each, starting at the node's rotation point.
            start = rotation_start(node_id, len(pending))
            claim = sorted(pending)
            for i in range(rest):
                shares[claim[(start + i) % len(claim)]] += 1
            rest = 0
            break
        k = pending[0]
        if need[k] <= level:
            for j in pending:
                give = min(need[j], level)
                shares[j] += give
                need[j] -= give
                rest -= give
            pending = [j for j in pending if need[j] > 0]
        else:
            for j in pending:
                shares[j] += level
                need[j] -= level
            rest -= level * len(pending)
    if top_up and rest > 0:
        even = slice_shares(capacity, ordered, node_id)
        for k in sorted(ordered, key=lambda k: (shares[k] - even[k], k)):
            give = min(rest, max(0, even[k] - shares[k]))
            shares[k] += give
            rest -= give
    for k, v in slice_shares(rest, ordered, node_id).items():
        shares[k] += v
    return shares


def step_towards(current: Mapping[str, int], ideal: Mapping[str, int], max_step: int) -> dict[str, int]:
    """Move ``current`` towards ``ideal`` (same keys, same sum) by at most ``max_step`` per master."""
    diffs = {k: ideal[k] - current.get(k, 0) for k in ideal}
    largest = max((abs(d) for d in diffs.values()), default=0)
    if largest <= max_step:
        return dict(ideal)
    alpha = max_step / largest
    raw = {k: current.get(k, 0) + alpha * d for k, d in diffs.items()}
    out = {k: math.floor(v) for k, v in raw.items()}
    residual = sum(ideal.values()) - sum(out.values())
    for k in sorted(raw, key=lambda k: (out[k] - raw[k], k))[:residual]:
        out[k] += 1
    return out


def next_epoch(previous: int, time_ns: int, stored: int = 0) -> int:
    """Strictly increasing across changes and agent restarts (DESIGN §4)."""
    return max(previous + 1, time_ns, stored + 1)


# Shortest time a master that joined counts as wanting at least its even share (Slicer.join_prior_s).
JOIN_PRIOR_MIN_S = 5.0
# How long a master that just appeared in etcd stays in the split before its stream first comes up.
# Longer than the grace for a stream that went down: when a master starts, a thousand agents connect
# to it at once, and dropping it from the split after one second and adding it back when the stream
# is up doubled the messages of a join (each membership change goes to every master). A master that
# never connects (a wrong advertised address) keeps its share idle for this long, then leaves.
FIRST_CONNECT_MIN_S = 5.0

# After a master's address refuses connections (its process is gone), engine samples taken this much
# later may release its slots: a request it sent just before it died may still be on its way into
# the engine's counts.
GONE_SAMPLE_DELAY_S = 0.25

# How long a master may take to notice a dead agent stream, and a little slack. Strict handover
# frees a departed master's slots only on engine samples taken after this, so it must cover that
# detection; the grace need not (it only decides when the master leaves the split's targets). A
# master advertises its ``detect_s`` in etcd (3 s at the defaults), and the agent then allows that
# plus the slack (Slicer.allow_peer_detect); never less than this floor, which covers a master whose
# key does not say (an earlier release: a ping after 0.65 s without reads, 1 s to answer it).
PEER_DETECT_SLACK_S = 0.1
PEER_DETECT_S = UNADVERTISED_DETECT_S + PEER_DETECT_SLACK_S  # 1.75 s

# Before an engine sample that strict handover brackets with Acks: how long to wait for them.
BRACKET_ACK_WAIT_S = 1.0

HANDOVER_MODES = ("strict", "fast")
SHARE_POLICIES = ("static", "demand")


@dataclass(frozen=True)
class SharePolicy:
    """How a node's capacity is split and handed over; the fields are the agent's flags of the same
    names (``--share-policy`` is ``policy``, ``--share-floor`` is ``floor``), carried unchanged."""

    policy: str = "demand"  # demand: follow active + wanted slots (even when idle); static: even split
    handover: str = "strict"  # strict: shrink before grow; fast: shares move at once
    grace: float = 1.0  # seconds a master's stream may be down before it leaves the split
    floor: int = 1  # demand: slots every live master keeps
    rebalance_interval: float = 1.0  # demand: seconds between re-evaluations
    rebalance_hysteresis: int = 2  # demand: smallest move, in slots
    rebalance_max_step: float = 0.25  # demand: largest move per re-evaluation, fraction of the node
    orphan_timeout: float = 30.0  # strict: free a departed master's slots after this long regardless

    def __post_init__(self) -> None:
        if self.handover not in HANDOVER_MODES:
            raise ValueError(f"handover must be one of {HANDOVER_MODES}, got {self.handover!r}")
        if self.policy not in SHARE_POLICIES:
            raise ValueError(f"policy must be one of {SHARE_POLICIES}, got {self.policy!r}")


@dataclass
class MasterView:
    """What the agent knows of one master."""

    in_etcd: bool = False
    connected: bool = False
    # When the stream went down (monotonic seconds); None while connected or never connected.
    down_since: float | None = None
    # It (re)appeared in etcd and its stream has not come up since: it gets FIRST_CONNECT_MIN_S.
    fresh: bool = False
    # When its address was found refusing connections after its stream went down (its process is
    # gone, so it places no more work anywhere): it leaves the split then, without waiting for the grace.
    gone_at: float | None = None
    # Register.stream_id of the last stream opened to it; ``released``: the fewest slots its key said
    # it still runs here since it named that stream released (it places nothing more here until a new
    # stream); None: not named.
    stream_id: int = 0
    released: int | None = None
    # Its address refused a connection since its stream went down, and the agent does not take that
    # for death (--no-gone-on-refusal): once its etcd key is gone too, it counts as gone.
    refused: bool = False


@dataclass
class Slicer:
    """Tracks membership, stream state and the masters' Acks; decides the grants and their epoch.

    ``masters_in_etcd`` comes from the etcd watch; ``stream_up``/``stream_down`` from the gRPC
    streams. A master is part of the split while its etcd key exists and its stream is up, has not
    been up yet (it just appeared: give the stream a chance), or has been down for less than
    ``grace_s``. The split gives every member a *target* (``static``: even, ``demand``: by what the
    masters report as active + wanted, rebalanced at most every ``rebalance_s`` with hysteresis and
    a bounded step); :class:`~nodeagent.handover.Handover` turns targets into *grants* (``strict``:
    shrink before grow; ``fast``: grants are the targets). Every change of the grants or of the
    member set advances the epoch. ``tick(now)`` applies timers: grace, rebalance, orphan timeout.

    With a KV pool (``kv_tokens``, :meth:`set_kv_tokens`) the same is done for tokens: token targets
    by token demand (active + wanted tokens of the Acks; a master's floor is its slot floor scaled by
    pool / slots; hysteresis and step scaled likewise), token grants by a second strict handover
    whose reservations of departed masters go with their slot reservations (see
    :mod:`nodeagent.handover`), and one epoch for both: a change of either advances it.
    """

    node_id: str
    capacity: int
    policy: SharePolicy = field(default_factory=SharePolicy)
    # How long a master may take to notice that its stream to this agent is dead (its gRPC
    # keep-alive, as its etcd key says: 3 s at the defaults, 1.65 s for a key that does not say);
    # until then it may still place work here under its last share. Only grows (allow_peer_detect),
    # for every master: one bound for all is simpler to trust.
    peer_detect_s: float = PEER_DETECT_S
    probe: bool = True
    now: float = 0.0
    epoch: int = 0
    # The node's KV pool in tokens (DESIGN §13); None: the engine publishes none, the node's capacity
    # is its slots alone and no grant carries a token share.
    kv_tokens: int | None = None
    views: dict[str, MasterView] = field(default_factory=dict)
    _members: tuple[str, ...] = ()
    _shares: dict[str, int] = field(default_factory=dict)
    _targets: dict[str, int] = field(default_factory=dict)
    _next_rebalance: float = 0.0
    # A rebalance could move the targets: some master's demand changed since the last one, or the
    # last one moved only part of the way. Otherwise only a join window's end can (demand).
    _rebalance_due: bool = False
    # When each master's stream was last seen up (now, while it is up).
    _last_up: dict[str, float] = field(default_factory=dict)
    # Masters whose last Ack said they drain with nothing queued: out of the split.
    _draining: set[str] = field(default_factory=set)
    # When each member joined the split (demand: for a while after its join a master counts as
    # wanting at least its even share).
    _joined: dict[str, float] = field(default_factory=dict)
    _ho: Handover = field(init=False)
    # Tokens: targets, grants and their handover (None without a pool). Token grants go out under the
    # same epoch as the slot grants.
    _token_targets: dict[str, int] = field(default_factory=dict)
    _token_shares: dict[str, int] = field(default_factory=dict)
    _tho: Handover | None = field(init=False, default=None)
    # The token reservation of the agent's previous incarnation (or, for a pool found later, of the
    # leases that ran before) holds while any of these slot reservations may still cover leases.
    _token_cover: set[str] = field(default_factory=set)
    # Per master, whether its last Ack carried active_tokens (False: an earlier release, which places
    # on slots alone and gets no token share), and its token fields as last acked.
    _token_aware: dict[str, bool] = field(default_factory=dict)
    _token_acks: dict[str, tuple[int | None, int | None, int | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._ho = Handover(
            self.capacity,
            strict=self.policy.handover == "strict",
            orphan_timeout_s=self.policy.orphan_timeout,
            probe=self.probe,
            now=self.now,
            startup_wait_s=self.peer_detect_s,
        )
        if self.kv_tokens:
            self._start_tokens(self.kv_tokens, self.now)
        else:
            self.kv_tokens = None

    def _start_tokens(self, pool: int, now: float) -> None:
        """A token handover for a pool that was not known before (at start, or found later).

        Its whole pool is reserved at first, under STARTUP, for as long as the slot reservations there
        are now (the previous incarnation's, or those of departed masters) may cover leases: the
        token charges of those leases are not known, but once no slot of them can be running, none of
        their tokens is. The live masters' token use comes with their Acks (the last ones are
        replayed here)."""
        self._tho = Handover(
            pool,
            strict=self.policy.handover == "strict",
            orphan_timeout_s=self.policy.orphan_timeout,
            probe=True,  # never sampled: its reservations go with the slot ones (_sync_token_orphans)
            now=now,
        )
        self._token_cover = set(self._ho.orphans)
        for m in self._members:
            self._tho.include(m)
            h = self._ho.holders.get(m)
            if h is not None and h.acked:
                self._token_ack(m, h.applied_epoch, h.active, h.wanted, False, now, -math.inf, h.floor)
        self._sync_token_orphans()

    # -- inputs -------------------------------------------------------------------------------
    def allow_peer_detect(self, detect_s: float) -> bool:
        """A master advertises that it may take ``detect_s`` to notice a cut stream: from now on
        every departed master's slots wait that long (plus slack) for engine samples, and so does
        what the agent's previous incarnation granted. Call it before the master joins the split.
        Returns whether the bound grew."""
        wanted = detect_s + PEER_DETECT_SLACK_S
        if wanted <= self.peer_detect_s:
            return False
        self._ho.extend_startup_wait(wanted - self.peer_detect_s)
        self.peer_detect_s = wanted
        return True

    def set_masters(self, master_ids: Iterable[str], now: float, time_ns: int) -> bool:
        wanted = set(master_ids)
        for mid in wanted:
            view = self.views.setdefault(mid, MasterView())
            if not view.in_etcd:
                view.in_etcd = True
                # A master that (re)appears in etcd gets a fresh grace window for its stream.
                if not view.connected:
                    view.down_since = now
                    view.fresh = True
                    view.gone_at = None  # a new registration: a new process, maybe not up yet
                    view.refused = False
        for mid, view in list(self.views.items()):
            if mid not in wanted:
                view.in_etcd = False
                if self._left_for_good(mid):  # before its drain is forgotten with its view
                    self._ho.mark_gone(mid)
                if not view.connected:
                    del self.views[mid]
        self._draining &= set(self.views)
        return self._recompute(now, time_ns)

    def master_drained(self, master_id: str) -> None:
        """The master's etcd key says it drained: it takes no new work and none of its requests runs
        any more (it writes that only then, just before it revokes the key). As an Ack saying it
        drains with an empty queue, but also for a master none of whose Acks said so before it went."""
        self._draining.add(master_id)

    def stream_opening(self, master_id: str, stream_id: int) -> None:
        """A Register goes out on a new stream, with the master's grant of now: from here on only
        this stream may be named released (an earlier one's word came too late to free that grant)."""
        view = self.views.get(master_id)
        if view is not None:
            view.stream_id = stream_id

    def stream_up(self, master_id: str, now: float, time_ns: int, stream_id: int = 0) -> bool:
        view = self.views.setdefault(master_id, MasterView())
        view.connected = True
        view.down_since = None
        view.fresh = False
        view.gone_at = None
        view.refused = False
        view.stream_id = stream_id
        view.released = None
        self._last_up[master_id] = now
        self._draining.discard(master_id)  # a draining master takes no new streams: a new process
        return self._recompute(now, time_ns)

    def stream_down(self, master_id: str, now: float, time_ns: int) -> bool:
        view = self.views.get(master_id)
        if view is None:
            return False
        if view.connected:
            view.connected = False
            view.down_since = now
            self._last_up[master_id] = now
            # A master that left the split earlier (it drains) was released by its own Acks while
            # reachable; from now on only engine samples can release what it still runs, and only
            # those taken after it could have noticed the stream is gone (it may stop its leases
            # then, or still be running them: the sample must be able to see them).
            self._ho.hold_orphan(master_id, self._samples_count_from(master_id, now))
        if not view.in_etcd:
            del self.views[master_id]
        return self._recompute(now, time_ns)

    def master_gone(self, master_id: str, now: float, time_ns: int) -> bool:
        """The master's address refused a connection after its stream went down: its process is gone.

        It leaves the split at once instead of after ``grace``, and engine samples taken from
        ``GONE_SAMPLE_DELAY_S`` on may release what it ran. The grace covers a master that is alive
        but cut off, which may still place work here until its keep-alive notices; a process that no
        longer listens places none (its listening socket closes with it). A refusal seen while the
        stream is up, or for a master this agent does not know, changes nothing.
        """
        view = self.views.get(master_id)
        if view is None or view.connected or view.gone_at is not None:
            return False
        view.gone_at = now
        o = self._ho.orphans.get(master_id)
        if o is not None:  # it left the split earlier (it drained): nothing new starts there now
            o.not_before = min(o.not_before, self._samples_count_from(master_id, now))
            self._ho.mark_gone(master_id)
        return self._recompute(now, time_ns)

    def master_refused(self, master_id: str) -> bool:
        """As :meth:`master_gone`, for an agent that does not take a refusal for death
        (``--no-gone-on-refusal``: a firewall may reject for a live master). The master stays in the
        split for its grace; only once its etcd key is gone as well (its lease expired: no process
        renews it, or one cut from etcd that has stopped admitting for itself) do its slots count as
        those of a gone master, set against the acked counts. Without that, engine samples under a
        steady stream of short requests would hold a killed master's slots until ``orphan_timeout``.
        """
        view = self.views.get(master_id)
        if view is None or view.connected or view.refused:
            return False
        view.refused = True  # (a view whose key is gone is dropped once its stream is down)
        return True

    def master_released(
        self, master_id: str, stream_id: int, now: float, time_ns: int, running: int = 0
    ) -> bool:
        """The master's etcd key names ``stream_id`` as released: that stream is gone, the master
        places nothing more here until a new stream brings a new grant, and its leases here run at
        most ``running`` slots. If it is the master's last stream and it is down here too, the master
        leaves the split at once and what it held beyond ``running`` is free (all of it at 0): no
        engine sample has to prove it. True when the word was taken: the first for that stream, or
        one with fewer slots running (the grants may have moved; a sample may have freed the slots
        already). A stale word (an older stream's, one read while the stream is up, or no news)
        changes nothing.
        """
        view = self.views.get(master_id)
        if view is None or view.connected or not stream_id or view.stream_id != stream_id or running < 0:
            return False
        if view.released is not None and running >= view.released:
            return False
        first = view.released is None
        view.released = running
        if first:
            self._recompute(now, time_ns)  # it leaves the split (it may still be in its grace)
        if self._ho.release(master_id, running):
            self._recompute(now, time_ns)
        return True

    def _left_for_good(self, master_id: str) -> bool:
        """Its requests here were cancelled or have ended: its process is gone, or it drained and
        revoked its key (it does so once its last leases ended, or as it exits). What it left
        reserved is then set against the acked counts (Handover.reconsider)."""
        view = self.views.get(master_id)
        if view is not None and (view.gone_at is not None or (view.refused and not view.in_etcd)):
            return True
        return master_id in self._draining and (view is None or not view.in_etcd)

    def _samples_count_from(self, master_id: str, now: float) -> float:
        """From when engine samples may release what a departed master held here: once it could have
        noticed that it lost its stream (``peer_detect_s`` after the stream was last up), or shortly
        after its process was found gone, whichever comes first."""
        last_up = self._last_up.get(master_id)
        at = last_up + self.peer_detect_s if last_up is not None else now
        view = self.views.get(master_id)
        if view is not None and view.gone_at is not None:
            at = min(at, view.gone_at + GONE_SAMPLE_DELAY_S)
        return at

    def on_ack(
        self,
        master_id: str,
        applied_epoch: int,
        active: int,
        wanted: int,
        now: float,
        time_ns: int,
        draining: bool = False,
        *,
        kept: int | None = None,
        answers_sent_at: float = -math.inf,
        floor: int | None = None,
        active_tokens: int | None = None,
        wanted_tokens: int | None = None,
        kept_tokens: int | None = None,
    ) -> bool:
        """A master's Ack: what it holds, runs and wants here. True when the grants changed.

        ``kept``: its kept_slots (None when the Ack has none); ``answers_sent_at``: when the Report
        it answers was sent. With them the latest engine sample is weighed again. ``floor``: its
        floor_slots (None: absent, ``--share-floor`` applies). ``active_tokens``, ``wanted_tokens``,
        ``kept_tokens``: their token counterparts; a master whose Acks carry no active_tokens (an
        earlier release) gets no token share, and its slots stand in for its token use.

        A master that drains with an empty queue leaves the split at once: it takes no new work, so
        its share can move to the others as its last leases end (reported in its next Acks).
        """
        if draining and wanted == 0:
            self._draining.add(master_id)
        elif not draining:
            self._draining.discard(master_id)
        h = self._ho.holders.get(master_id)
        before = (h.demand, h.floor) if h is not None else None
        aware = active_tokens is not None
        # Whether this master gets a token share changes: never under the same epoch (a master
        # refuses an equal epoch with another share), so the grants go out anew.
        flipped = self._tho is not None and self._token_aware.get(master_id, True) != aware
        self._token_aware[master_id] = aware
        self._token_acks[master_id] = (
            (active_tokens, wanted_tokens, kept_tokens) if active_tokens is not None else (None, None, None)
        )
        th = self._tho.holders.get(master_id) if self._tho is not None else None
        token_before = th.demand if th is not None else None
        self._token_ack(master_id, applied_epoch, active, wanted, draining, now, answers_sent_at, floor)
        if th is not None and th.demand != token_before:
            self._rebalance_due = True
        self._ho.ack(
            master_id,
            applied_epoch,
            active,
            wanted,
            draining,
            kept=kept,
            now=now,
            answers_sent_at=answers_sent_at,
            floor=floor,
        )
        if h is not None and (h.demand, h.floor) != before:
            self._rebalance_due = True
        if self._ho.orphans:  # the latest sample, weighed with this Ack
            self._ho.reconsider(self._reachable())
        return self._recompute(now, time_ns, force=flipped)

    def on_probe(self, running: int | None, taken_at: float, now: float, time_ns: int) -> bool:
        """The engine's running count from a sample started at ``taken_at`` (None: probe failed)."""
        self._ho.probe(running, taken_at, self._reachable(), done_at=now)
        return self._recompute(now, time_ns)

    def set_capacity(self, capacity: int, now: float, time_ns: int) -> bool:
        if capacity == self.capacity:
            return False
        self.capacity = capacity
        self._ho.capacity = capacity
        return self._recompute(now, time_ns, force=True)

    def set_kv_tokens(self, pool: int | None, now: float, time_ns: int) -> bool:
        """The node's KV pool in tokens changed (None or 0: it publishes none). A smaller pool is a
        capacity shrink: token grants shrink at once and grow back only as leases end. True when the
        grants changed (the epoch advanced)."""
        pool = pool or None
        if pool == self.kv_tokens:
            return False
        before = self.kv_tokens
        self.kv_tokens = pool
        if pool is None:
            self._tho, self._token_targets, self._token_shares = None, {}, {}
        elif before is None:
            self._start_tokens(pool, now)
        else:
            assert self._tho is not None
            self._tho.capacity = pool
        return self._recompute(now, time_ns, force=True)

    def _token_scale(self) -> float:
        """Tokens per slot on this node: what stands for the token use of a master that counts none."""
        return (self.kv_tokens or 0) / max(1, self.capacity)

    def _token_ack(
        self,
        master_id: str,
        applied_epoch: int,
        active: int,
        wanted: int,
        draining: bool,
        now: float,
        answers_sent_at: float,
        floor: int | None,
    ) -> None:
        """Feed the token handover a master's Ack. A master that counts tokens reports them; for one
        that does not (an earlier release) its slots stand in, scaled by pool / slots. Its floor: its
        slot floor scaled the same way."""
        tho = self._tho
        if tho is None:
            return
        scale = self._token_scale()
        t_active, t_wanted, t_kept = self._token_acks.get(master_id, (None, None, None))
        if t_active is None:
            # Rounded down: its token grant, a split of the pool, may be a fraction of a token below
            # its slots x scale, and rounding up would show it running more than it was granted.
            t_active, t_wanted, t_kept = math.floor(active * scale), math.floor(wanted * scale), None
        t_floor = None if floor is None else math.floor(floor * scale)
        tho.ack(
            master_id,
            applied_epoch,
            t_active,
            t_wanted or 0,
            draining,
            kept=t_kept,
            now=now,
            answers_sent_at=answers_sent_at,
            floor=t_floor,
        )

    def _sync_token_orphans(self) -> None:
        """Token reservations of departed masters go with their slot reservations: a lease holds a
        slot, so once none of a master's slots can be running here (its slot reservation is gone, and
        no pool it was cut into is left), none of its tokens can be either. The engine's KV usage
        cannot free them earlier: a lease is charged what the engine will reserve for it (its prompt
        and its output budget), more than it uses until its last token."""
        tho = self._tho
        if tho is None:
            return
        for name in list(tho.orphans):
            if name == STARTUP:
                if not any(self._ho.covers(c) for c in self._token_cover):
                    del tho.orphans[name]
            elif not self._ho.covers(name):
                del tho.orphans[name]

    def tick(self, now: float, time_ns: int) -> bool:
        """Apply timers (grace, rebalance, orphan timeout); True when the grants changed."""
        return self._recompute(now, time_ns)

    def restore_epoch(self, stored: int) -> None:
        """Seed from the last epoch persisted in etcd so a restarted agent keeps increasing."""
        self.epoch = max(self.epoch, stored)

    # -- views --------------------------------------------------------------------------------
    def _window(self, view: MasterView) -> float:
        return max(self.policy.grace, FIRST_CONNECT_MIN_S) if view.fresh else self.policy.grace

    def next_grace_deadline(self, now: float) -> float | None:
        """When the next grace window still open at ``now`` ends (so the caller can wake then).

        A window that has ended stays out: a dead master's view is kept while its key is in etcd
        (its lease has seconds to run), and listing its past deadline hid the next one, so a
        second master lost within that time left the split at the next engine sample, not after
        ``grace``.
        """
        ends = (
            v.down_since + self._window(v)
            for v in self.views.values()
            if v.in_etcd and not v.connected and v.down_since is not None and v.gone_at is None
        )
        return min((end for end in ends if end > now), default=None)

    def next_deadline(self, now: float) -> float | None:
        """The earliest timer after ``now`` of any kind (grace, rebalance, orphan timeout); those
        at or before ``now`` were applied by the last :meth:`tick` at ``now``."""
        times = [self.next_grace_deadline(now), self._ho.next_deadline(), self._next_rebalance_at(now)]
        if self._tho is not None:
            times.append(self._tho.next_deadline())
        return min((t for t in times if t is not None and t > now), default=None)

    def _next_rebalance_at(self, now: float) -> float | None:
        """When a rebalance could next move the targets (demand); None until a master's demand
        changes. An idle node's rebalance finds nothing to move, and waking for it every
        ``rebalance_interval`` was a thousand needless wake-ups a second in a thousand-node fleet."""
        if self.policy.policy != "demand" or not self._members:
            return None
        if self._rebalance_due:
            return self._next_rebalance
        ends = (self._joined[m] + self.join_prior_s for m in self._members if m in self._joined)
        window_end = min((end for end in ends if end > now), default=None)
        return None if window_end is None else max(self._next_rebalance, window_end)

    def members(self, now: float) -> tuple[str, ...]:
        out = []
        for mid, v in self.views.items():
            if not v.in_etcd:
                continue
            if mid in self._draining or v.gone_at is not None or v.released is not None:
                continue
            if v.connected or (v.down_since is not None and now - v.down_since < self._window(v)):
                out.append(mid)
        return tuple(sorted(out))

    @property
    def shares(self) -> Mapping[str, int]:
        """The grants: what each master may use now."""
        return self._shares

    @property
    def targets(self) -> Mapping[str, int]:
        """Where the grants are heading (equal to them once a handover completes)."""
        return self._targets

    @property
    def token_targets(self) -> Mapping[str, int]:
        return self._token_targets

    @property
    def token_shares(self) -> Mapping[str, int]:
        """The token grants (empty without a pool), including the reservations of masters that get
        none on the wire (an earlier release: their slots stand in)."""
        return self._token_shares

    @property
    def handover_pending(self) -> bool:
        """Some master waits for slots (or tokens) others still hold: Acks are worth asking for often."""
        if self._ho.pending(self._targets, self._shares):
            return True
        return self._tho is not None and self._tho.pending(self._token_targets, self._token_shares)

    @property
    def waits_for_engine(self) -> bool:
        """A master waits for slots that only an engine sample can free: those of a master that is
        gone (or of the agent's previous incarnation). Only then is sampling the engine often worth
        it; a join or a drain moves on by the masters' own Acks."""
        return self.handover_pending and self._ho.waits_for_sample(self._reachable())

    @property
    def waits_for_bracket(self) -> bool:
        """A sample can free slots of a master that may still be alive only with Acks just before and
        just after it: the live masters are worth polling around each sample."""
        return self.waits_for_engine and self._ho.waits_for_bracket(self._reachable())

    def _reachable(self) -> list[str]:
        return [m for m, v in self.views.items() if v.connected]

    def share_for(self, master_id: str) -> int:
        return self._shares.get(master_id, 0)

    def token_share_for(self, master_id: str) -> int | None:
        """The tokens this master may charge here under the current epoch; None when the node has no
        pool or the master's Acks carry no token counts (an earlier release: the grant then has no
        token share, as before)."""
        if self._tho is None or self._token_aware.get(master_id) is False:
            return None
        return self._token_shares.get(master_id, 0)

    def snapshot(self) -> dict[str, object]:
        out: dict[str, object] = {
            "handover": self.policy.handover,
            "share_policy": self.policy.policy,
            "members": list(self._members),
            "targets": dict(self._targets),
            "grants": dict(self._shares),
            "kv_tokens": self.kv_tokens,
        }
        out.update(self._ho.snapshot())
        if self._tho is not None:
            snap = self._tho.snapshot()
            out["tokens"] = {
                "targets": dict(self._token_targets),
                "grants": dict(self._token_shares),
                "free": snap["free"],
                "orphans": snap["orphans"],
                "bounds": snap["bounds"],
                # masters whose Acks carry no token counts (their slots stand in; no token share sent)
                "slots_only_masters": sorted(m for m in self._members if self._token_aware.get(m) is False),
            }
        return out

    # -- core ---------------------------------------------------------------------------------
    @property
    def join_prior_s(self) -> float:
        """How long after a master joins the split its demand counts as at least its even share.

        A new master has no queue yet, but a load balancer is about to send it its part of the
        clients (readiness probes run every few seconds). Starting it at the floor would cap its
        queue at a sliver of the node and refuse that first wave; an even start is what the static
        split gives, and the rebalance then follows the demand every master reports.
        """
        return max(JOIN_PRIOR_MIN_S, 3 * self.policy.rebalance_interval)

    def _dims(self) -> list[_Dim]:
        """The node's capacities: its slots, and its KV tokens when it has a pool."""
        out = [_Dim(self.capacity, self._ho, self._targets, 1.0)]
        if self._tho is not None and self.kv_tokens:
            out.append(_Dim(self.kv_tokens, self._tho, self._token_targets, self._token_scale()))
        return out

    def _ideal(self, members: tuple[str, ...], now: float, dim: _Dim | None = None) -> dict[str, int]:
        """The demand split now. A master in its join window wants at least its even share; the
        others keep following what they report (an idle one still gives its slots to a busy one
        meanwhile), and while a window is open the slots nobody asks for top the others up towards
        their even shares, so an idle node splits exactly evenly (see :func:`demand_shares`). So do
        they on a node where no master asks for anything: the floors (one slot on each master's anchor
        node) would otherwise tilt an idle node's split by a slot or two. Tokens split the same way by
        token demand (active + wanted tokens), with each master's slot floor scaled by pool / slots."""
        dim = dim or self._dims()[0]
        hs = dim.ho.holders
        demands = {m: (hs[m].demand if m in hs else 0) for m in members}
        new = [m for m in members if now < self._joined.get(m, now) + self.join_prior_s]
        if new:
            even = slice_shares(dim.capacity, members, self.node_id)
            for m in new:
                demands[m] = max(demands[m], even[m])
        idle = not any(demands.values())
        floors = {m: math.floor(f * dim.scale) for m, f in self._floors(members).items()}
        return demand_shares(dim.capacity, demands, self.node_id, floors, top_up=bool(new) or idle)

    def _floors(self, members: tuple[str, ...]) -> dict[str, int]:
        """Each member's floor: what its Acks ask to keep here (floor_slots), else ``--share-floor``."""
        hs = self._ho.holders
        out = {}
        for m in members:
            asked = hs[m].floor if m in hs else None
            out[m] = self.policy.floor if asked is None else asked
        return out

    def _must_move(self, members: tuple[str, ...], ideal: Mapping[str, int], dim: _Dim | None = None) -> bool:
        """Whether the split moves now however small the move (the hysteresis only keeps a wobble of
        demand from moving slots back and forth): a master with nothing here should have something,
        or slots that a master holds but does not use (nothing of it queued, fewer leases running
        than its target) should go to a master whose requests wait for them. On small engines the
        hysteresis is a large part of a node, and such slots would stay idle until the demand moved
        further. And a node where nobody asks for anything goes back to its even split."""
        dim = dim or self._dims()[0]
        t = dim.targets
        if any(t.get(m, 0) == 0 < ideal[m] for m in members):
            return True
        hs = dim.ho.holders
        if all(hs[m].demand == 0 for m in members if m in hs) and any(
            t.get(m, 0) != ideal[m] for m in members
        ):
            return True  # an idle node goes back to its even split, however small the move
        waiting = idle = False
        for m in members:
            h = hs.get(m)
            if h is None:
                continue
            have = t.get(m, 0)
            if h.wanted > 0 and ideal[m] > have:
                waiting = True
            elif h.wanted == 0 and h.active < have and ideal[m] < have:
                idle = True
        return waiting and idle

    def _compute_targets(self, members: tuple[str, ...], now: float, reset: bool) -> dict[str, int]:
        """The slot targets (the token targets, when the node has a pool, are set beside them: one
        rebalance clock and one epoch for both)."""
        dims = self._dims()
        out: list[Mapping[str, int]]
        if self.policy.policy == "static":
            out = [slice_shares(d.capacity, members, self.node_id) for d in dims]
        elif reset or set(self._targets) != set(members):
            self._next_rebalance = now + self.policy.rebalance_interval
            self._rebalance_due = False
            out = [self._ideal(members, now, d) for d in dims]
        elif now < self._next_rebalance:
            out = [d.targets for d in dims]
        else:
            self._next_rebalance = now + self.policy.rebalance_interval
            self._rebalance_due = False
            out = []
            for d in dims:
                ideal = self._ideal(members, now, d)
                hysteresis = max(1, math.ceil(self.policy.rebalance_hysteresis * d.scale))
                if set(d.targets) != set(members) or (
                    not self._must_move(members, ideal, d)
                    and max((abs(ideal[m] - d.targets.get(m, 0)) for m in members), default=0) < hysteresis
                ):
                    out.append(ideal if set(d.targets) != set(members) else d.targets)
                    continue
                step = max(hysteresis, math.ceil(d.capacity * self.policy.rebalance_max_step))
                stepped = step_towards(d.targets, ideal, step)
                # part of the way: the next rebalance goes on
                self._rebalance_due = self._rebalance_due or stepped != ideal
                out.append(stepped)
        if len(dims) > 1:
            self._token_targets = dict(out[1])
        else:
            self._token_targets = {}
        return dict(out[0])

    def _recompute(self, now: float, time_ns: int, force: bool = False) -> bool:
        members = self.members(now)
        for mid, view in self.views.items():
            if view.connected:
                self._last_up[mid] = now
        membership = members != self._members or not self.epoch
        tho = self._tho
        if membership:
            for mid in set(self._members) - set(members):
                # A master that left by its etcd key while its stream was up (or only just went
                # down) may not have noticed yet that it lost this node.
                not_before = self._samples_count_from(mid, now)
                draining = mid in self._draining
                self._ho.exclude(mid, now, self.epoch, now if draining else not_before, draining)
                if tho is not None:
                    tho.exclude(mid, now, self.epoch, now, draining)
                if self._left_for_good(mid):
                    self._ho.mark_gone(mid)
            for mid in members:
                self._ho.include(mid)
                if tho is not None:
                    tho.include(mid)
            old = set(self._members)
            self._joined = {m: (self._joined[m] if m in old else now) for m in members}
        self._ho.expire(now, members)
        if tho is not None:
            tho.expire(now, members)
            self._sync_token_orphans()
        self._targets = self._compute_targets(members, now, reset=membership or force)
        grants = self._ho.plan(self._targets, self._shares)
        token_grants = tho.plan(self._token_targets, self._token_shares) if tho is not None else {}
        if grants == self._shares and token_grants == self._token_shares and not membership and not force:
            return False
        self._members = members
        self._shares = grants
        self._token_shares = token_grants
        self.epoch = next_epoch(self.epoch, time_ns)
        self._ho.issue(self.epoch, grants)
        if tho is not None:
            tho.issue(self.epoch, token_grants)
        return True


@dataclass
class _Dim:
    """One capacity of a node as the split sees it: slots, or KV tokens (``scale``: per slot)."""

    capacity: int
    ho: Handover
    targets: Mapping[str, int]
    scale: float
