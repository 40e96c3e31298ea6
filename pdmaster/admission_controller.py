"""asyncio adapter around the admission core: waiting, timeouts, HTTP meaning of outcomes, metrics.

One timer handle per controller, armed no later than the core's next deadline (no per-waiter polling);
every core call reports the tickets whose state changed, so exactly those waiters are woken.
Gauges are published at most once per event-loop tick (coalesced with ``call_soon``) and only
when a value changed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from pdmaster.admission import (
    CANCELLED,
    CANNOT_FIT_NOW,
    CLASS_ORDER,
    EVICTED,
    EXPECTED_WAIT,
    GRANTED,
    HANDED_OFF,
    INVALID,
    NO_CAPACITY,
    OUTCOMES,
    QUEUE_FULL,
    TIMEOUT,
    TOO_MANY_TOKENS,
    UNSATISFIABLE,
    AdmissionCore,
    AdmissionPolicy,
    PeerLoad,
    RequestClass,
    Ticket,
    TicketState,
)
from pdmaster.classify import SessionTracker, classify_request
from pdmaster.metrics import AdmissionMetrics
from pdmaster.prefill_time import PrefillTime

__all__ = [
    "AdmissionController",
    "AdmissionRejected",
    "HandedOff",
    "Lease",
    "add_admission_flags",
    "policy_from_args",
]

# What each core outcome code means to an HTTP client. 429 unless listed: the request may succeed later.
MESSAGES: dict[str, str] = {
    QUEUE_FULL: "decode admission queue is full",
    TIMEOUT: "timed out waiting for decode capacity",
    EVICTED: "removed from the decode admission queue to make room for higher-priority requests",
    CANCELLED: "request cancelled while waiting for decode capacity",
    UNSATISFIABLE: "request needs more decode slots than any decode node has",
    NO_CAPACITY: "no decode capacity available",
    CANNOT_FIT_NOW: "request needs more decode slots than this master currently holds on any decode node",
    INVALID: "invalid slot count",
    EXPECTED_WAIT: "expected wait for decode capacity exceeds the target wait; retry after Retry-After",
    HANDED_OFF: "handed to another master's free decode capacity",
    TOO_MANY_TOKENS: "request needs more KV tokens than any decode node's pool holds",
}
HTTP_STATUS: dict[str, int] = {UNSATISFIABLE: 400, INVALID: 400, NO_CAPACITY: 503, TOO_MANY_TOKENS: 400}


class AdmissionRejected(Exception):
    """The request got no lease: refused, timed out, evicted or shed on a capacity change."""

    def __init__(
        self,
        code: str,
        message: str,
        http_status: int,
        retry_after: float | None,
        request_class: RequestClass | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.http_status = http_status
        self.retry_after = retry_after
        self.request_class = request_class

    @classmethod
    def from_ticket(cls, t: Ticket, token_limit: int | None = None) -> AdmissionRejected:
        """``token_limit``: the largest node pool, named in a ``too_many_tokens`` message."""
        r = t.reason
        if r is None:  # defensive: a non-granted ticket always carries a reason
            return cls("unknown", f"ticket ended as {t.state.value}", 503, 1.0, t.request_class)
        message = MESSAGES.get(r.code, r.code)
        if r.code == TOO_MANY_TOKENS and token_limit is not None:
            message = f"{message}: {t.tokens} KV tokens requested, at most {token_limit}"
        return cls(r.code, message, HTTP_STATUS.get(r.code, 429), r.retry_after_s, t.request_class)

    @property
    def status(self) -> int:
        """Alias of ``http_status``."""
        return self.http_status

    def retry_after_header(self) -> str | None:
        """Value for the HTTP ``Retry-After`` header (whole seconds, rounded up)."""
        return None if self.retry_after is None else str(max(1, math.ceil(self.retry_after)))


class HandedOff(AdmissionRejected):
    """The waiting request left this master's queue for ``peer``'s free room (pdmaster/spill.py): the
    caller forwards it there, and should the peer refuse, resubmits it here with ``deadline``."""

    def __init__(self, peer: str, deadline: float, waited_s: float, request_class: RequestClass) -> None:
        super().__init__(HANDED_OFF, MESSAGES[HANDED_OFF], 429, None, request_class)
        self.peer = peer
        self.deadline = deadline
        self.waited_s = waited_s


class Lease:
    """A granted decode placement. ``release()`` is idempotent."""

    __slots__ = ("_controller", "ticket")

    def __init__(self, controller: AdmissionController, ticket: Ticket) -> None:
        self._controller = controller
        self.ticket = ticket

    @property
    def node(self) -> str | None:
        return self.ticket.node

    @property
    def wait_s(self) -> float:
        return self.ticket.wait_s or 0.0

    @property
    def deadline(self) -> float:
        """The request's absolute admission deadline (on the controller's clock), which a retry keeps."""
        t = self.ticket
        if t.deadline != math.inf:
            return t.deadline
        return t.enqueued_at + self._controller.core.wait_limit(t.request_class)  # granted at once

    def release(self, unfinished: bool = False) -> None:
        """Give the slots back. ``unfinished``: the request was abandoned (client gone, engine error,
        timeout) without its answer read whole, so the engine may still run it for a while."""
        self._controller._release(self.ticket, unfinished)

    def decode_sent(self) -> None:
        """Its decode request went out to the engine (``AdmissionCore.decode_sent``)."""
        self._controller.core.decode_sent(self.ticket)

    def end_unseen(self) -> None:
        """The master stopped reading this lease's answer for a slow client: the engine may finish
        it unseen, so it no longer counts in kept_slots (``AdmissionCore.end_unseen``)."""
        self._controller.core.end_unseen(self.ticket)

    @property
    def tokens(self) -> int:
        """The KV tokens this lease charges on its node (0: none)."""
        return self.ticket.tokens

    def __repr__(self) -> str:
        t = self.ticket
        return f"Lease(node={self.node}, slots={t.slots}, tokens={t.tokens}, class={t.request_class.name})"


class _LeaseContext(contextlib.AbstractAsyncContextManager[Lease]):
    # A plain class rather than @asynccontextmanager: no generator frame kept alive per waiter.
    __slots__ = (
        "_args",
        "_at_once",
        "_avoid",
        "_backlog_s",
        "_controller",
        "_deadline",
        "_lead_s",
        "_lease",
        "_tokens",
    )

    def __init__(
        self,
        controller: AdmissionController,
        slots: int,
        request_class: RequestClass,
        session_id: str | None,
        avoid: frozenset[str],
        deadline: float | None,
        lead_s: float = 0.0,
        at_once: bool = False,
        tokens: int = 0,
        backlog_s: float = 0.0,
    ) -> None:
        self._backlog_s = backlog_s
        self._at_once = at_once
        self._tokens = tokens
        self._controller = controller
        self._args = (slots, request_class, session_id)
        self._avoid = avoid
        self._deadline = deadline
        self._lead_s = lead_s
        self._lease: Lease | None = None

    async def __aenter__(self) -> Lease:
        self._lease = await self._controller.acquire_lease(
            *self._args,
            avoid=self._avoid,
            deadline=self._deadline,
            lead_s=self._lead_s,
            at_once=self._at_once,
            tokens=self._tokens,
            backlog_s=self._backlog_s,
        )
        return self._lease

    async def __aexit__(self, *exc_info: object) -> None:
        if self._lease is not None:
            # a no-op when the answer was read whole (the relay released it then)
            self._lease.release(unfinished=True)


class AdmissionController:
    """The admission core on an event loop. Instruments: ``metrics``, or new ones on ``registry``."""

    def __init__(
        self,
        policy: AdmissionPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        metrics: AdmissionMetrics | None = None,
        master_id: str = "",
    ) -> None:
        self.core = AdmissionCore(policy or AdmissionPolicy(), clock=clock)
        self.policy = self.core.policy
        # A time-to-first-token target: what requests took from grant to first output, by their
        # uncached prompt blocks (fed by the request pipeline, read by it for each arrival's lead).
        self.prefill_time = PrefillTime() if self.policy.target_includes_prefill else None
        self.master_id = master_id
        self.sessions = SessionTracker(clock=clock)
        self._clock = clock
        self._unfinished_at: dict[str, float] = {}  # node -> see unfinished_end_at
        if metrics is None:
            # a private registry by default, so several controllers can live in one process
            reg = registry if registry is not None else CollectorRegistry()
            metrics = AdmissionMetrics(reg, CLASS_ORDER, OUTCOMES)
        self.metrics = metrics
        self.registry = metrics.registry
        self._outcome_children = metrics.outcome
        self._wait_children = metrics.wait_of
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._handed: dict[int, str] = {}  # ticket id -> the peer it was handed to (hand_off)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._held_seen = self.core.held_until
        self._publish_pending = False
        self._published: list[float | None] = [None, None, None, None]
        self.publish_count = 0  # ticks in which at least one gauge was set (for tests and debugging)
        self._closed = False
        self._publish()

    # ------------------------------------------------------------------ public surface

    def acquire(
        self,
        slots: int = 1,
        request_class: RequestClass = RequestClass.COLD,
        session_id: str | None = None,
        *,
        avoid: frozenset[str] = frozenset(),
        deadline: float | None = None,
        lead_s: float = 0.0,
        at_once: bool = False,
        tokens: int = 0,
        backlog_s: float = 0.0,
    ) -> contextlib.AbstractAsyncContextManager[Lease]:
        """``async with controller.acquire(n, cls, session) as lease:`` — the lease is released on exit.

        A retry passes the nodes that failed it (``avoid``) and the first lease's ``deadline``, a
        target that counts the prefill the request's expected ``lead_s``, a request that takes
        only room free now ``at_once``, and a request's KV-token charge ``tokens`` (a retry passes
        it again): see ``AdmissionCore.submit``.
        """
        return _LeaseContext(
            self, slots, request_class, session_id, avoid, deadline, lead_s, at_once, tokens, backlog_s
        )

    async def acquire_lease(
        self,
        slots: int = 1,
        request_class: RequestClass = RequestClass.COLD,
        session_id: str | None = None,
        *,
        avoid: frozenset[str] = frozenset(),
        deadline: float | None = None,
        lead_s: float = 0.0,
        at_once: bool = False,
        tokens: int = 0,
        backlog_s: float = 0.0,
    ) -> Lease:
        """Wait for a lease; the caller must release it (prefer ``acquire``)."""
        core = self.core
        t = core.submit(
            slots,
            request_class,
            session_id,
            avoid=avoid,
            deadline=deadline,
            lead_s=lead_s,
            at_once=at_once,
            tokens=tokens,
            backlog_s=backlog_s,
        )
        queued = t.state is TicketState.QUEUED
        self._apply(core.last_changes, t if queued else None)
        if queued:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters[t.id] = fut
            try:
                await fut
            except BaseException:
                # cancelled while queued: withdraw; cancelled right after the grant: give it back
                self._handed.pop(t.id, None)
                if t.state is TicketState.QUEUED:
                    self._apply(core.cancel(t))
                elif t.state is TicketState.GRANTED:
                    self._release(t)
                raise
            finally:
                self._waiters.pop(t.id, None)
        if t.state is TicketState.GRANTED:
            return Lease(self, t)
        peer = self._handed.pop(t.id, None)
        if peer is not None:
            raise HandedOff(peer, t.deadline, t.wait_s or 0.0, t.request_class)
        raise AdmissionRejected.from_ticket(t, core.max_token_pool())

    def set_shares(
        self,
        shares: Mapping[str, int],
        node_capacity: Mapping[str, int] | None = None,
        token_shares: Mapping[str, int] | None = None,
        token_full: Mapping[str, int] | None = None,
    ) -> None:
        """This master's share per decode node, in slots and (nodes with a KV pool) tokens; equal
        effective shares are a no-op (``AdmissionCore.set_shares``)."""
        self._apply(self.core.set_shares(shares, node_capacity, token_shares, token_full))

    def update_shares(
        self,
        changes: Mapping[str, int],
        node_capacity: Mapping[str, int] | None = None,
        token_shares: Mapping[str, int] | None = None,
        token_full: Mapping[str, int] | None = None,
    ) -> None:
        """The shares of the nodes in ``changes`` (0: no new work there) and ``token_shares`` only
        (``AdmissionCore.update_shares``); O(len(changes) + len(token_shares))."""
        self._apply(self.core.update_shares(changes, node_capacity, token_shares, token_full))

    def watch_pauses(self, resumed_at: Callable[[float], float], hold_s: float) -> None:
        """Place nothing for ``hold_s`` after a pause of this process (``AdmissionCore.watch_pauses``;
        ``resumed_at`` is usually ``PauseWatch.resumed_at``, on this controller's clock)."""
        self.core.watch_pauses(resumed_at, hold_s)

    def set_masters(self, masters: int) -> None:
        """How many masters share the fleet (0: unknown): the queue bound's floor, see the core."""
        self.core.set_masters(masters)

    def promote_session(self, session_id: str) -> None:
        self._apply(self.core.promote_session(session_id))

    def placement_held(self) -> bool:
        """Whether placement is held after a pause of this process (``AdmissionCore.placement_held``)."""
        return self.core.placement_held()

    def observe_output(self, session_id: str | None) -> None:
        """A valid output was seen for the session: later requests are CONTINUATION, waiters promoted."""
        if session_id is not None and self.sessions.observe_output(session_id):
            self.promote_session(session_id)

    def classify(self, session_id: str | None, cache_hit_ratio: float | None = None) -> RequestClass:
        return classify_request(session_id, cache_hit_ratio, self.sessions)

    def snapshot(self) -> dict[str, Any]:
        snap = self.core.snapshot()
        snap["master_id"] = self.master_id
        snap["waiters"] = len(self._waiters)
        pt = self.prefill_time
        if pt is not None:
            line = pt.line()
            snap["prefill_time"] = {
                "samples": pt.samples,
                "base_s": None if line is None else round(line[0], 4),
                "s_per_uncached_block": None if line is None else round(line[1], 6),
                "miss_s": round(pt.miss_s, 4),
            }
        return snap

    def active_on(self, node: str) -> int:
        return self.core.active_on(node)

    def share_on(self, node: str) -> int:
        return self.core.share_on(node)

    def wanted_slots(self) -> int:
        return self.core.wanted_slots()

    def active_tokens_on(self, node: str) -> int:
        return self.core.active_tokens_on(node)

    def token_share_on(self, node: str) -> int | None:
        return self.core.token_share_on(node)

    def wanted_tokens(self) -> int:
        return self.core.wanted_tokens()

    def waits_for_room(self, slots: int, session_id: str | None = None, tokens: int = 0) -> bool:
        """``AdmissionCore.waits_for_room``."""
        return self.core.waits_for_room(slots, session_id, tokens)

    def misses_target(self, request_class: RequestClass, lead_s: float) -> bool:
        """``AdmissionCore.misses_target``."""
        return self.core.misses_target(request_class, lead_s)

    def free_now(self) -> int:
        """``AdmissionCore.free_now``: what a peer master may hand this one."""
        return self.core.free_now()

    def load(self) -> PeerLoad:
        """``AdmissionCore.load``: what this master tells its peers (``/spill/room``)."""
        return self.core.load()

    def set_peer_load(self, load: PeerLoad | None) -> None:
        """``AdmissionCore.set_peer_load``: the peers this master hands waiters to, summed."""
        self.core.set_peer_load(load)

    def has_handoffs(self) -> bool:
        """Whether a waiter here could start at a peer with room (``AdmissionCore.has_handoffs``)."""
        return bool(self._waiters) and self.core.has_handoffs()

    def hand_off(self, peer: str, free_slots: int) -> int:
        """Hand the waiters closest to their deadline that fit in ``free_slots`` (a peer's room,
        ``free_now`` there) to ``peer``: each one's ``acquire`` raises :class:`HandedOff`. Returns how
        many left."""
        core = self.core
        moved = 0
        for t in core.handoffs(free_slots, free_slots):
            if t.slots > free_slots or t.id not in self._waiters:
                continue
            self._handed[t.id] = peer  # handoffs() lists only queued tickets: hand_off ends each one
            self._apply(core.hand_off(t))
            free_slots -= t.slots
            moved += 1
        return moved

    def forget_node(self, node: str) -> bool:
        """Drop ``node`` from the core (``AdmissionCore.forget_node``): after the master forgot it."""
        self.update_shares({node: 0})
        self._unfinished_at.pop(node, None)
        return self.core.forget_node(node)

    def close(self) -> None:
        """Stop the timeout timer (waiters are ended by their own tasks' cancellation)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_at = None

    # ------------------------------------------------------------------ internals

    def _release(self, t: Ticket, unfinished: bool = False) -> None:
        if t.state is TicketState.GRANTED and not t.released:
            if unfinished and t.sent and t.node is not None:
                self._unfinished_at[t.node] = self._clock()
            self._apply(self.core.release(t))

    def unfinished_end_at(self, node: str) -> float:
        """When a lease on ``node`` whose decode request had gone out was last released without its
        answer read whole (-inf: never): the engine may have run it on after that, as a cancellation
        reaches it only over a working link."""
        return self._unfinished_at.get(node, -math.inf)

    def _apply(self, changes: list[Ticket], queued: Ticket | None = None) -> None:
        """Count and wake the changed tickets; ``queued``: the waiter that just entered the queue."""
        for t in changes:
            c = t.request_class
            if t.state is TicketState.GRANTED:
                self._outcome_children[(c, GRANTED)].inc()
                self._wait_children[c].observe(t.wait_s or 0.0)
            elif t.reason is not None:
                self._outcome_children[(c, t.reason.code)].inc()
            fut = self._waiters.get(t.id)
            if fut is not None and not fut.done():
                fut.set_result(None)
        self._schedule_publish()
        # Only a new waiter can bring the next deadline forward (promotion only extends deadlines,
        # everything else removes waiters): an armed timer needs a look only when the newcomer is
        # due before it, and then the newcomer is the first due. Or a hold after a pause began, whose
        # end is when the queue moves again.
        held = self.core.held_until
        if self._timer is None:
            self._reschedule_timer()
        elif held != self._held_seen and self._timer_at is not None and held < self._timer_at:
            self._reschedule_timer(held)
        elif queued is not None and self._timer_at is not None and queued.deadline < self._timer_at:
            self._reschedule_timer(queued.deadline)
        self._held_seen = held

    def _loop(self) -> asyncio.AbstractEventLoop | None:
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            return None

    def _schedule_publish(self) -> None:
        if self._publish_pending:
            return
        loop = self._loop()
        if loop is None:
            self._publish()
            return
        self._publish_pending = True
        loop.call_soon(self._publish)

    def _publish(self) -> None:
        self._publish_pending = False
        core = self.core
        values = (core.queued_requests, core.queued_slots, core.active, core.capacity)
        changed = False
        for i, (v, g) in enumerate(zip(values, self.metrics.gauges, strict=True)):
            if self._published[i] != v:
                g.set(v)
                self._published[i] = v
                changed = True
        if changed:
            self.publish_count += 1

    def _reschedule_timer(self, d: float | None = None) -> None:
        """Arm the timer for the next deadline (``d`` when the caller knows it)."""
        if self._closed:
            return
        if d is None:
            d = self.core.next_deadline()
        if self._timer is not None and self._timer_at is not None and (d is None or d >= self._timer_at):
            # Armed early enough: let it fire and re-arm then, instead of churning the loop's timer
            # heap on every grant of the oldest waiter.
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = None
        if d is None:
            return
        loop = self._loop()
        if loop is None:
            return  # armed by the next call made inside the loop
        self._timer = loop.call_later(max(0.0, d - self._clock()), self._on_timer)
        self._timer_at = d

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self._apply(self.core.expire())


# ---------------------------------------------------------------------- CLI helpers


def _triple(text: str, kind: type[float]) -> dict[RequestClass, float]:
    parts = text.replace(",", ":").split(":")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected CONTINUATION:PROBABLE:COLD, got {text!r}")
    try:
        vals = [kind(p) for p in parts]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError(f"all three values must be > 0, got {text!r}")
    return dict(zip(CLASS_ORDER, vals, strict=True))


def _weights(text: str) -> dict[RequestClass, float]:
    return _triple(text, float)


def _targets(text: str) -> dict[RequestClass, float]:
    """One number for every class, or CONTINUATION:PROBABLE:COLD; 0 turns a class's target off."""
    parts = text.replace(",", ":").split(":")
    if len(parts) == 1:
        parts *= 3
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected SECONDS or CONTINUATION:PROBABLE:COLD, got {text!r}")
    try:
        vals = [float(p) for p in parts]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if any(not (0 <= v < math.inf) for v in vals):
        raise argparse.ArgumentTypeError(f"targets must be finite and >= 0 (0: off), got {text!r}")
    return dict(zip(CLASS_ORDER, vals, strict=True))


def _non_negative_float(text: str) -> float:
    v = float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def add_admission_flags(parser: argparse.ArgumentParser) -> None:
    # on the parser itself, not an argument group, so EnvArgumentParser's env-var defaults apply
    g = parser
    g.add_argument(
        "--disable-decode-capacity-limit",
        "--disable_pd_master_decode_capacity_limit",
        dest="disable_decode_capacity_limit",
        action="store_true",
        help="grant every request at once (no decode capacity limit, no queue)",
    )
    g.add_argument(
        "--admission-weights", type=_weights, default="8:3:1", help="DRR quanta CONT:PROB:COLD, in slots"
    )
    g.add_argument(
        "--admission-max-wait", type=_weights, default="30:15:5", help="wait timeouts CONT:PROB:COLD, seconds"
    )
    g.add_argument(
        "--admission-target-wait",
        type=_targets,
        default=None,
        metavar="SECONDS",
        help="SLO on the admission wait (default off; 0 turns a class off): an arrival whose expected "
        "wait (the slots DRR serves before it, less the free ones, over the recent completion rate) "
        "exceeds it gets 429 expected_wait at once with Retry-After ≈ that wait; also caps "
        "--admission-max-wait",
    )
    g.add_argument(
        "--admission-target-includes-prefill",
        action="store_true",
        help="make --admission-target-wait a time-to-first-token target: the check adds each "
        "request's expected time from its grant to its first output (learned from recent requests "
        "by their uncached prompt blocks, pdmaster/prefill_time.py), so a long prompt gets a "
        "shorter wait than a short one",
    )
    g.add_argument(
        "--admission-queue-waves",
        type=_non_negative_float,
        default=1.0,
        help="queue bound, in decode waves of the larger of the capacity held and the fleet's "
        "capacity ÷ the live masters",
    )
    g.add_argument(
        "--prefill-lookahead",
        type=_fraction,
        default=0.0,
        metavar="FRACTION",
        help="two-stage admission (--engine-protocol vllm only; default 0: off): a request takes its "
        "decode lease after its prefill, and prefill work beyond the decode capacity (the completion "
        "rate times the mean prefill time, at most this fraction of the capacity) runs ahead, so no "
        "decode slot idles while its request prefills (pdmaster/staged_admission.py)",
    )
    g.add_argument(
        "--admission-backfill-waves",
        type=_non_negative_float,
        default=1.0,
        help="gang backfill budget, decode waves",
    )


def _fraction(text: str) -> float:
    value = _non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be within [0, 1], got {text!r}")
    return value


def policy_from_args(ns: argparse.Namespace) -> AdmissionPolicy:
    def triple(v: Any) -> dict[RequestClass, float]:
        return _weights(v) if isinstance(v, str) else dict(v)

    target = getattr(ns, "admission_target_wait", None)
    return AdmissionPolicy(
        target_wait_s=_targets(target) if isinstance(target, str) else target,
        weights=triple(ns.admission_weights),
        max_wait_s=triple(ns.admission_max_wait),
        queue_waves=ns.admission_queue_waves,
        backfill_waves=ns.admission_backfill_waves,
        bypass=ns.disable_decode_capacity_limit,
        prefill_lookahead=getattr(ns, "prefill_lookahead", 0.0),
        target_includes_prefill=getattr(ns, "admission_target_includes_prefill", False),
    )
