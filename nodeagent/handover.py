"""Strict handover: turn target shares into grants that never oversubscribe a node (DESIGN §4).

Pure and clock-free like the rest of the agent's core: the caller passes ``now`` and feeds it the
masters' Acks and the engine's running count. The rule is *shrink before grow*: a master's grant is
lowered at once, but the slots it gave up count as used until that master has acknowledged the lower
grant (``Ack.applied_epoch``) and reports fewer ``active_slots``. A grant is raised only by slots
that are free in that conservative view, so at every moment

    Σ over masters of max(share it may hold, leases it runs)  ≤  running_max_req_size.

A master that leaves the split (its stream is gone, or its etcd key) can no longer place work here,
but its leases may still be running: its last known bound stays reserved as an *orphan* until it
comes back and reports, until the engine's own running count shows that nothing beyond the live
masters' leases is running, or until ``orphan_timeout_s``. A freshly started agent knows nothing of
leases granted by its previous incarnation, so it starts with the whole node reserved as an orphan
and lets the first engine sample (or, without a probe, the live masters' first Acks) release it.

How a sample is weighed (``reconsider``). What the orphans may still run is at most the engine's
count minus what the live masters surely ran at that moment. Their acked active slots are not that:
an Ack older than the end of some of a master's leases counts leases the engine no longer runs, and
set against them a sample freed slots that a cut-off master's requests still used (the protocol
model found it once its leases lasted as long as decodes). So a master sends in every Ack the leases
it kept since its previous Ack (``kept_slots``: slots now minus those granted since), and for an
orphan of a master that may be alive a sample counts, per live master, only what it kept between an
Ack that came in before the sample started and the answer to a Report sent after it came back: those
leases ran throughout. The agent asks for those two Acks around each sample while such an orphan
waits (``NodeAgent._probe_loop``). Leases granted between them count for nothing, so under a steady
stream of short requests the last few slots of a cut-off master can stay reserved until a round sees
no turnover, the master comes back, or ``orphan_timeout_s``. Orphans of masters found gone, or that
drained and revoked their key, are still set against the acked counts: their requests were cancelled
or have ended, and that keeps a killed master's failover one sample long. A sample bounds what the
orphans it weighs run together, not each one, and the cut goes in name order, so what is left of one
may cover another's leases: when one of them then goes alone (its master came back, or said what it
still runs), its slots stay reserved under the pool's name until a sample frees them.

A master that is alive but lost its stream (a network cut) stops placing work here as soon as it
notices, and then names that stream in its etcd key as released (``Register.stream_id``) with the
slots its leases here still run, again as they end; the agent shrinks its orphan to that at once
(``release``), without a sample, and drops it at 0: the word covers one stream, so an older stream's
word, or one for a stream still up here, is no proof.

A lease's end. The engine stops counting a decode at its last token, whatever the client reads; the
master releases a streamed lease as soon as it has read the engine's answer whole (not once a slow
client has it all), and a lease whose answer it stopped reading for a slow client no longer counts in
``kept_slots`` (``AdmissionCore.end_unseen``): the engine may finish it unseen. What is left is the
moment between the engine's count dropping and its last bytes reaching the master; the Report that
closes a bracket goes ``END_SEEN_S`` after the sample for that.

A lease's start. A sample counts every request the engine holds, those still waiting for their KV
included (running + waiting: SGLang's decode server keeps them in its prealloc and transfer queues),
and a master counts a lease in ``kept_slots`` only from the moment its decode request went out (with
SGLang's protocol right after the grant, with vLLM's after the prefill: ``AdmissionCore.decode_sent``).
A sample is taken ``START_SEEN_S`` after the Acks that open its bracket came in, so that what a master
sent before its Ack is in the engine's queues by then.

Tokens (DESIGN §13). A node with a KV pool runs a second Handover over its tokens, planned the same
way and issued under the same epochs (``Slicer``): a master's token bound is max(token grant it may
hold, the active_tokens of its last Ack), shrink before grow. That instance is never sampled: no engine
count tells whose tokens are in use, and the engine's KV usage is no bound on what leases are charged
(a lease is charged its prompt and its whole output budget, and uses less until its last token). A
departed master's tokens stay reserved for as long as the slot handover may still see its leases
running (its slot orphan, or a pool that orphan was cut into: :meth:`Handover.covers`); every lease
holds a slot, so once none of its slots can be running, none of its tokens can either. So the token
reservations go with the masters' own Acks (a returning master's, or one that applied a later grant),
the released word (at 0 leases), the engine samples that free the slots, and ``orphan_timeout_s``.
A master whose Acks carry no active_tokens (an earlier release) gets no token share on the wire; its
slots, scaled by pool / slots, stand in for its token use.

Known gap. Masters of an earlier release send no ``kept_slots``; their acked counts stand in as
before, so with them the stale-Ack case above remains (pinned by the ``known_gap`` tests); they hold a
lease until a slow client has its answer, and count it from its grant, while it may still be in its
prefill and unknown to the decode engine (under vLLM's protocol), and such a master still sends a
lease's decode request after its prefill to a node whose stream it lost meanwhile, which no sample can
see coming (this release's masters refuse to: ``pdmaster.pipeline._still_held``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

STARTUP = "(startup)"
# How much later than an engine sample the Report whose Ack closes its bracket is sent. A master
# learns that a decode ended when the engine's last bytes reach it, a moment after the engine
# stopped counting it: an Ack built sooner could still count that lease as running at the sample.
END_SEEN_S = 0.05
# How much later than the Ack that opens a bracket its engine sample is taken: a decode request the
# master sent before that Ack has then reached the engine's queues (a delivery, and the engine's
# scheduler loop taking it in), so the sample counts every lease the Ack's kept_slots may count.
START_SEEN_S = 0.1
# Grants kept per master while unacknowledged; older ones are merged (keeping the larger share).
_MAX_ISSUED = 16


@dataclass
class Holder:
    """What the agent knows of one master in the split."""

    # Grants sent (or about to be sent) that the master may still hold: (epoch, share), oldest first.
    issued: list[tuple[int, int]] = field(default_factory=list)
    applied_epoch: int = 0
    active: int = 0
    wanted: int = 0
    acked: bool = False
    # Ack.kept_slots of the last Ack: leases held since the Ack before it. None: this master never
    # sent it (an earlier release), and its acked active slots stand in as before.
    kept: int | None = None
    acked_at: float = -math.inf  # when the last Ack came in
    prev_acked_at: float = math.inf  # when the Ack before it came in
    answers_sent_at: float = -math.inf  # when the Report the last Ack answers was sent
    # Ack.floor_slots of the last Ack: what it asks to keep here whatever its demand. None: absent
    # (an earlier release), the agent's --share-floor applies.
    floor: int | None = None

    @property
    def hold(self) -> int:
        return max((s for _, s in self.issued), default=0)

    @property
    def bound(self) -> int:
        """Most slots this master may be using on the node now."""
        return max(self.hold, self.active)

    @property
    def demand(self) -> int:
        return self.active + self.wanted


@dataclass
class Orphan:
    slots: int
    since: float
    epoch: int  # the node epoch when it left: a later applied_epoch means it saw its grant of 0
    # Engine samples before this time cannot release it (see ``startup_wait_s``).
    not_before: float = 0.0
    # Its requests were cancelled or have ended (its process is gone, or it drained and revoked its
    # key): the live masters' acked counts may be set against a sample as they are (``reconsider``).
    gone: bool = False
    # Set when a sample cut it together with other orphans (``_cut``): what is left of them covers
    # all their leases together, not each its own, so none of it may go with this one alone.
    pool: int | None = None


@dataclass(frozen=True)
class _Pool:
    """Orphans one sample cut together: the latest of their times and whether all were gone."""

    since: float
    not_before: float
    gone: bool


@dataclass(frozen=True)
class Sample:
    """An engine sample: ``running`` requests, started at ``taken_at``, answered at ``done_at``."""

    running: int
    taken_at: float
    done_at: float


class Handover:
    """Tracks what each master may use on one node and plans grants that respect the capacity."""

    def __init__(
        self,
        capacity: int,
        *,
        strict: bool = True,
        orphan_timeout_s: float = 30.0,
        probe: bool = True,
        now: float = 0.0,
        startup_wait_s: float = 1.0,
    ) -> None:
        self.capacity = capacity
        self.strict = strict
        self.orphan_timeout_s = orphan_timeout_s
        self.probe_expected = probe
        self.probe_failing = False
        self.holders: dict[str, Holder] = {}
        self.orphans: dict[str, Orphan] = {}
        self.sample: Sample | None = None  # the latest; Acks that bracket it may release more
        self._pools: dict[int, _Pool] = {}
        self._pool_ids = 0
        # The pool each orphan was last cut into, kept after the orphan is gone (see :meth:`covers`).
        self._pool_of: dict[str, int] = {}
        if strict:
            # Masters still attached to the previous incarnation keep their shares until they notice
            # its streams are gone, which their keep-alive does within ``startup_wait_s``.
            self.orphans[STARTUP] = Orphan(capacity, now, 0, now + startup_wait_s)

    def extend_startup_wait(self, seconds: float) -> None:
        """A master may take longer than ``startup_wait_s`` to notice the previous incarnation's
        streams are gone: samples release the startup reservation that much later."""
        startup = self.orphans.get(STARTUP)
        if startup is not None:
            startup.not_before += seconds

    # -- membership ---------------------------------------------------------------------------
    def include(self, master_id: str) -> None:
        self.holders.setdefault(master_id, Holder())

    def exclude(
        self, master_id: str, now: float, epoch: int, not_before: float = 0.0, draining: bool = False
    ) -> None:
        """The master left the split; what it may still use stays reserved.

        ``not_before``: until then the master may not yet know that it lost this node (its stream
        was up until recently), so it may still place work here; no engine sample taken earlier
        can release its slots. ``draining``: the master said it drains with an empty queue, so it
        will never run more than the leases it reported; its share no longer counts.
        """
        h = self.holders.pop(master_id, None)
        if h is None or not self.strict:
            return
        slots = h.active if draining else h.bound
        old = self.orphans.get(master_id)
        pool = None
        if old is not None:
            slots = max(slots, old.slots)
            not_before = max(not_before, old.not_before)
            pool = old.pool
        if slots > 0:
            self.orphans[master_id] = Orphan(slots, now, epoch, not_before, pool=pool)

    def mark_gone(self, master_id: str) -> None:
        """The departed master's requests were cancelled or have ended (Slicer._left_for_good)."""
        o = self.orphans.get(master_id)
        if o is not None:
            o.gone = True

    def hold_orphan(self, master_id: str, not_before: float) -> None:
        """No engine sample taken before ``not_before`` may release this master's orphan."""
        o = self.orphans.get(master_id)
        if o is not None:
            o.not_before = max(o.not_before, not_before)

    # -- inputs -------------------------------------------------------------------------------
    def ack(
        self,
        master_id: str,
        applied_epoch: int,
        active: int,
        wanted: int,
        draining: bool = False,
        *,
        kept: int | None = None,
        now: float | None = None,
        answers_sent_at: float = -math.inf,
        floor: int | None = None,
    ) -> None:
        """``kept``: the Ack's kept_slots (None when absent); ``now``: when it came in;
        ``answers_sent_at``: when the Report it answers was sent (-inf: not known); ``floor``: its
        floor_slots (None when absent)."""
        h = self.holders.get(master_id)
        if h is None:
            o = self.orphans.get(master_id)
            # Still talking after it left: once it applied a grant issued after it left (which was
            # 0), or while it drains with nothing queued, only its running leases count.
            if o is not None and (applied_epoch > o.epoch or (draining and wanted == 0)):
                self._unpool(o, o.slots - min(o.slots, active))
                o.slots = min(o.slots, active)
                if o.slots == 0:
                    del self.orphans[master_id]
            return
        # The master holds the grant of ``applied_epoch``: drop what it superseded, keep what may
        # still be on the way.
        keep_from = 0
        for i, (e, _) in enumerate(h.issued):
            if e <= applied_epoch:
                keep_from = i
        del h.issued[:keep_from]
        h.applied_epoch = max(h.applied_epoch, applied_epoch)
        h.active, h.wanted, h.acked = active, wanted, True
        h.kept = None if kept is None else min(kept, active)
        h.floor = floor
        if now is not None:
            h.prev_acked_at, h.acked_at = h.acked_at, now
        h.answers_sent_at = answers_sent_at
        # A returning master reports the truth: what was reserved for it is now its bound.
        o = self.orphans.pop(master_id, None)
        if o is not None:
            self._unpool(o, o.slots)

    def release(self, master_id: str, running: int = 0) -> bool:
        """The master said that it places nothing more here and runs at most ``running`` slots here
        (its etcd key names the stream it lost as released): its orphan shrinks to that, and goes at 0.
        True if it shrank."""
        o = self.orphans.get(master_id)
        if o is None or o.slots <= running:
            return False
        self._unpool(o, o.slots - running)
        o.slots = running
        if running == 0:
            del self.orphans[master_id]
        return True

    def probe(
        self,
        running: int | None,
        taken_at: float,
        reachable: Iterable[str] = (),
        done_at: float | None = None,
    ) -> None:
        """An engine sample started at ``taken_at`` and answered at ``done_at``; ``None`` when the
        probe failed.

        Orphans of masters still connected (``reachable``: a draining master finishing its last
        leases) are left to their own Acks, which are exact; the engine's count cannot tell whose
        requests are running, so it may only release the others, all together. The sample is kept:
        Acks that arrive later and bracket it (:meth:`reconsider`) may release more.
        """
        self.probe_failing = running is None
        if running is None:
            return
        self.sample = Sample(running, taken_at, taken_at if done_at is None else done_at)
        self._release(reachable, at_sample=True)

    def reconsider(self, reachable: Iterable[str] = ()) -> None:
        """Acks came in after the latest sample: those that bracket it may release more."""
        self._release(reachable, at_sample=False)

    def _release(self, reachable: Iterable[str], at_sample: bool) -> None:
        """Release what the latest sample shows free, with what is known of the live masters.

        What the orphans of masters that may be alive still run is at most the sample's count minus
        what the live masters surely ran at it (:meth:`_surely_running`). Orphans of masters found
        gone (their requests were cancelled with their connections) are set against the live
        masters' acked active slots instead, as all orphans were before masters sent kept_slots: an
        Ack older than some of a master's lease ends over-counts it, which can free slots that a
        cut-off master's requests still use (the known gap above) but not a dead one's.
        """
        s = self.sample
        if s is None or not self.orphans:
            return
        if any(o.since > s.taken_at or o.not_before > s.taken_at for o in self.orphans.values()):
            return  # an orphan newer than the sample: the sample may predate its leases ending
        candidates = self._releasable(reachable)
        surely = sum(self._surely_running(h, s, at_sample) for h in self.holders.values())
        alive = [m for m in candidates if not self._gone(self.orphans[m])]
        self._cut(alive, max(0, s.running - surely))
        if at_sample:
            gone = [m for m in candidates if m in self.orphans and self._gone(self.orphans[m])]
            others = sum(self.orphans[m].slots for m in alive if m in self.orphans)
            acked = sum(h.active for h in self.holders.values())
            self._cut(gone, max(0, s.running - acked - others))

    def _gone(self, o: Orphan) -> bool:
        """Its requests were cancelled or have ended: set against the acked counts. Not while it is
        in a pool with orphans of masters that may be alive, whose leases what is left may cover."""
        return o.gone and (o.pool is None or self._pools[o.pool].gone)

    @staticmethod
    def _surely_running(h: Holder, s: Sample, at_sample: bool) -> int:
        """Slots this live master surely ran at sample ``s``. One that sends kept_slots: its kept
        leases once its last two Acks bracket the sample (the one before came in START_SEEN_S before
        the sample started, the last answers a Report sent END_SEEN_S after it came back), else
        nothing. One of an
        earlier release: its acked active slots, when the sample is new (as before; see the known
        gap), and nothing when weighing an older sample again."""
        if h.kept is None:
            return h.active if at_sample else 0
        if h.prev_acked_at + START_SEEN_S <= s.taken_at and h.answers_sent_at >= s.done_at + END_SEEN_S:
            return h.kept
        return 0

    def _cut(self, mids: list[str], cap: int) -> None:
        """Lower these orphans, in order, until together they fit in ``cap``. Several cut together
        form a pool: the sample bounds what they all run, not what each does (see :meth:`_unpool`)."""
        total = sum(self.orphans[m].slots for m in mids)
        if total > cap and len(mids) > 1:
            members = [self.orphans[m] for m in mids]
            for o in members:
                o.pool = None
            live = {o.pool for o in self.orphans.values()}
            self._pools = {i: p for i, p in self._pools.items() if i in live}  # the rest are done
            self._pool_ids += 1
            since, not_before = max(o.since for o in members), max(o.not_before for o in members)
            self._pools[self._pool_ids] = _Pool(since, not_before, all(o.gone for o in members))
            for o in members:
                o.pool = self._pool_ids
            # What is left of an earlier pool now goes on in this one: so do those it covered.
            merged = {self._pool_of[m] for m in mids if m in self._pool_of}
            for m, p in self._pool_of.items():
                if p in merged:
                    self._pool_of[m] = self._pool_ids
            for m in mids:
                self._pool_of[m] = self._pool_ids
        for mid in mids:
            if total <= cap:
                break
            o = self.orphans[mid]
            cut = min(o.slots, total - cap)
            o.slots -= cut
            total -= cut
            if o.slots == 0:
                del self.orphans[mid]

    def _unpool(self, o: Orphan, slots: int) -> None:
        """``slots`` of a pooled orphan leave it on their own (its master came back, or said what it
        still runs): after the cut they may cover another member's leases, so they stay reserved,
        under the pool's own name, until a sample or the timeout frees them."""
        if o.pool is None or slots <= 0:
            return
        p = self._pools[o.pool]
        key = f"(pool {o.pool})"
        kept = self.orphans.get(key)
        if kept is not None:
            kept.slots += slots
        else:
            self.orphans[key] = Orphan(slots, p.since, 0, p.not_before, gone=p.gone, pool=o.pool)

    def covers(self, name: str) -> bool:
        """Whether what is reserved may still cover leases of ``name`` (a master, or STARTUP): its own
        orphan, or, once a sample cut it together with others, any orphan left of that pool (what is
        left of one may cover another's leases). False: none of its leases can still run here."""
        if name in self.orphans:
            return True
        pool = self._pool_of.get(name)
        if pool is None:
            return False
        if any(o.pool == pool for o in self.orphans.values()):
            return True
        del self._pool_of[name]
        return False

    def waits_for_bracket(self, reachable: Iterable[str]) -> bool:
        """Some reserved slots of a master that may be alive wait for a sample that the live
        masters' Acks bracket (see :meth:`reconsider`): worth polling them around each sample."""
        return any(not self._gone(self.orphans[m]) for m in self._releasable(reachable))

    def expire(self, now: float, members: Iterable[str]) -> bool:
        """Release orphans past the timeout, and the startup reservation once it is known."""
        changed = False
        for mid, o in list(self.orphans.items()):
            if now - o.since >= self.orphan_timeout_s:
                del self.orphans[mid]
                changed = True
        ms = list(members)
        if (
            STARTUP in self.orphans
            and (not self.probe_expected or self.probe_failing)
            and ms
            and all(self.holders.get(m, Holder()).acked for m in ms)
        ):
            # Without a working probe the live masters' Acks are all we know; a master still bound
            # to the previous incarnation cannot register (and ack) here until it let go of it.
            del self.orphans[STARTUP]
            changed = True
        return changed

    def next_deadline(self) -> float | None:
        return min((o.since + self.orphan_timeout_s for o in self.orphans.values()), default=None)

    # -- planning -----------------------------------------------------------------------------
    def orphan_slots(self) -> int:
        return sum(o.slots for o in self.orphans.values())

    def free(self) -> int:
        return self.capacity - sum(h.bound for h in self.holders.values()) - self.orphan_slots()

    def plan(self, targets: Mapping[str, int], grants: Mapping[str, int]) -> dict[str, int]:
        """New grants for the masters in ``targets``: shrink at once, grow only into free slots."""
        if not self.strict:
            return dict(targets)
        new = {m: min(t, grants.get(m, 0)) for m, t in targets.items()}
        free = self.free()
        # Largest shortfall first, so a joining master is not starved by small top-ups.
        growers = sorted(
            (m for m, t in targets.items() if t > new[m]), key=lambda m: (new[m] - targets[m], m)
        )
        for m in growers:
            if free < 0:
                # The reservations overlap (an orphan's bound may count leases a live master also
                # reports): only what ends frees anything.
                break
            bound = self.holders[m].bound if m in self.holders else 0
            # Slots up to its current bound are already counted as used by it: a master whose leases
            # run beyond its grant (one that came back) is raised to them with nothing free, so that
            # it may replace them as they end (every bound, orphans included, still fits).
            raised = min(targets[m], max(new[m], bound + free))
            free -= max(0, raised - max(bound, new[m]))
            new[m] = raised
        return new

    def issue(self, epoch: int, grants: Mapping[str, int]) -> None:
        """Record the grants sent with ``epoch`` (to every master in the split)."""
        for mid, h in self.holders.items():
            share = grants.get(mid, 0)
            if h.issued and h.issued[-1][1] == share:
                continue
            h.issued.append((epoch, share))
            if len(h.issued) > _MAX_ISSUED:
                (e0, s0), (_, s1) = h.issued[0], h.issued[1]
                h.issued[:2] = [(e0, max(s0, s1))]

    def _releasable(self, reachable: Iterable[str]) -> list[str]:
        """Orphans an engine sample may release: those of masters no longer reachable (a reachable
        one's own Acks are exact), in a fixed order."""
        near = set(reachable)
        return sorted(m for m in self.orphans if m not in near)

    def waits_for_sample(self, reachable: Iterable[str]) -> bool:
        """Some reserved slots can be released only by an engine sample (see :meth:`probe`)."""
        return bool(self._releasable(reachable))

    def pending(self, targets: Mapping[str, int], grants: Mapping[str, int]) -> bool:
        return any(grants.get(m, 0) < t for m, t in targets.items())

    def snapshot(self) -> dict[str, object]:
        return {
            "mode": "strict" if self.strict else "fast",
            "free": self.free(),
            "orphans": {m: o.slots for m, o in sorted(self.orphans.items())},
            "bounds": {m: h.bound for m, h in sorted(self.holders.items())},
        }
