"""Two-stage admission: under vLLM's protocol a bounded number of requests prefill before they hold a
decode slot (``--prefill-lookahead``).

Why. vLLM's decode request goes out only after the prefill answered, so a lease taken before the
prefill leaves its decode slot idle for the whole prefill: 13-15 % of the leased slots under overload
with the Mooncake trace's long prompts (bench/README.md, overload), capacity the engines never see.

How. A request first takes a *pass* from the gate: the ordinary admission queue (classes, DRR,
sessions, gangs, timeouts, the target wait, eviction) over one pseudo node of this master's decode
capacity C plus a lookahead L. With the pass it runs its prefill; then it takes
its decode lease from the decode stage, an ordinary :class:`AdmissionController` over the exact
per-node shares, in DRR order by class. So

* the decode limit stays exact: leases ≤ share on every node, and strict handover, ``kept_slots`` and
  ``decode_sent`` see decode leases only, as before;
* what grows is the prefill work in flight, by at most L slots: requests that prefilled while every
  decode slot was busy and wait, their KV held by the prefill engine, for the next free slot;
* L follows the prefills (Little's law): the decode stage's completion rate times the recent mean
  prefill time (pass to decode request), rounded up, at least 1 and at most ceil(lookahead * C) (the
  flag is the ceiling; before the first measurements L is that ceiling). A fixed L kept about as many
  requests prefilled and waiting for a slot as prefilling, and their wait went into TTFT; L = rate x
  prefill time is what keeps the decode slots busy when the prefills finish as the slots free;
* the target wait (``--admission-target-wait``) bounds both waits: the gate adds the decode stage's
  recent mean wait to the expected wait it checks (``AdmissionCore.later_wait_s``), else a lookahead
  full of prefilled requests would stretch TTFT past the SLO the target stands for;
* a request the decode stage would refuse whatever it waited for (no capacity, a gang larger than
  every share) is refused before its prefill (:meth:`AdmissionCore.refusal`); the gate is closed
  (capacity 0) while the decode capacity is 0.

Metrics: the admission outcomes and waits are the gate's (what clients see; a decode-stage refusal is
counted too, its grant is not: the pass was); the active-slot and capacity gauges are the decode
stage's, the queued gauges the sum of both queues. ``/admission`` shows the decode stage with the gate
under ``"gate"``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from pdmaster.admission import CLASS_ORDER, GRANTED, OUTCOMES, AdmissionPolicy, PeerLoad, RequestClass
from pdmaster.admission_controller import (
    HTTP_STATUS,
    MESSAGES,
    AdmissionController,
    AdmissionRejected,
    Lease,
)
from pdmaster.metrics import AdmissionMetrics

__all__ = ["GATE_NODE", "GatePass", "StagedAdmission", "StagedLease", "make_admission"]

GATE_NODE = "prefill-gate"  # the gate's one pseudo node
# Weight of the newest decode-stage wait in the running mean the gate adds to its expected wait.
DECODE_WAIT_WEIGHT = 0.1
# Weight of the newest prefill time (pass to decode request) in the running mean that sizes L.
PREFILL_TIME_WEIGHT = 0.1


class GatePass(Lease):
    """A gate pass; ``release()`` gives back the decode lease taken with it too (idempotent), so the
    ``async with`` that holds the pass ends both on every path."""

    __slots__ = ("decode",)

    def __init__(self, lease: Lease) -> None:
        super().__init__(lease._controller, lease.ticket)
        self.decode: Lease | None = None

    def release(self, unfinished: bool = False) -> None:
        if self.decode is not None:
            self.decode.release(unfinished)
        super().release(unfinished)


class StagedLease(Lease):
    """A decode lease and the gate pass it came through: ``release()`` gives back both (idempotent)."""

    __slots__ = ("gate_pass",)

    def __init__(self, decode: Lease, gate_pass: GatePass) -> None:
        super().__init__(decode._controller, decode.ticket)
        self.gate_pass = gate_pass
        gate_pass.decode = decode

    @property
    def wait_s(self) -> float:
        return self.gate_pass.wait_s + (self.ticket.wait_s or 0.0)

    @property
    def deadline(self) -> float:
        return self.gate_pass.deadline

    def release(self, unfinished: bool = False) -> None:
        self.gate_pass.release(unfinished)  # and this lease


class _Gate(AdmissionController):
    """The first stage; its gauges are published by the owner, which sums both queues."""

    def __init__(self, owner: StagedAdmission, policy: AdmissionPolicy, **kw: Any) -> None:
        self._owner = owner
        super().__init__(policy, **kw)

    def _schedule_publish(self) -> None:
        self._owner._schedule_publish()


class _PassContext(contextlib.AbstractAsyncContextManager[Lease]):
    __slots__ = ("_admission", "_args", "_kw", "_pass")

    def __init__(
        self, admission: StagedAdmission, args: tuple[int, RequestClass, str | None], **kw: Any
    ) -> None:
        self._admission = admission
        self._args = args
        self._kw = kw
        self._pass: GatePass | None = None

    async def __aenter__(self) -> GatePass:
        self._pass = await self._admission.acquire_pass(*self._args, **self._kw)
        return self._pass

    async def __aexit__(self, *exc_info: object) -> None:
        if self._pass is not None:
            # a no-op for a decode lease whose answer was read whole (the relay released it then)
            self._pass.release(unfinished=True)


class StagedAdmission(AdmissionController):
    """The decode stage (this class's own core: exact per-node shares) behind a gate (``gate``).

    ``acquire()`` hands out gate passes, ``acquire_decode()`` decode leases; everything a session or
    the queue means (classes, promotion, the target wait) lives in the gate.
    """

    def __init__(
        self,
        policy: AdmissionPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        master_id: str = "",
    ) -> None:
        policy = policy or AdmissionPolicy()
        if not policy.prefill_lookahead > 0 or policy.bypass:
            raise ValueError("two-stage admission needs a positive prefill_lookahead and the capacity limit")
        self.lookahead = policy.prefill_lookahead
        exported = AdmissionMetrics(
            registry if registry is not None else CollectorRegistry(), CLASS_ORDER, OUTCOMES
        )
        private = AdmissionMetrics(CollectorRegistry(), CLASS_ORDER, OUTCOMES)
        decode_metrics = copy.copy(private)
        decode_metrics.registry = exported.registry
        decode_metrics.gauges = exported.gauges
        decode_metrics.outcome = {
            k: (private if k[1] == GRANTED else exported).outcome[k] for k in exported.outcome
        }
        gate_metrics = copy.copy(exported)
        gate_metrics.gauges = private.gauges
        # The decode stage's waiters have prefilled: no target wait (refusing now wastes the prefill),
        # and a queue bound the gate already keeps (at most C + L requests are past it).
        decode_policy = dataclasses.replace(
            policy,
            target_wait_s=None,
            queue_waves=max(policy.queue_waves, 1.0) + self.lookahead + 1.0,
            prefill_lookahead=0.0,
        )
        self.gate: _Gate | None = None
        self.prefill_mean_s: float | None = None  # running mean of pass-to-decode-request times
        super().__init__(decode_policy, clock=clock, metrics=decode_metrics, master_id=master_id)
        self.gate = _Gate(self, policy, clock=clock, metrics=gate_metrics, master_id=master_id)
        self.gate.prefill_time = None  # the pipeline feeds and reads this stage's (self.prefill_time)
        self.sessions = self.gate.sessions
        self._gate_share = 0
        self._publish()

    # ------------------------------------------------------------------ the two stages

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
        """``async with admission.acquire(...) as gate_pass``: the first stage (see the module)."""
        return _PassContext(
            self,
            (slots, request_class, session_id),
            avoid=avoid,
            deadline=deadline,
            lead_s=lead_s,
            at_once=at_once,
            tokens=tokens,
            backlog_s=backlog_s,
        )

    async def acquire_pass(
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
    ) -> GatePass:
        """A gate pass, or AdmissionRejected; refused at once what the decode stage would refuse.
        ``tokens``: the request's KV-token charge, taken by its decode lease (the gate's pseudo node
        has no pool: there it only counts as demand)."""
        reason = self.core.refusal(slots, tokens)
        if reason is not None:
            assert self.gate is not None
            self.gate.metrics.outcome[(request_class, reason.code)].inc()
            raise AdmissionRejected(
                reason.code,
                MESSAGES.get(reason.code, reason.code),
                HTTP_STATUS.get(reason.code, 429),
                reason.retry_after_s,
                request_class,
            )
        assert self.gate is not None
        # The gate's one node is never one a retry avoids (those are decode nodes): a retry keeps
        # its deadline, which makes it a resubmission there too.
        return GatePass(
            await self.gate.acquire_lease(
                slots,
                request_class,
                session_id,
                deadline=deadline,
                lead_s=lead_s,
                at_once=at_once,
                tokens=tokens,
                backlog_s=backlog_s,
            )
        )

    async def acquire_decode(
        self,
        gate_pass: Lease,
        slots: int,
        request_class: RequestClass,
        avoid: frozenset[str] = frozenset(),
        tokens: int | None = None,
    ) -> StagedLease:
        """The decode lease for a request holding ``gate_pass`` (from ``acquire``): released with it.
        ``tokens``: its KV-token charge (None: the one its pass was asked with)."""
        if not isinstance(gate_pass, GatePass) or gate_pass.decode is not None:
            raise ValueError("acquire_decode needs a gate pass from acquire() without a decode lease")
        prefill_s = self._clock() - (gate_pass.ticket.granted_at or 0.0)
        m = self.prefill_mean_s
        self.prefill_mean_s = prefill_s if m is None else m + PREFILL_TIME_WEIGHT * (prefill_s - m)
        self._resize_gate()
        charge = gate_pass.ticket.tokens if tokens is None else tokens
        lease = await self.acquire_lease(slots, request_class, None, avoid=avoid, tokens=charge)
        assert self.gate is not None
        # The gate's target wait bounds the whole wait, so it hears what the decode stage adds.
        gate = self.gate.core
        gate.later_wait_s += DECODE_WAIT_WEIGHT * ((lease.ticket.wait_s or 0.0) - gate.later_wait_s)
        return StagedLease(lease, gate_pass)

    # ------------------------------------------------------------------ shares and the gate's size

    def set_shares(
        self,
        shares: Mapping[str, int],
        node_capacity: Mapping[str, int] | None = None,
        token_shares: Mapping[str, int] | None = None,
        token_full: Mapping[str, int] | None = None,
    ) -> None:
        super().set_shares(shares, node_capacity, token_shares, token_full)
        self._resize_gate()

    def update_shares(
        self,
        changes: Mapping[str, int],
        node_capacity: Mapping[str, int] | None = None,
        token_shares: Mapping[str, int] | None = None,
        token_full: Mapping[str, int] | None = None,
    ) -> None:
        super().update_shares(changes, node_capacity, token_shares, token_full)
        self._resize_gate()

    def lookahead_slots(self) -> int:
        """L: the decode stage's completion rate x the mean prefill time, within [1, ceil(lookahead C)]."""
        most = math.ceil(self.lookahead * self.core.capacity)
        rate = self.core.completion_rate()
        if rate is None or not math.isfinite(rate) or self.prefill_mean_s is None:
            return most
        return max(1, min(most, math.ceil(rate * self.prefill_mean_s)))

    def _resize_gate(self) -> None:
        c = self.core.capacity
        share = c + self.lookahead_slots() if c > 0 else 0
        if share != self._gate_share and self.gate is not None:
            self._gate_share = share
            self.gate.set_shares({GATE_NODE: share})

    # ------------------------------------------------------------------ the rest, on both or the gate

    def watch_pauses(self, resumed_at: Callable[[float], float], hold_s: float) -> None:
        super().watch_pauses(resumed_at, hold_s)
        assert self.gate is not None
        self.gate.watch_pauses(resumed_at, hold_s)

    def set_masters(self, masters: int) -> None:
        super().set_masters(masters)
        assert self.gate is not None
        self.gate.set_masters(masters)

    def promote_session(self, session_id: str) -> None:
        assert self.gate is not None
        self.gate.promote_session(session_id)

    def wanted_slots(self) -> int:
        assert self.gate is not None
        return self.gate.wanted_slots() + self.core.wanted_slots()

    def wanted_tokens(self) -> int:
        assert self.gate is not None
        return self.gate.wanted_tokens() + self.core.wanted_tokens()

    def waits_for_room(self, slots: int, session_id: str | None = None, tokens: int = 0) -> bool:
        assert self.gate is not None  # the first stage is where a request waits
        return self.gate.waits_for_room(slots, session_id, tokens)

    def misses_target(self, request_class: RequestClass, lead_s: float) -> bool:
        assert self.gate is not None  # the gate judges the target
        return self.gate.misses_target(request_class, lead_s)

    def free_now(self) -> int:
        assert self.gate is not None  # ... and where a peer's request is admitted at once
        return self.gate.free_now()

    def load(self) -> PeerLoad:
        assert self.gate is not None  # the gate holds the queue a peer's request joins
        return self.gate.load()

    def snapshot(self) -> dict[str, Any]:
        snap = super().snapshot()
        assert self.gate is not None
        snap["gate"] = self.gate.snapshot()
        snap["prefill_lookahead"] = self.lookahead
        snap["decode_wait_mean_s"] = round(self.gate.core.later_wait_s, 4)
        snap["lookahead_slots"] = self.lookahead_slots()
        snap["prefill_mean_s"] = None if self.prefill_mean_s is None else round(self.prefill_mean_s, 4)
        return snap

    def close(self) -> None:
        super().close()
        if self.gate is not None:
            self.gate.close()

    def _publish(self) -> None:
        gate = self.gate
        if gate is None:  # during construction
            return
        self._publish_pending = False
        core, g = self.core, gate.core
        values = (
            core.queued_requests + g.queued_requests,
            core.queued_slots + g.queued_slots,
            core.active,
            core.capacity,
        )
        changed = False
        for i, (v, gauge) in enumerate(zip(values, self.metrics.gauges, strict=True)):
            if self._published[i] != v:
                gauge.set(v)
                self._published[i] = v
                changed = True
        if changed:
            self.publish_count += 1


def make_admission(
    policy: AdmissionPolicy, *, registry: CollectorRegistry | None = None, master_id: str = ""
) -> AdmissionController:
    """Two-stage admission when the policy asks for a prefill lookahead, else one stage."""
    if policy.prefill_lookahead > 0 and not policy.bypass:
        return StagedAdmission(policy, registry=registry, master_id=master_id)
    return AdmissionController(policy, registry=registry, master_id=master_id)
