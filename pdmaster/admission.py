"""Decode-capacity admission: a pure, synchronous, clock-injected state machine (DESIGN §6).

The core decides; the caller does the I/O. Every public call returns (and stores in
``last_changes``) the tickets whose state changed during the call, so an adapter can wake exactly the
affected waiters without scanning anything. Refusals carry a reason *code* and a retry hint; what a
code means to a client (HTTP status, message) is the adapter's business.

:class:`AdmissionCore` orchestrates; each concept lives in the module named after it:

* ``pdmaster.ticket``: request classes, the ticket and its states, the outcome codes;
* ``pdmaster.admission_policy``: the tunables;
* ``pdmaster.admission_queue``: ordering inside a class (FIFO queues, sessions, eligible heads);
* ``pdmaster.drr``: fairness between classes (deficit round robin, charged in slots);
* ``pdmaster.backfill``: the gang DRR picked that does not fit, its backfill budget and reservation;
* ``pdmaster.placement``: the node ledger, where capacity is a vector (slot and KV-token shares, full
  capacity and pools, what the leases hold, the free-room heaps) and where a lease is placed;
* ``pdmaster.ack_ledger``: strict-handover bookkeeping for the Acks (in decode, unseen, kept);
* ``pdmaster.wait_estimate``: completion rate, expected wait and the peers' pooled load.

Capacity is a vector (DESIGN §13): a ticket may charge KV tokens beside its slots
(``submit(..., tokens=)``) and a node may have a token share (``set_shares(..., token_shares=)``); a
node without one has no token limit. Only placement and the wait estimate look at tokens; DRR stays
charged in slots, and a ticket that fits no node now in slots *or* tokens is blocked as a gang is
(backfill, then a reservation).

The cost of a decision does not grow with the queue: what joins and leaves in arrival order (most
tickets) costs O(1) amortized, the rest O(log n), and nothing scans. Queued *resubmissions*
(``submit(..., avoid=, deadline=)``: a request retried after its engine failed it) are a short list
here: a resubmission already won its turn once and was charged for it, so it keeps its class and its
absolute deadline and goes before every first-time waiter; it is never placed on a node it
``avoid``s (the one that failed it) and, while only such nodes have room, waits without holding
anyone else up. Looking past the avoided nodes pops at most ``len(avoid)`` live entries off the
node heap; a request without ``avoid`` pays nothing for this.

A process that was frozen (SIGSTOP, a paused VM, a starved cgroup) wakes up believing in shares
the agents may have handed on meanwhile: they cut its streams while it did not answer, and the
stream ends are only read after it runs again. ``watch_pauses`` makes the core place nothing for a
while after such a pause, so those ends are seen before anything else is placed (see
``pdmaster.pausewatch``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pdmaster.ack_ledger import AckLedger
from pdmaster.admission_policy import MIN_TARGET_WAIT_S, AdmissionPolicy
from pdmaster.admission_queue import ClassQueue, Session
from pdmaster.backfill import Backfill, SizeHeap
from pdmaster.drr import DeficitRoundRobin
from pdmaster.placement import Placement, check_shares
from pdmaster.ticket import (
    CANCELLED,
    CANNOT_FIT_NOW,
    CLASS_ORDER,
    EVICTED,
    EXPECTED_WAIT,
    FINAL_CODES,
    GRANTED,
    HANDED_OFF,
    INVALID,
    LOC_GANG,
    LOC_HEAD,
    LOC_NOWHERE,
    LOC_RETRY,
    LOC_WAIT,
    NO_AVOID,
    NO_CAPACITY,
    OUTCOMES,
    QUEUE_FULL,
    RANK,
    TIMEOUT,
    TOO_MANY_TOKENS,
    UNSATISFIABLE,
    Reason,
    RequestClass,
    Ticket,
    TicketState,
)
from pdmaster.wait_estimate import PEER_LOAD_TTL_S, RATE_MIN_RELEASES, PeerLoad, WaitEstimate, rounded

__all__ = [
    "CANCELLED",
    "CANNOT_FIT_NOW",
    "CLASS_ORDER",
    "EVICTED",
    "EXPECTED_WAIT",
    "GRANTED",
    "HANDED_OFF",
    "INVALID",
    "MIN_TARGET_WAIT_S",
    "NO_CAPACITY",
    "OUTCOMES",
    "PEER_LOAD_TTL_S",
    "QUEUE_FULL",
    "RATE_MIN_RELEASES",
    "TIMEOUT",
    "TOO_MANY_TOKENS",
    "UNSATISFIABLE",
    "AdmissionCore",
    "AdmissionPolicy",
    "PeerLoad",
    "Reason",
    "RequestClass",
    "Ticket",
    "TicketState",
]

# Module constants: enum attribute access is slow in the hot path.
_QUEUED = TicketState.QUEUED
_GRANTED = TicketState.GRANTED
_REJECTED = TicketState.REJECTED
_EXPIRED = TicketState.EXPIRED
_CANCELLED = TicketState.CANCELLED
_EVICTED = TicketState.EVICTED
_CONT = RequestClass.CONTINUATION
_NOWHERE = LOC_NOWHERE
_HEAD = LOC_HEAD
_WAIT = LOC_WAIT
_GANG = LOC_GANG
_RETRY = LOC_RETRY
_NO_AVOID = NO_AVOID


class AdmissionCore:
    """Bounded, fair, gang-aware admission in front of this master's decode shares."""

    def __init__(self, policy: AdmissionPolicy | None = None, *, clock: Callable[[], float]) -> None:
        self.policy = policy or AdmissionPolicy()
        self._clock = clock
        self._bypass = self.policy.bypass
        tw = self.policy.target_wait_s or {}
        # inf: no target for the class. A target also caps the class's wait timeout: a waiter that
        # has already missed it holds a client for nothing.
        self._targets = {c: float(tw.get(c, 0)) or math.inf for c in CLASS_ORDER}
        # What a granted request still waits after this queue before its engine work starts (two-stage
        # admission's decode stage, ``pdmaster.staged_admission``): part of the wait the target bounds.
        self.later_wait_s = 0.0
        self._waits = {c: min(float(self.policy.max_wait_s[c]), self._targets[c]) for c in CLASS_ORDER}
        # nodes: shares and what runs there; the Acks' bookkeeping
        self._placement = Placement()
        self._ledger = AckLedger()
        self._masters = 0  # live masters in the cluster (0: unknown)
        self._bound = 0
        self._retries: list[Ticket] = []  # queued resubmissions, oldest first
        # queue
        self._seq = 0
        self._queues: dict[RequestClass, ClassQueue] = {c: ClassQueue(c) for c in CLASS_ORDER}
        self._qlist = [self._queues[c] for c in CLASS_ORDER]  # indexed like CLASS_ORDER
        self._gangs = SizeHeap()  # queued tickets of more than one slot, by slots
        self._token_heap = SizeHeap()  # queued tickets with a token charge, by tokens
        self._queued_n = 0
        self._queued_slots = 0
        self._queued_tokens = 0
        self._sessions: dict[str, Session] = {}
        # fairness between classes; the gang DRR picked that does not fit
        self._drr = DeficitRoundRobin(self.policy.weights)
        self._weights = self._drr.weights
        self._bf = Backfill()
        # bookkeeping
        self._outcomes: dict[RequestClass, dict[str, int]] = {
            c: dict.fromkeys(OUTCOMES, 0) for c in CLASS_ORDER
        }
        self._estimate = WaitEstimate(self.policy.rate_window_s, self._weights, self._queues, self._placement)
        self._changes: list[Ticket] = []
        self._idle_ver = -1  # see _pump
        self._now = 0.0
        self.last_changes: list[Ticket] = []
        # pause guard (watch_pauses): no placement before _hold_until
        self._resumed_at: Callable[[float], float] | None = None
        self._pause_hold_s = 0.0
        self._hold_until = -math.inf
        self._holding = False
        self.pauses = 0  # holds started (a pause seen while holding extends the hold)

    # ------------------------------------------------------------------ read-only views

    @property
    def capacity(self) -> int:
        return self._placement.capacity

    @property
    def active(self) -> int:
        return self._placement.active_total

    @property
    def queued_slots(self) -> int:
        return self._queued_slots

    @property
    def queued_requests(self) -> int:
        return self._queued_n

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def active_tokens(self) -> int:
        """KV tokens charged by the running leases, on every node."""
        return self._placement.active_tokens_total

    @property
    def token_capacity(self) -> int:
        """Σ token shares (nodes without a pool count nothing here: they have no token limit)."""
        return self._placement.token_capacity

    def active_on(self, node: str) -> int:
        return self._placement.active_on(node)

    def share_on(self, node: str) -> int:
        """The share admission may place leases against on ``node`` now."""
        return self._placement.share_on(node)

    def active_tokens_on(self, node: str) -> int:
        """KV tokens charged by this master's running leases on ``node``."""
        return self._placement.active_tokens_on(node)

    def token_share_on(self, node: str) -> int | None:
        """The token share admission may charge leases against on ``node`` now; None: the node has no
        pool (slots alone limit it)."""
        return self._placement.token_share_on(node)

    def max_token_pool(self) -> int | None:
        """The largest whole KV pool of the nodes this master holds a share on (what a request's
        tokens must not exceed, else ``too_many_tokens``); None: some node has no pool (no limit)."""
        pl = self._placement
        return None if pl.token_limit == math.inf else pl.max_tfull

    def granted_on(self, node: str) -> int:
        """Slots granted on ``node`` since this core started (only grows)."""
        return self._ledger.granted_on.get(node, 0)

    def sure_on(self, node: str) -> int:
        """Slots of the leases on ``node`` whose decode end this master sees as it happens: all
        running leases but those marked with :meth:`end_unseen`, sent or not (what kept_slots counted
        from before :meth:`decode_sent`; the protocol model's earlier-release masters use it)."""
        return self._placement.active_on(node) - self._ledger.unseen_on.get(node, 0)

    def in_decode_on(self, node: str) -> int:
        """Slots of the leases on ``node`` that the engine surely holds and whose end the master sees:
        their decode request went out (:meth:`decode_sent`), they are not released, and not marked
        :meth:`end_unseen`. An Ack's kept_slots counts from these."""
        return self._ledger.in_decode.get(node, 0)

    def in_decode_tokens_on(self, node: str) -> int:
        """The token twin of :meth:`in_decode_on`: KV tokens of those leases."""
        return self._ledger.in_decode_tokens.get(node, 0)

    def decode_sent(self, t: Ticket) -> None:
        """The lease's decode request went out to its engine (with SGLang's protocol right after the
        grant, with vLLM's after the prefill): from now on the engine holds it. Idempotent."""
        if t.state is not _GRANTED or t.released or t.sent or t.node is None:
            return
        self._ledger.decode_sent(t, t.node)

    def kept_since(self, node: str, gen: int | None) -> tuple[int, int]:
        """For an Ack on ``node``: the slots in decode there at the previous Ack (number ``gen``) that
        still are (so never more than :meth:`in_decode_on`, nor than the active slots), and this Ack's
        number. 0 when ``gen`` is None (a stream's first Ack) or is not the
        latest (another stream's Ack came in between)."""
        kept, _, ack = self._ledger.kept_since(node, gen)
        return kept, ack

    def kept_vector_since(self, node: str, gen: int | None) -> tuple[int, int, int]:
        """:meth:`kept_since` with the tokens: (kept slots, kept tokens, this Ack's number). The kept
        tokens are those of exactly the leases the kept slots count (an Ack's ``kept_tokens``). Either
        call builds an Ack: call one of them, once per Ack."""
        return self._ledger.kept_since(node, gen)

    def last_kept_tokens(self, node: str) -> int:
        """The kept tokens of the latest Ack built for ``node`` (by :meth:`kept_since` or
        :meth:`kept_vector_since`; 0 before any): what an adapter that calls :meth:`kept_since` for
        the Ack's kept_slots reads right after for its ``kept_tokens``. Builds nothing."""
        return self._ledger.kept_tokens.get(node, 0)

    def end_unseen(self, t: Ticket) -> None:
        """The master stopped reading this lease's answer (a slow client): its decode may end in the
        engine before the master can tell, so from now on it no longer counts as surely running
        there. Idempotent; it lasts until the lease is released. Places nothing, changes no grant."""
        if t.state is not _GRANTED or t.released or t.unseen or t.node is None:
            return
        self._ledger.end_unseen(t, t.node)

    def can_start_now(self, slots: int, session_id: str | None = None, tokens: int = 0) -> bool:
        """Whether a first-time request for ``slots`` (and ``tokens``) would be granted at once: a node
        has the room, nothing of its session runs or waits here, no gang holds the free slots, no
        pause hold. (After every call nothing queued fits the free slots, so it would pass no one.)"""
        if self._bypass:
            return True
        return self._start_node(slots, tokens, session_id) is not None

    def _start_node(self, slots: int, tokens: int, session_id: str | None) -> str | None:
        """The node a first-time request would be granted on at once (see :meth:`can_start_now`)."""
        if self._holding or self._bf.reserved or (session_id is not None and session_id in self._sessions):
            return None
        if self._now < self._hold_until:
            return None
        return self._placement.fit(slots, tokens)

    def waits_for_room(self, slots: int, session_id: str | None = None, tokens: int = 0) -> bool:
        """Whether a first-time request for ``slots`` (and ``tokens``) would wait here for room alone:
        no node has it free now (or a gang holds it, or a pause hold), while nothing of its session
        runs or waits here (a request behind its own session's turn waits for that, wherever it went)."""
        if session_id is not None and session_id in self._sessions:
            return False
        return not self.can_start_now(slots, None, tokens)

    def free_now(self) -> int:
        """The most slots one first-time request could be granted at once (on one node; 0 while a
        gang holds the free slots or a pause hold lasts): what another master may hand this one."""
        if self._bypass or self._holding or self._bf.reserved:
            return 0
        return self._top_free()[0]

    def has_handoffs(self) -> bool:
        """Whether a first-time request waits here as an eligible head (cheap: what decides if asking
        the peers for room is worth it)."""
        return any(q.heads_n for q in self._qlist)

    def handoffs(self, max_slots: int, limit: int) -> list[Ticket]:
        """Up to ``limit`` queued requests another master could start at once instead, the earliest
        deadline first (the one closest to missing its target) among each class's ``limit`` oldest:
        eligible heads of any class, each of at most ``max_slots`` slots, neither a resubmission nor
        behind its own session's turn nor part of a gang. Looks only; :meth:`hand_off` takes one out."""
        out: list[Ticket] = []
        if limit <= 0 or max_slots <= 0:
            return out
        for q in self._qlist:
            if not q.heads_n:
                continue
            n = 0
            for t in q.arrivals:
                if (
                    t.state is _QUEUED
                    and t.request_class is q.cls
                    and t._loc == _HEAD
                    and t.slots <= max_slots
                ):
                    out.append(t)
                    n += 1
                    if n >= limit:
                        break
        out.sort(key=lambda t: (t.deadline, t.id))
        return out[:limit]

    def hand_off(self, t: Ticket) -> list[Ticket]:
        """Withdraw queued ``t``: another master starts it (``HANDED_OFF``). Should that master refuse,
        the request comes back as a resubmission with ``t.deadline`` and goes first.

        Its slots count in :meth:`completion_rate` as if released: the queue drains by hand-offs as
        by this master's own completions, and an expected wait that saw only the latter would refuse
        arrivals the peers' room is about to serve."""
        self._begin()
        if t.state is _QUEUED:
            self._finish(t, _CANCELLED, HANDED_OFF)
            self._estimate.count_done(t.slots, self._now, handed=True, tokens=t.tokens)
            self._estimate.take_peer_room(t.slots)  # it takes the peers' room it goes to
            self._pump()
        return self._end()

    def wanted_slots(self) -> int:
        """Queued demand in slots (what the master reports to agents as ``wanted_slots``)."""
        return self._queued_slots

    def wanted_tokens(self) -> int:
        """Queued demand in KV tokens (an Ack's ``wanted_tokens``)."""
        return self._queued_tokens

    def forget_node(self, node: str) -> bool:
        """Drop what this core keeps for ``node`` (its Ack bookkeeping) once it holds no share and no
        lease there: the master forgot the node (its agent left for good). False, and nothing
        dropped, while it still has either. A node that comes back starts afresh."""
        if self._placement.holds(node):
            return False
        self._ledger.forget(node)
        return True

    def refusal(self, slots: int, tokens: int = 0) -> Reason | None:
        """Why :meth:`submit` would refuse ``slots`` (and ``tokens``) at once whatever the queue holds
        (no capacity, or more than any share or node), or None. Lets an earlier stage refuse before
        doing work for nothing."""
        if self._bypass:
            return None
        if slots < 1 or tokens < 0:
            return self._reason(INVALID)
        code = self._placement.refusal_code(slots, tokens)
        return None if code is None else self._reason(code)

    @property
    def held_until(self) -> float:
        """Nothing is placed before this time (-inf: no hold). See :meth:`watch_pauses`."""
        return self._hold_until

    def placement_held(self) -> bool:
        """Whether this process stood still less than the hold ago (:meth:`watch_pauses`): a decode
        request placed before the pause must not go out then either."""
        if self._resumed_at is None:
            return False
        now = self._clock()
        return now < self._resumed_at(now) + self._pause_hold_s

    def next_deadline(self) -> float | None:
        """When :meth:`expire` has work: the first waiter's deadline, or the end of a hold."""
        t = self._first_deadline()
        d = t.deadline if t is not None else None
        if self._holding and (d is None or self._hold_until < d):
            return self._hold_until
        return d

    def misses_target(self, c: RequestClass, lead_s: float) -> bool:
        """Whether a request of class ``c`` whose first token comes ``lead_s`` after its grant would
        miss the class's target even if granted now (never, without a target)."""
        return lead_s + self.later_wait_s > self._targets[c]

    def wait_limit(self, c: RequestClass) -> float:
        """How long a first-time waiter of class ``c`` may wait: its class timeout, capped by the
        class's target when one is set."""
        return self._waits[c]

    def completion_rate(self, now: float | None = None, *, handed: bool = True) -> float | None:
        """Slots released per second, lately; None before :data:`RATE_MIN_RELEASES` releases.

        The larger of two estimates, so that a stale one never refuses anyone: the released slots
        decayed with time constant ``rate_window_s`` (corrected for a history shorter than that), and
        Little's law on the leases running now (active slots ÷ the mean hold time), which sees the
        turnover of a fleet that has just filled up before many of its leases have ended.
        ``handed=False``: without the slots handed to peers (:meth:`hand_off`), i.e. what this master
        serves itself.
        """
        if self._estimate.done_n < RATE_MIN_RELEASES:
            return None
        return self._estimate.completion_rate(self._clock() if now is None else now, handed=handed)

    def load(self) -> PeerLoad:
        """This master's load for its peers' pooled expected wait (see :class:`PeerLoad`)."""
        rate = self.completion_rate(handed=False)
        return PeerLoad(
            self.free_now(),
            {q.cls: q.slots for q in self._qlist if q.slots},
            rate if rate is not None and math.isfinite(rate) else 0.0,
            self._placement.capacity,
        )

    def set_peer_load(self, load: PeerLoad | None) -> None:
        """The summed load of the peers this master hands waiters to (None: none known). For
        :data:`PEER_LOAD_TTL_S` after, :meth:`expected_wait` judges an arrival over them and this master
        together, as one master over their slots would: their queues stand ahead of it as this master's
        do, their free room and the slots they serve drain this queue too (hand-offs)."""
        self._estimate.set_peer_load(load, self._clock())

    def expected_wait(
        self, c: RequestClass, slots: int = 1, now: float | None = None, tokens: int = 0
    ) -> float | None:
        """Seconds an arrival of class ``c`` needing ``slots`` would wait; None: no estimate yet.

        The slots served before it, as DRR would serve them: every queued slot of its own class (FIFO,
        resubmissions included), and of each other class k the share DRR gives k while the
        arrival's class gets through those and the arrival's own slots — ``(Q_c + slots) * w_k / w_c``,
        at most what k has queued (a lower class gets its share too: DRR serves it in proportion, not
        after). Plus its own slots, minus the slots free now, over :meth:`completion_rate`. Arrivals
        after it (a higher class may still pass it) and session or gang blocking are left out: the
        estimate errs towards admitting. O(1): running totals per class.

        With a fresh peer load (:meth:`set_peer_load`) the queues, the free slots and the rate are
        this master's and the peers' summed (the rate without hand-offs, which the peers serve):
        a clump that landed here is judged against the turnover of every master it can move to.

        Where this master holds token shares, the same estimate in tokens (queued tokens, the
        arrival's ``tokens``, free tokens, tokens released per second; this master's alone) may
        bind: the larger of the two counts.
        """
        return self._estimate.expected_wait(c, slots, self._clock() if now is None else now, tokens)

    def snapshot(self) -> dict[str, Any]:
        pl = self._placement
        bf = self._bf
        g = bf.gang
        drr = self._drr
        return {
            "bypass": self._bypass,
            "capacity": pl.capacity,
            "active": pl.active_total,
            # leases the master stopped reading for a slow client (end_unseen)
            "unseen_slots": self._ledger.unseen_total(),
            "queue_bound_slots": self._bound,
            "masters": self._masters,
            "queued_requests": self._queued_n,
            "queued_slots": self._queued_slots,
            "wanted_slots": self._queued_slots,
            # KV tokens (DESIGN §13): Σ token shares, charged by running leases, queued
            "token_capacity": pl.token_capacity,
            "active_tokens": pl.active_tokens_total,
            "queued_tokens": self._queued_tokens,
            "wanted_tokens": self._queued_tokens,
            "sessions": len(self._sessions),
            "queued_retries": len(self._retries),
            "placement_held_s": round(max(0.0, self._hold_until - self._clock()), 3),
            "pauses": self.pauses,
            "completion_rate_slots_per_s": rounded(self.completion_rate()),
            "peer_load": self._estimate.peer_load_view(self._clock()),
            "classes": {
                c.value: {
                    "queued_requests": self._queues[c].n,
                    "queued_slots": self._queues[c].slots,
                    "queued_tokens": self._queues[c].tokens,
                    "eligible_heads": self._queues[c].heads_n,
                    "deficit": drr.deficit[c],
                    "weight": self._weights[c],
                    "max_wait_s": self._waits[c],
                    "target_wait_s": None if self._targets[c] == math.inf else self._targets[c],
                    # what a one-slot arrival of the class would be told now (None: no estimate)
                    "expected_wait_s": rounded(self.expected_wait(c)),
                }
                for c in CLASS_ORDER
            },
            "drr": {"current": CLASS_ORDER[drr.cur].value, "turn_started": drr.started},
            "backfill": {
                "gang_ticket": g.id if g else None,
                "gang_slots": g.slots if g else 0,
                "gang_tokens": g.tokens if g else 0,
                "gang_class": g.request_class.value if g else None,
                "used_slots": bf.used,
                "budget_slots": bf.budget,
                "reserved": bf.reserved,
            },
            "nodes": pl.nodes_view(),
            "outcomes": {c.value: dict(v) for c, v in self._outcomes.items()},
        }

    # ------------------------------------------------------------------ commands

    def set_shares(
        self,
        shares: Mapping[str, int],
        node_capacity: Mapping[str, int] | None = None,
        token_shares: Mapping[str, int] | None = None,
        token_full: Mapping[str, int] | None = None,
    ) -> list[Ticket]:
        """Set this master's share per decode node (nodes absent or 0 take no new work).

        ``node_capacity`` is each node's full ``running_max_req_size`` (defaults to the share): it
        decides whether a request that does not fit any share is a 400 (never fits) or a 429.
        ``token_shares``: this master's share of each node's KV pool, in tokens; a node absent from it
        has no pool (no token limit there: slots alone). ``token_full``: each node's whole pool
        (defaults to the token share), which decides between ``too_many_tokens`` (400) and a 429.
        Setting the same effective shares again is a no-op: DRR and backfill state are untouched.
        """
        self._begin()
        check_shares(shares)
        if token_shares:
            check_shares(token_shares, "token share")
        changes = {n: int(s) for n, s in shares.items()}
        for node in self._placement.shares:
            changes.setdefault(node, 0)
        return self._apply_shares(changes, node_capacity, _ints(token_shares), token_full)

    def update_shares(
        self,
        changes: Mapping[str, int],
        node_capacity: Mapping[str, int] | None = None,
        token_shares: Mapping[str, int] | None = None,
        token_full: Mapping[str, int] | None = None,
    ) -> list[Ticket]:
        """Like :meth:`set_shares` for the nodes in ``changes`` only (0: the node takes no new work);
        the others keep their shares. A node in ``changes`` takes its token share from
        ``token_shares`` (absent: no pool); a node only in ``token_shares`` keeps its slot share and
        takes the token share. O(len(changes) + len(token_shares)): a master hears of a thousand
        nodes' changes in small batches."""
        self._begin()
        check_shares(changes)
        if token_shares:
            check_shares(token_shares, "token share")
        ts = _ints(token_shares)
        return self._apply_shares(
            {n: int(s) for n, s in changes.items()}, node_capacity, ts, token_full, ts or ()
        )

    def watch_pauses(self, resumed_at: Callable[[float], float], hold_s: float) -> None:
        """Place nothing for ``hold_s`` after this process was found not running for a while.

        ``resumed_at(now)`` returns when the latest such pause ended (-inf: none yet; ``now`` while
        one is still being noticed). Every call checks it before it decides, so a placement made by
        the first callback that runs after a pause is held too. Waiters keep their deadlines; when
        the hold ends, :meth:`next_deadline` says so and :meth:`expire` places what fits. No effect
        in bypass mode (nothing is limited there).
        """
        if not hold_s >= 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s!r}")
        if self._bypass:
            return
        self._resumed_at = resumed_at
        self._pause_hold_s = float(hold_s)

    def set_masters(self, masters: int) -> None:
        """How many masters share the fleet (0: unknown). See :meth:`_queue_bound`."""
        if masters < 0:
            raise ValueError(f"masters must be >= 0, got {masters!r}")
        self._masters = int(masters)
        # A smaller bound refuses new arrivals; what is queued stays (it was accepted).
        self._bound = self._queue_bound()

    def _queue_bound(self) -> int:
        """``queue_waves`` times the larger of the capacity held and this master's even part of it.

        Under a demand split the share a master holds follows the demand it reports (running +
        queued). A bound on the share alone would close that loop: a master whose share fell could
        queue only about what it holds, refuse the rest and so never report the demand that would
        win its share back. Its even part (the full capacity of its nodes ÷ the live masters) keeps
        the queue as long as a static split would, whatever the demand split holds right now.
        """
        held = self._placement.capacity
        even = self._placement.full_total // self._masters if self._masters else 0
        return math.floor(self.policy.queue_waves * max(held, even) + 1e-9)

    def _apply_shares(
        self,
        changes: Mapping[str, int],
        node_capacity: Mapping[str, int] | None,
        token_shares: Mapping[str, int] | None = None,
        token_full: Mapping[str, int] | None = None,
        token_nodes: Iterable[str] = (),
    ) -> list[Ticket]:
        pl = self._placement
        if not pl.apply(changes, node_capacity, token_shares, token_full, token_nodes):
            return self._end()
        self._bound = self._queue_bound()
        self._bf.budget = math.floor(self.policy.backfill_waves * pl.capacity + 1e-9)
        if not self._bypass and self._queued_n:
            if pl.capacity == 0:
                for c in reversed(CLASS_ORDER):
                    q = self._queues[c]
                    while (t := q.newest()) is not None:
                        self._finish(t, _REJECTED, NO_CAPACITY)
            else:
                for t in self._gangs.over(pl.max_share):
                    self._finish(t, _REJECTED, pl.refusal_code(t.slots, t.tokens) or CANNOT_FIT_NOW)
                # a token share shrinks like a slot share: what no longer fits any fails
                for t in self._token_heap.over(pl.token_limit):
                    self._finish(t, _REJECTED, pl.refusal_code(t.slots, t.tokens) or CANNOT_FIT_NOW)
                self._trim(self._bound)
        self._pump()
        return self._end()

    def submit(
        self,
        slots: int = 1,
        request_class: RequestClass = RequestClass.COLD,
        session_id: str | None = None,
        *,
        avoid: frozenset[str] = _NO_AVOID,
        deadline: float | None = None,
        lead_s: float = 0.0,
        at_once: bool = False,
        tokens: int = 0,
        backlog_s: float = 0.0,
    ) -> Ticket:
        """Ask for ``slots`` slots on one node. The ticket comes back granted, queued or rejected.

        ``tokens``: the request's KV-token charge (DESIGN §13; 0: none). It is placed only where its
        tokens fit this master's token share too (a node without a pool: slots alone), refused with
        ``too_many_tokens`` when they exceed every node's whole pool, and otherwise handled like a
        gang: ``cannot_fit_now`` when no share could hold it now, queued (blocked, backfilled past,
        reserved for) when the shares could but the room is not free. A resubmission passes its
        tokens again.

        ``at_once``: granted now or refused now (``expected_wait``), never queued: a request another
        master spilled here (pdmaster/spill.py) takes only room this master has now, and never waits
        ahead of or beside this master's own clients.

        ``lead_s``: what the request will still wait after its grant before its first token; added
        to its expected wait where that is checked against its class's target (0: a pure wait target),
        and taken off the wait it may queue for (at least ``MIN_TARGET_WAIT_S``). ``backlog_s``: the part
        of ``lead_s`` that is other requests' prefill queued ahead of it. An arrival that could run at
        once is never refused for its own prefill, however long, but it is (``expected_wait``) when the
        backlog ahead of it is what puts its first token past the target: admitting it would only
        lengthen that backlog for everyone behind it (DESIGN §13, prefill in tokens).

        A request retried after an engine failed it is *resubmitted*: ``avoid`` names the nodes it
        is never placed on, ``deadline`` (the clock's time base) the absolute deadline it keeps from
        its first admission (already past: it is granted only if a node has room now, else it times
        out at once; absent: the class's wait from now). Either one makes the ticket a resubmission:
        it goes before every first-time waiter, is not charged to its class again and is not
        serialised behind its session again (it had the session's turn; ``session_id`` is ignored).
        """
        self._begin()
        now = self._now
        self._seq += 1
        n = int(slots)
        k = int(tokens) if tokens else 0
        rc = request_class if type(request_class) is RequestClass else RequestClass(request_class)
        resubmit = bool(avoid) or deadline is not None
        t = Ticket(self._seq, n, rc, None if resubmit else session_id, now, k)
        if avoid:
            t.avoid = avoid
        if n < 1 or n != slots or (k and (k < 0 or k != tokens)):
            return self._refuse(t, INVALID)
        pl = self._placement
        if self._bypass:  # no limit to keep, in slots or tokens
            _, node = pl.top_free_avoiding(avoid) if avoid else pl.top_free()
            if node is None:
                _, node = pl.top_free()  # somewhere rather than nowhere
            self._grant_new(t, node)
            self._end()
            return t
        if pl.capacity == 0 or n > pl.max_share or k > pl.token_limit:
            return self._refuse(t, pl.refusal_code(n, k) or INVALID)
        if resubmit:
            return self._resubmit(t, now + self._waits[rc] if deadline is None else deadline)
        s = self._sessions.get(session_id) if session_id is not None else None
        if at_once:
            node = self._start_node(n, k, session_id)
            if node is None:
                return self._refuse(t, EXPECTED_WAIT, self._retry_hint(0.0))
            self._grant_new(t, node)
            self._end()
            return t
        target = self._targets[rc]
        if target != math.inf and (wait := self._over_target(t, s, target, lead_s, backlog_s)) is not None:
            return self._refuse(t, EXPECTED_WAIT, self._retry_hint(wait))
        est = self._estimate
        bound = (
            self._bound
            if est.peer_load is None
            else est.pooled_bound(self._bound, self.policy.queue_waves, now)
        )
        overflow = self._queued_slots + n - bound
        if overflow > 0:
            bf = self._bf
            node = self._fit(t) if s is None and not bf.reserved else None
            if node is not None:
                # Idle fill. After every call the queue is stable: nothing queued fits now (or the
                # blocked gang is being backfilled), so these slots would otherwise stay idle.
                if bf.gang is None:
                    self._grant_new(t, node)
                    self._end()
                    return t
                if t.slots <= bf.remaining():
                    self._drr.charge(t.request_class, t.slots)  # backfill is charged like any grant
                    self._grant_new(t, node)
                    bf.spend(t.slots)
                    self._end()
                    return t
            lower = self._qlist[RANK[t.request_class] + 1 :]
            if sum(q.slots for q in lower) < overflow:  # replacement is all-or-nothing
                return self._refuse(t, QUEUE_FULL)
            for q in reversed(lower):
                while overflow > 0 and (v := q.newest()) is not None:
                    overflow -= v.slots
                    self._finish(v, _EVICTED, EVICTED)
            s = self._sessions.get(session_id) if session_id is not None else None
        # The last pump stopped for want of room or of a candidate, and nothing changed since: no
        # placement change, nothing ended in this call, no resubmission waits. Then the newcomer
        # changes nothing DRR sees unless it becomes an eligible head and its class has no older
        # head needing as few slots (else no class's oldest head within any slot limit changes),
        # and pumping again would stop where the last pump did.
        q = self._queues[rc]
        stable = self._idle_ver == pl.ver and not self._changes and not self._retries
        older = stable and bool(q.sizes) and q.sizes[0] <= n
        self._enqueue(t, s, now, lead_s)
        if not stable or (t._loc == _HEAD and not older):
            self._pump()
        self._end()
        return t

    def _over_target(
        self, t: Ticket, s: Session | None, target: float, lead_s: float, backlog_s: float = 0.0
    ) -> float | None:
        """The arrival's expected wait (plus ``lead_s``) when that exceeds ``target`` and it could not
        run right now; or, when it could, ``lead_s`` when the prefill backlog ahead of it
        (``backlog_s``) is what puts it past ``target``."""
        if s is None and not self._bf.reserved and self._fit(t) is not None:
            # After every call nothing queued fits the free slots (or a gang is being backfilled),
            # so this arrival runs at once: refuse it only for the prefills queued ahead of it.
            late = self.later_wait_s + lead_s
            return late if backlog_s > 0.0 and late > target and late - backlog_s <= target else None
        wait = self.expected_wait(t.request_class, t.slots, self._now, t.tokens)
        if wait is not None:
            wait += self.later_wait_s + lead_s
        return wait if wait is not None and wait > target else None

    def _retry_hint(self, wait: float) -> Reason:
        p = self.policy
        return Reason(EXPECTED_WAIT, min(p.retry_after_max_s, max(p.retry_after_min_s, wait)))

    def _resubmit(self, t: Ticket, deadline: float) -> Ticket:
        t.deadline = deadline  # kept even when granted at once, so a further retry carries it on
        node = self._fit(t)
        if node is not None:
            # The queue is stable (no resubmission fits anywhere it may go), so nothing is overtaken.
            self._place(t, node, t.enqueued_at)
            self._end()
            return t
        if deadline <= self._now:
            self._refuse(t, TIMEOUT)
            t.state = _EXPIRED
            return t
        overflow = self._queued_slots + t.slots - self._bound
        if overflow > 0:
            # It goes before the first-time waiters of its class, so it may displace them like a
            # higher class would: newest first, lowest class first, all-or-nothing.
            same_or_lower = self._qlist[RANK[t.request_class] :]
            if sum(q.slots for q in same_or_lower) < overflow:
                return self._refuse(t, QUEUE_FULL)
            for q in reversed(same_or_lower):
                while overflow > 0 and (v := q.newest()) is not None:
                    overflow -= v.slots
                    self._finish(v, _EVICTED, EVICTED)
        q = self._queues[t.request_class]
        q.count(t)
        q.add_moved(t)  # its deadline is out of arrival order
        self._queued_n += 1
        self._queued_slots += t.slots
        if t.slots > 1:
            self._gangs.push(t.slots, t)
        if t.tokens:
            self._queued_tokens += t.tokens
            self._token_heap.push(t.tokens, t)
        t._loc = _RETRY
        self._retries.append(t)
        self._pump()  # an eviction may have ended a reservation
        self._end()
        return t

    def release(self, t: Ticket) -> list[Ticket]:
        """Return a granted lease's slots. Idempotent; a no-op for tickets that were never granted."""
        self._begin()
        if t.state is not _GRANTED or t.released:
            return self._end()
        t.released = True
        now = self._now
        t.ended_at = now
        self._estimate.released(t.slots, now, None if t.granted_at is None else now - t.granted_at, t.tokens)
        node = t.node
        if node is not None and (t.sent or t.unseen):
            self._ledger.released(t, node)
        self._placement.give_back(node, t.slots, t.tokens)
        if t.session_id is not None:
            s = self._sessions.get(t.session_id)
            if s is not None and s.active is t:
                s.active = None
                self._refresh_session(t.session_id, s)
        self._pump()
        return self._end()

    def cancel(self, t: Ticket) -> list[Ticket]:
        """Withdraw a waiter (client went away). A granted ticket is released instead."""
        if t.state is _GRANTED:
            return self.release(t)
        self._begin()
        if t.state is _QUEUED:
            self._finish(t, _CANCELLED, CANCELLED)
            self._pump()
        return self._end()

    def expire(self) -> list[Ticket]:
        """Time out every waiter whose deadline is at or before the clock's now."""
        self._begin()
        now = self._now
        # earliest deadline first across the classes, so ``last_changes`` lists them in that order
        while (t := self._first_deadline()) is not None and t.deadline <= now:
            self._finish(t, _EXPIRED, TIMEOUT)
        if self._holding and now >= self._hold_until:
            self._holding = False
            self._pump()
        elif self._changes:
            self._pump()
        return self._end()

    def promote_session(self, session_id: str) -> list[Ticket]:
        """The session produced its first valid output: its waiters become CONTINUATION."""
        self._begin()
        s = self._sessions.get(session_id)
        if s is not None and s.live:
            for t in s.queue:
                if t.state is _QUEUED and t.request_class is not _CONT:
                    self._reclass(t, _CONT)
            self._pump()
        return self._end()

    # ------------------------------------------------------------------ internals: bookkeeping

    def _begin(self) -> None:
        self._changes = []
        now = self._now = self._clock()  # one clock read per call: grants and ends share a timestamp
        if self._resumed_at is not None:
            until = self._resumed_at(now) + self._pause_hold_s
            if until > self._hold_until:
                if not self._holding or now >= self._hold_until:
                    self.pauses += 1
                self._hold_until = until
                self._holding = True

    def _end(self) -> list[Ticket]:
        self.last_changes = self._changes
        return self._changes

    def _reason(self, code: str) -> Reason:
        if code in FINAL_CODES:
            return Reason(code, None)
        p = self.policy
        return Reason(
            code, self._estimate.retry_after(p.retry_after_min_s, p.retry_after_max_s, self._queued_slots)
        )

    def _refuse(self, t: Ticket, code: str, reason: Reason | None = None) -> Ticket:
        t.state = _REJECTED
        t.reason = reason or self._reason(code)
        t.ended_at = t.enqueued_at
        self._outcomes[t.request_class][code] += 1
        self._changes.append(t)
        self._end()
        return t

    def _top_free(self) -> tuple[int, str | None]:
        if self._now < self._hold_until:
            return 0, None
        return self._placement.top_free()

    def _fit(self, t: Ticket) -> str | None:
        """The node ``t`` is placed on now (never one it avoids), or None (no room, or a hold)."""
        if self._now < self._hold_until:
            return None
        return self._placement.fit(t.slots, t.tokens, t.avoid)

    def _enqueue(self, t: Ticket, s: Session | None, now: float, lead_s: float = 0.0) -> None:
        c = t.request_class
        q = self._queues[c]
        wait = self._waits[c]
        if lead_s > 0.0 and self._targets[c] != math.inf:
            # A time-to-first-token target: once the wait has used what the prefill leaves of it,
            # the request would miss it when served, and its slot is better spent on another.
            wait = min(wait, max(MIN_TARGET_WAIT_S, self._targets[c] - lead_s))
        t.deadline = now + wait
        self._queued_n += 1
        self._queued_slots += t.slots
        q.add(t)
        if t.slots > 1:
            self._gangs.push(t.slots, t)
        k = t.tokens
        if k:
            self._queued_tokens += k
            th = self._token_heap  # SizeHeap.push, inlined
            th.n += 1
            heapq.heappush(th.heap, (-k, t.id, t))
            if len(th.heap) > 2 * th.n + 64:
                th.compact()
        if t.session_id is None:
            q.push_head(t)
            return
        if s is None:
            s = self._sessions[t.session_id] = Session()
        blocked = s.active is not None or s.live > 0
        s.queue.append(t)
        s.live += 1
        if blocked:
            t._loc = _WAIT
        else:
            q.push_head(t)

    def _refresh_session(self, sid: str, s: Session) -> None:
        q = s.queue
        while q and q[0].state is not _QUEUED:
            q.popleft()
        if not q:
            if s.active is None:
                del self._sessions[sid]
        elif s.active is None and q[0]._loc == _WAIT:
            self._queues[q[0].request_class].push_head(q[0])

    def _dequeue(self, t: Ticket) -> None:
        """Queue bookkeeping for a ticket that leaves the queue (granted or not); its state is set."""
        self._queues[t.request_class].remove(t)
        self._queued_n -= 1
        self._queued_slots -= t.slots
        if t.slots > 1:
            self._gangs.n -= 1
        if t.tokens:
            self._queued_tokens -= t.tokens
            self._token_heap.n -= 1
        loc = t._loc
        t._loc = _NOWHERE
        if loc == _HEAD:
            self._queues[t.request_class].drop_head(t)
        elif loc == _GANG:
            self._bf.clear()
        elif loc == _RETRY:
            self._retries.remove(t)  # a short list: resubmissions are few
        sid = t.session_id
        if sid is not None:
            s = self._sessions[sid]
            s.live -= 1
            if t.state is _GRANTED:
                s.active = t
            self._refresh_session(sid, s)

    def _finish(self, t: Ticket, state: TicketState, code: str) -> None:
        """A queued ticket ends without a grant."""
        t.state = state
        t.reason = self._reason(code)
        t.ended_at = self._now
        self._dequeue(t)
        self._outcomes[t.request_class][code] += 1
        self._changes.append(t)

    def _place(self, t: Ticket, node: str | None, now: float) -> None:
        t.state = _GRANTED
        t.node = node
        t.granted_at = now
        if node is not None:
            self._ledger.granted(node, t.slots)
        self._placement.take(node, t.slots, t.tokens)
        self._outcomes[t.request_class][GRANTED] += 1
        self._changes.append(t)

    def _grant_new(self, t: Ticket, node: str | None) -> None:
        """Grant an arrival that never entered the queue (idle fill, bypass)."""
        if t.session_id is not None and not self._bypass:
            s = self._sessions.get(t.session_id)
            if s is None:
                s = self._sessions[t.session_id] = Session()
            if s.active is None:
                s.active = t
        self._place(t, node, t.enqueued_at)

    def _grant(self, t: Ticket, node: str) -> None:
        """Grant a queued ticket (the head DRR chose, or the blocked gang)."""
        t.state = _GRANTED
        self._dequeue(t)
        self._place(t, node, self._now)

    def _first_deadline(self) -> Ticket | None:
        # The adapter asks after every call, so the common case is inlined: the front of each class's
        # arrivals is live (grants trim it) and nothing was promoted.
        best: Ticket | None = None
        for q in self._qlist:
            if q.moved_by_deadline:
                t = q.first_deadline()
            else:
                a = q.arrivals
                c = q.cls
                while a and (a[0].state is not _QUEUED or a[0].request_class is not c):
                    a.popleft()
                t = a[0] if a else None
            if t is not None and (
                best is None or t.deadline < best.deadline or (t.deadline == best.deadline and t.id < best.id)
            ):
                best = t
        return best

    def _trim(self, bound: int) -> None:
        for q in reversed(self._qlist):
            while self._queued_slots > bound and (t := q.newest()) is not None:
                self._finish(t, _EVICTED, EVICTED)

    def _reclass(self, t: Ticket, c: RequestClass) -> None:
        old = self._queues[t.request_class]
        new = self._queues[c]
        t.request_class = c
        old.remove(t)
        t.deadline = max(t.deadline, t.enqueued_at + self._waits[c])
        new.count(t)
        new.add_moved(t)
        if t._loc == _HEAD:
            old.drop_head(t)
            new.push_head(t)

    # ------------------------------------------------------------------ internals: scheduling

    def _grant_retry(self) -> bool:
        """Grant the oldest queued resubmission that has room on a node it does not avoid."""
        for t in self._retries:
            node = self._fit(t)
            if node is not None:
                self._grant(t, node)  # not charged: it paid for its turn when first granted
                return True
        return False

    def _pump(self) -> None:
        """Grant what the free room and the queue allow. Where it stops for want of room or of a
        candidate, it notes the placement version (``_idle_ver``): until the placement or the eligible
        heads change, pumping again would stop there again (see :meth:`submit`)."""
        self._idle_ver = -1
        if self._bypass:
            return
        pl = self._placement
        while self._queued_n:
            if self._now < self._hold_until:
                return
            fh = pl.free_heap  # Placement.top_free, inlined for a live top
            node: str | None
            if fh and pl.node_ver.get((e := fh[0])[1]) == e[2]:
                free = -e[0]
                node = e[1]
            else:
                free, node = pl.top_free()
            if free <= 0 or node is None:
                self._idle_ver = pl.ver
                return
            if self._retries and self._grant_retry():
                continue
            # Without pools the node with the most free slots is the only one worth checking; with
            # them, placement weighs tokens (Placement.fit).
            pooled = pl.tshares
            bf = self._bf
            g = bf.gang
            if g is not None:
                if not pooled:
                    gnode = node if g.slots <= free else None
                elif bf.gang_miss == pl.ver:
                    gnode = None  # nothing changed since it last found no node
                elif bf.gang_seen >= 0 and pl.still_none(g.slots, g.tokens, bf.gang_seen):
                    # no node had the room, and none whose room grew since has it
                    gnode = None
                    bf.gang_miss = pl.ver
                    bf.gang_seen = pl.raises
                elif (gnode := pl.fit(g.slots, g.tokens)) is None:
                    bf.gang_miss = pl.ver
                    bf.gang_seen = pl.raises if pl.exact else -1
                if gnode is not None:
                    self._drr.charge(g.request_class, g.slots)
                    self._grant(g, gnode)  # clears the backfill state
                    continue
                if bf.reserved:
                    self._idle_ver = pl.ver
                    return  # freed slots wait for the gang
                remaining = bf.budget - bf.used
                if remaining <= 0:
                    bf.reserved = True
                    self._idle_ver = pl.ver
                    return
                pick = self._drr.pick(self._qlist, min(free, remaining), g.request_class)
                if pick is None:
                    self._idle_ver = pl.ver
                    return
                t, lone = pick
                if pooled:
                    if bf.cand_miss == t.id:
                        if bf.cand_miss_ver == pl.ver:
                            self._idle_ver = pl.ver
                            return  # nothing changed since it last found no node
                        if bf.cand_seen >= 0 and pl.still_none(t.slots, t.tokens, bf.cand_seen):
                            bf.cand_miss_ver = self._idle_ver = pl.ver
                            bf.cand_seen = pl.raises
                            return  # no node whose room grew since it last found none has it
                    tnode = pl.fit(t.slots, t.tokens)
                    if tnode is None:
                        bf.cand_miss = t.id
                        bf.cand_seen = pl.raises if pl.exact else -1
                        bf.cand_miss_ver = self._idle_ver = pl.ver
                        return  # its tokens do not fit now either: wait for the next change
                    node = tnode
                self._queues[t.request_class].take_head(t)
                self._drr.charge(t.request_class, t.slots, lone)
                if pooled and bf.gang_miss == pl.ver:
                    self._grant(t, node)
                    bf.gang_miss = pl.ver  # a grant only takes room: the gang fits no better
                else:
                    self._grant(t, node)
                bf.used += t.slots  # Backfill.spend, inlined
                if bf.used >= bf.budget:
                    bf.reserved = True
                continue
            pick = self._drr.pick(self._qlist, None, None)
            if pick is None:
                self._idle_ver = pl.ver
                return
            t, lone = pick
            self._queues[t.request_class].take_head(t)
            if pooled:
                node = pl.fit(t.slots, t.tokens)
            elif t.slots > free:
                node = None
            if node is not None:
                self._drr.charge(t.request_class, t.slots, lone)
                self._grant(t, node)
                continue
            # DRR chose a request that does not fit now (a gang, or tokens): later requests may
            # backfill, within a budget.
            t._loc = _GANG
            bf.block(t)
            if pooled:
                # It just found no node: asking again before the placement changes finds none.
                bf.gang_miss = pl.ver
                bf.gang_seen = pl.raises if pl.exact else -1


def _ints(m: Mapping[str, int] | None) -> dict[str, int] | None:
    return None if m is None else {n: int(v) for n, v in m.items()}
