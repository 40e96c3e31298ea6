"""The request path, as named stages over a :class:`~pdmaster.context.RequestContext`:

classify → admit → route → dispatch → relay.

* classify: the prompt's prefix estimate (made once, reused for routing) and the session decide the
  admission class (``classify``);
* admit: the admission lease, held by an ``async with`` block, so a client that goes away (aiohttp
  cancels the handler), an engine error or a bug all release it; its placement is the decode node;
  with ``--admission-target-includes-prefill`` the request's expected time from grant to first
  output (``prefill_time``) goes with it, and what streamed requests really took is learned;
* route: the prefill node (``routing``);
* dispatch: the request goes to P and D with the configured PD protocol (``engine``);
* relay: D's answer goes back to the client (``relay``).

Engine faults (DESIGN §7): route asks each engine's circuit breaker for permission (a half-open
breaker lets exactly one trial through); dispatch tells the breakers how the exchange went. A P or D
that failed before any byte reached the client is tried again on another pair, at most
``max_retries`` times. The retry's lease keeps the request's class and its first admission deadline,
and admission never places it on a node that already failed the request; while only such nodes have
room it waits, ahead of every first-time waiter (see ``AdmissionCore.submit``).

Parsing and HTTP errors are the API's (``api``): a stage that fails raises ``RequestFailed``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from aiohttp import web

from pdmaster.admission import EXPECTED_WAIT, RequestClass
from pdmaster.admission_controller import AdmissionController, AdmissionRejected, HandedOff, Lease
from pdmaster.context import RequestContext, RequestFailed
from pdmaster.engine import Dispatch, EngineError, EnginePool, EngineResponse
from pdmaster.engine.health import EngineBreakers, counts_as_failure
from pdmaster.engine_priority import node_priorities, with_priority
from pdmaster.fanout import Part, split
from pdmaster.lifecycle import Lifecycle
from pdmaster.metrics import RequestMetrics
from pdmaster.prefill_time import PrefillTime
from pdmaster.registry import Node
from pdmaster.relay import NO_LEASE, relay_body, relay_parts_body, relay_parts_stream, relay_stream
from pdmaster.routing import Router
from pdmaster.spill import CACHED_HEADER, SPILLED_HEADER, Spill, parse_cached, with_cached
from pdmaster.staged_admission import StagedAdmission, StagedLease
from pdmaster.token_charge import TokenCharge
from pdmaster.validation import ParsedRequest

__all__ = ["RequestPipeline"]

log = logging.getLogger(__name__)

# (node_id, kind) of an engine failure the breaker counted, for the metrics.
FailureListener = Callable[[str, str], None]


def request_tokens(parsed: ParsedRequest, charges: TokenCharge) -> tuple[int, int]:
    """(prompt tokens, KV charge) of a request: every prompt's tokens once (what the prefill
    computes), and every prompt's tokens and expected output n times (what its lease charges)."""
    prompts = parsed.prompts
    if prompts is None:
        ids = parsed.input_ids
        prompt = charges.prompt_tokens(len(parsed.prompt_text), None if ids is None else len(ids))
        return prompt, charges.charge(prompt, parsed.max_tokens, parsed.n)
    prompt_total = charge = 0
    for p in prompts:
        prompt = charges.prompt_tokens(0, len(p)) if isinstance(p, list) else charges.prompt_tokens(len(p))
        prompt_total += prompt
        charge += charges.charge(prompt, parsed.max_tokens, parsed.n)
    return prompt_total, charge


_PROMPT_TOKENS = b'"prompt_tokens":'


def prompt_tokens_in(answer: bytes) -> int | None:
    """The last ``"prompt_tokens": N`` in an engine's answer (a body or a stream's tail), or None."""
    at = answer.rfind(_PROMPT_TOKENS)
    if at < 0:
        return None
    at += len(_PROMPT_TOKENS)
    end = at
    while end < len(answer) and answer[end] in b" 0123456789":
        end += 1
    digits = answer[at:end].strip()
    return int(digits) if digits.isdigit() else None


def _failure_label(exc: EngineError) -> str:
    return "5xx" if exc.engine_status >= 500 else exc.kind


def _stalled(error: EngineError | None) -> bool:
    return error is not None and error.kind == "timeout"


def _retryable(exc: EngineError) -> bool:
    """An engine failure another pair may not have: no connection, no answer in time, a connection
    closed under the request, a 5xx, a half-open breaker busy with its trial, or a decode node this
    master lost its stream to before the decode request went out."""
    return exc.node is not None and (
        exc.kind in ("breaker", "lost") or counts_as_failure(exc.kind, exc.engine_status)
    )


def _still_held(decode: Node, paused: Callable[[], bool]) -> Callable[[], bool]:
    """Whether this master still holds its stream to the decode node's agent, the one it had when the
    request was routed: over a new stream the agent may have handed the slot on meanwhile. Not while
    ``paused`` (placement is held after this process stood still): a stream the agent cut meanwhile
    may not be read yet, and the decode request goes round again once it is."""
    stream = decode.stream
    return lambda: decode.connected and decode.stream == stream and not paused()


class RequestPipeline:
    def __init__(
        self,
        *,
        router: Router,
        admission: AdmissionController,
        dispatch_factory: Callable[[EnginePool], Dispatch],
        lifecycle: Lifecycle,
        metrics: RequestMetrics,
        breakers: EngineBreakers | None = None,
        on_engine_failure: FailureListener | None = None,
        max_retries: int = 0,
        pool_factory: Callable[[], EnginePool] = EnginePool,
        spill: Spill | None = None,
        engine_priority: Mapping[RequestClass, int] | None = None,
        charges: TokenCharge | None = None,
        engine_priority_auto: bool = False,
    ) -> None:
        # --engine-priority auto: the priority only for engines that say they schedule by one.
        self.engine_priority_auto = engine_priority_auto
        self.spill = spill
        # What a lease charges of a decode node's KV pool (None: slots only, no token charge).
        self.charges = charges
        # --engine-priority: each class's ``priority`` for the engines (None: the client's body as is).
        self.engine_priority = engine_priority
        self.router = router
        self.admission = admission
        self.dispatch_factory = dispatch_factory
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.breakers = breakers if breakers is not None else EngineBreakers()
        self.on_engine_failure = on_engine_failure
        self.max_retries = max_retries
        self.pool_factory = pool_factory
        self._pool: EnginePool | None = None
        self._dispatch: Dispatch | None = None
        # Two-stage admission: the pass first, the decode lease after the prefill (see staged_admission).
        self._staged: StagedAdmission | None = None
        # A time-to-first-token target: each request's expected time from grant to first output.
        self.prefill_time: PrefillTime | None = admission.prefill_time
        # Ids: a random per-process prefix and a counter, unique across masters and restarts
        # without reading the system's random source per request (uuid4 does).
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count(1)

    def new_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):016x}"

    async def open(self) -> None:
        self._pool = self.pool_factory()
        self._dispatch = self.dispatch_factory(self._pool)
        admission = self.admission
        if isinstance(admission, StagedAdmission):
            if not self._dispatch.staged:
                raise ValueError(
                    f"two-stage admission needs a staged PD protocol, not {self._dispatch.protocol}"
                )
            self._staged = admission

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
        if self.spill is not None:
            await self.spill.close()

    async def serve(self, ctx: RequestContext) -> web.StreamResponse:
        self.classify(ctx)
        self.lifecycle.enter()
        failed: frozenset[str] = frozenset()  # nodes that failed this request: never tried again for it
        deadline: float | None = None  # the first lease's admission deadline, kept by retries
        spill = self.spill if self.spill is not None and self.spill.wanted(ctx.request) else None
        try:
            assert ctx.request_class is not None
            lead_s, backlog_s = self._leads(ctx)
            if spill is not None and self.admission.misses_target(ctx.request_class, lead_s):
                # Its prefill alone breaks its time-to-first-token target: a peer's free slot would
                # serve it late. As with one master, it runs here if it can start now, or is refused.
                spill = None
            if spill is not None and self.admission.waits_for_room(
                ctx.parsed.slots, ctx.session_id, ctx.tokens
            ):
                # It would wait here for room that a peer may have free now (pdmaster/spill.py). A
                # continuation too: its prefix is cached in the engines, not here, and the peer is
                # told where (X-Pdcoord-Cached).
                spilled = await self._spill(ctx, spill)
                if spilled is not None:
                    return spilled
                spill = None  # the peers had no room: no second round after a refusal here
            while True:
                if ctx.retries:
                    # Let the node table's news (a breaker that just opened) reach admission
                    # before the retry is placed: it is delivered once per event-loop tick.
                    await asyncio.sleep(0)
                try:
                    async with self.admission.acquire(
                        slots=ctx.parsed.slots,
                        request_class=ctx.request_class,
                        session_id=ctx.session_id,
                        avoid=failed,
                        deadline=deadline,
                        lead_s=0.0 if ctx.retries else lead_s,
                        at_once=ctx.from_peer,  # only room free now (pdmaster/spill.py)
                        tokens=ctx.tokens,
                        backlog_s=0.0 if ctx.retries else backlog_s,
                    ) as lease:
                        ctx.lease = lease
                        if self._staged is None and lease.node in failed:
                            # a last guard: admission is told to avoid these nodes
                            raise RequestFailed(
                                503, f"decode {lease.node} failed this request already", retry_after=1,
                                type_="upstream_error", code="upstream_failed",
                            )  # fmt: skip
                        parts: list[Part] | None = None
                        try:
                            if self._staged is not None:
                                parts = self.split(ctx)
                                if parts is None:
                                    answers = [await self.dispatch_staged(ctx, self._staged, lease, failed)]
                                else:  # a batch: its decode lease first, then as in one stage
                                    await self._take_decode(ctx, self._staged, lease, failed)
                                    self.route(ctx, failed)
                                    answers = await self.dispatch_parts(ctx, parts)
                            else:
                                self.route(ctx, failed)
                                parts = self.split(ctx)
                                answers = (
                                    await self.dispatch_parts(ctx, parts)
                                    if parts is not None
                                    else [await self.dispatch(ctx)]
                                )
                        except EngineError as exc:
                            # Not while draining: a draining master with an empty queue has handed
                            # its shares back (agents count only its running leases), so a new lease
                            # could land on a slot another master now holds. The client's load
                            # balancer retries elsewhere.
                            if (
                                ctx.retries < self.max_retries
                                and _retryable(exc)
                                and not self.lifecycle.draining
                            ):
                                assert exc.node is not None
                                failed = failed | {exc.node}
                                if deadline is None:
                                    deadline = lease.deadline
                                ctx.retries += 1
                                log.info("request %s: retrying on another pair: %s", ctx.request_id, exc)
                                continue  # leaves the async with: this lease is released first
                            raise RequestFailed(
                                exc.status, exc.message, type_="upstream_error", code="upstream_failed",
                                retry_after=1 if exc.status == 503 else None,
                            ) from None  # fmt: skip
                        finally:
                            self._settle(ctx, None)
                        if ctx.retries:
                            ctx.headers["X-Retries"] = str(ctx.retries)
                        try:
                            if parts is not None:
                                return await self.relay_parts(ctx, parts, answers)
                            return await self.relay(ctx, answers[0])
                        finally:
                            for answer in answers:
                                await answer.close()
                except HandedOff as exc:
                    # A peer reported room while this waited here (pdmaster/spill.py): go there.
                    assert self.spill is not None
                    spilled = await self._spill(ctx, self.spill, to=exc.peer, waited_s=exc.waited_s)
                    if spilled is not None:
                        return spilled
                    deadline = exc.deadline  # it filled meanwhile: back here, first, by its deadline
                    continue
                except AdmissionRejected as exc:
                    if exc.code == EXPECTED_WAIT and spill is not None:
                        # refused before any work was done for it: a peer may have room now
                        spilled = await self._spill(ctx, spill)
                        if spilled is not None:
                            return spilled
                    raise RequestFailed(
                        exc.status, exc.message, code=exc.code, retry_after=exc.retry_after
                    ) from None
        finally:
            self._prefilled(ctx)
            self.lifecycle.leave()
            ctx.metrics.duration.observe(time.perf_counter() - ctx.arrived)

    # -- the prefill's share of the time to first token --------------------------------------------
    def _leads(self, ctx: RequestContext) -> tuple[float, float]:
        """The expected time from grant to first output (the prefill time of the tokens ahead of the
        request's last one where that is least: the node routing will choose), and the part of it
        that is other requests' prefill queued ahead (less what its own uncached tokens would take
        on an idle node)."""
        pt = self.prefill_time
        if pt is None or ctx.retries or ctx.estimate is None:
            return 0.0, 0.0
        least = self.router.least_ahead(ctx.estimate, ctx.prompt_tokens)
        if least is None:
            return 0.0, 0.0
        lead = pt.predict(least[0])
        return lead, max(0.0, lead - pt.predict(least[1]))

    def _routed(self, ctx: RequestContext, prefill: Node) -> None:
        """``prefill`` takes the request: its uncached tokens join that node's backlog until its first
        output (``_prefilled``), and the tokens ahead of its last one are noted for the prefill time."""
        self._prefilled(ctx)
        estimate = ctx.estimate
        own = 0 if estimate is None else self.router.uncached(prefill, estimate, ctx.prompt_tokens)
        ctx.tokens_ahead = self.router.backlog(prefill) + own
        self.router.routed(prefill, ctx.hashes, own)
        ctx.prefill_backlog = (prefill.node_id, own)

    def _prefilled(self, ctx: RequestContext) -> None:
        """The request's prompt no longer waits at its prefill node (first output, failure, end)."""
        held = ctx.prefill_backlog
        if held is not None:
            ctx.prefill_backlog = None
            self.router.prefill_tokens_done(*held)

    def _first_output(self, ctx: RequestContext) -> None:
        self.admission.observe_output(ctx.session_id)
        self._prefilled(ctx)
        pt, lease = self.prefill_time, ctx.lease
        if pt is None or lease is None or ctx.retries or not ctx.parsed.stream:
            return  # a whole body arrives at its end, not at its first token
        if isinstance(lease, StagedLease):  # the wait for a decode slot is the decode stage's
            start, later = lease.gate_pass.ticket.granted_at, lease.ticket.wait_s or 0.0
        else:
            start, later = lease.ticket.granted_at, 0.0
        if start is not None:
            pt.observe(ctx.tokens_ahead, time.monotonic() - start - later)

    async def _spill(
        self, ctx: RequestContext, spill: Spill, *, to: str | None = None, waited_s: float | None = None
    ) -> web.StreamResponse | None:
        """``Spill.forward`` with what this master's prefix index knows of the prompt. A peer's answer
        is the session's output as much as one from here: its next turn is a continuation here too."""
        cached = dict(ctx.estimate.matches) if ctx.estimate is not None else None
        return await spill.forward(
            ctx.request, ctx.raw, cached, to=to, waited_s=waited_s,
            on_output=lambda: self.admission.observe_output(ctx.session_id),
        )  # fmt: skip

    # -- stages ---------------------------------------------------------------------------------
    def classify(self, ctx: RequestContext) -> None:
        parsed = ctx.parsed
        ctx.hashes, ctx.estimate = self.router.estimate(
            parsed.input_ids if parsed.input_ids is not None else parsed.prompt_text
        )
        ctx.from_peer = SPILLED_HEADER in ctx.request.headers
        hint = ctx.request.headers.get(CACHED_HEADER) if ctx.from_peer else None
        if hint:  # where the spilling master saw the prompt's prefix cached
            ctx.estimate = with_cached(ctx.estimate, parse_cached(hint, ctx.estimate.total_blocks))
        ctx.request_class = self.admission.classify(ctx.session_id, ctx.estimate.hit_ratio)
        self.metrics.classified(ctx.request_class.name.lower())
        if self.charges is not None:
            ctx.prompt_tokens, ctx.tokens = request_tokens(parsed, self.charges)

    def route(self, ctx: RequestContext, exclude: Collection[str] = ()) -> None:
        """Choose P (never one in ``exclude``) and D; take a permission from each one's breaker
        (EngineError ``breaker`` when a half-open breaker's one trial is already in flight)."""
        assert ctx.lease is not None and ctx.estimate is not None
        decode = self.router.decode(ctx.lease.node)
        prefill = self.router.prefill(ctx.estimate, exclude, ctx.prompt_tokens)
        if decode is None or prefill is None:
            what = "prefill" if prefill is None else "decode"
            raise RequestFailed(503, f"no {what} node available", retry_after=1)
        self._permit(ctx, prefill)
        self._permit(ctx, decode)
        ctx.prefill, ctx.decode = prefill, decode
        self._headers(ctx)

    def _permit(self, ctx: RequestContext, node: Node) -> None:
        token = self.breakers.allow(node.node_id)
        if token is None:
            self._settle(ctx, None)
            raise EngineError(
                f"{node.role} {node.node_id}: its engine failed recently and is being probed",
                status=503,
                kind="breaker",
                node=node.node_id,
            )
        ctx.permits[node.node_id] = token

    def _headers(self, ctx: RequestContext) -> None:
        assert ctx.lease is not None and ctx.request_class is not None
        assert ctx.prefill is not None and ctx.decode is not None
        ctx.headers = {
            "X-Request-Id": ctx.request_id,
            "X-Admission-Class": ctx.request_class.value,
            "X-Admission-Wait-Ms": f"{ctx.lease.wait_s * 1000:.1f}",
            "X-Decode-Node": ctx.decode.node_id,
            "X-Prefill-Node": ctx.prefill.node_id,
        }

    # -- two-stage admission: the decode lease is taken after the prefill ----------------------------
    async def _take_decode(
        self, ctx: RequestContext, staged: StagedAdmission, gate_pass: Lease, failed: frozenset[str]
    ) -> None:
        """The decode lease for the request holding ``gate_pass`` (released with it): ``ctx.lease``."""
        assert ctx.request_class is not None
        ctx.lease = await staged.acquire_decode(gate_pass, ctx.parsed.slots, ctx.request_class, failed)
        if ctx.lease.node in failed:  # a last guard, as for one stage
            raise RequestFailed(
                503, f"decode {ctx.lease.node} failed this request already", retry_after=1,
                type_="upstream_error", code="upstream_failed",
            )  # fmt: skip

    async def dispatch_staged(
        self, ctx: RequestContext, staged: StagedAdmission, gate_pass: Lease, failed: frozenset[str]
    ) -> EngineResponse:
        """P with the pass; then the decode lease, D and D's 200 answer (EngineError otherwise). Both
        engines' breakers hear the outcome, each of its own half."""
        assert self._dispatch is not None and ctx.estimate is not None
        prefill = self.router.prefill(ctx.estimate, failed, ctx.prompt_tokens)
        if prefill is None:
            raise RequestFailed(503, "no prefill node available", retry_after=1)
        self._permit(ctx, prefill)
        ctx.prefill = prefill
        ctx.engine_request_id = self.new_id()
        headers = ctx.engine_headers(ctx.engine_request_id)
        self._routed(ctx, prefill)
        try:
            body, _ = self._engine_body(ctx)
            params = await self._dispatch.prefill(ctx.endpoint, body, prefill, headers)
        except EngineError as exc:
            self._failed_on(ctx, exc, f"prefill {prefill.node_id}")
            raise
        finally:
            self.router.prefill_done(prefill)
        self._settle(ctx, True)
        await self._take_decode(ctx, staged, gate_pass, failed)
        assert ctx.lease is not None
        decode = self.router.decode(ctx.lease.node)
        if decode is None:
            raise RequestFailed(503, "no decode node available", retry_after=1)
        self._permit(ctx, decode)
        ctx.decode = decode
        self._headers(ctx)
        try:
            answer = await self._dispatch.decode(
                ctx.endpoint,
                body,
                params,
                decode,
                headers,
                ctx.lease.decode_sent,
                _still_held(decode, self.admission.placement_held),
            )
        except EngineError as exc:
            self._failed_on(ctx, exc, f"decode {decode.node_id}")
            raise
        self._settle(ctx, True)
        return answer

    def _priority(self, ctx: RequestContext) -> int | None:
        """The ``priority`` the engines get for this request (``--engine-priority``), or None."""
        table = self.engine_priority
        if self.engine_priority_auto and ctx.prefill is not None and ctx.decode is not None:
            table = node_priorities(ctx.prefill.start_args, ctx.decode.start_args)
        if table is None or ctx.request_class is None:
            return None
        return table[ctx.request_class]

    def _engine_body(self, ctx: RequestContext) -> tuple[Mapping[str, Any], bytes | None]:
        """The body (and its JSON text, when reusable) the engines get: the client's, with its
        ``priority`` under ``--engine-priority``."""
        priority = self._priority(ctx)
        if priority is None:
            return ctx.parsed.body, ctx.raw
        return with_priority(ctx.parsed.body, ctx.raw, priority)

    def _failed_on(self, ctx: RequestContext, exc: EngineError, where: str) -> None:
        log.info(
            "request %s (engine id %s) failed on %s: %s",
            ctx.request_id,
            ctx.engine_request_id,
            where,
            exc.message,
        )
        if exc.node is not None and counts_as_failure(exc.kind, exc.engine_status):
            self._engine_failed(exc.node, exc, ctx.permits.pop(exc.node, None))

    async def dispatch(self, ctx: RequestContext) -> EngineResponse:
        """D's 200 answer; EngineError otherwise. Both engines' breakers hear the outcome."""
        assert self._dispatch is not None and ctx.prefill is not None and ctx.decode is not None
        prefill = ctx.prefill
        # A fresh id per dispatch: two clients reusing an X-Request-Id must not collide inside an
        # engine (vLLM keys its requests by it); the client's id stays in the response and the logs.
        ctx.engine_request_id = self.new_id()
        body, raw = self._engine_body(ctx)
        self._routed(ctx, prefill)
        try:
            answer = await self._dispatch.open(
                ctx.endpoint,
                body,
                prefill,
                ctx.decode,
                ctx.engine_headers(ctx.engine_request_id),
                raw,
                ctx.lease.decode_sent if ctx.lease is not None else None,
                _still_held(ctx.decode, self.admission.placement_held),
            )
        except EngineError as exc:
            log.info(
                "request %s (engine id %s) failed on prefill %s / decode %s: %s",
                ctx.request_id,
                ctx.engine_request_id,
                prefill.node_id,
                ctx.decode.node_id,
                exc.message,
            )
            if exc.node is not None and counts_as_failure(exc.kind, exc.engine_status):
                self._engine_failed(exc.node, exc, ctx.permits.pop(exc.node, None))
            raise
        finally:
            self.router.prefill_done(prefill)
        self._settle(ctx, True)
        return answer

    # -- engine health ------------------------------------------------------------------------------
    def _settle(self, ctx: RequestContext, ok: bool | None) -> None:
        """Record ``ok`` for every permission of the attempt still open."""
        if ctx.permits:
            for node_id, token in ctx.permits.items():
                self.breakers.record(node_id, token, ok)
            ctx.permits.clear()

    def _engine_failed(self, node_id: str, exc: EngineError, token: int | None) -> None:
        """Count a failure of ``node_id``'s engine: with the attempt's permission, or (a failure after
        the answer began, such as a stalled stream) against the breaker's current state."""
        if token is None:
            token = self.breakers.get(node_id).generation
        # A refused connection needs no second opinion: open at once, so that a retry (and everyone
        # else) is placed elsewhere instead of on a node with nothing listening.
        self.breakers.record(node_id, token, False, exc.message, decisive=exc.kind == "connect")
        if self.on_engine_failure is not None:
            self.on_engine_failure(node_id, _failure_label(exc))

    # -- requests the engines take in parts (n > 1 on SGLang, batches; see fanout) -------------------
    def split(self, ctx: RequestContext) -> list[Part] | None:
        parsed = ctx.parsed
        if parsed.n == 1 and parsed.prompts is None:
            return None  # the common case, without a call
        assert self._dispatch is not None
        return split(parsed, split_samples=self._dispatch.split_samples)

    async def dispatch_parts(self, ctx: RequestContext, parts: list[Part]) -> list[EngineResponse]:
        """Every part's 200 answer, all from the request's P and D; EngineError (the first failure,
        which the engines' breakers hear) after closing the parts that did answer."""
        assert self._dispatch is not None and ctx.prefill is not None and ctx.decode is not None
        prefill, decode, dispatch = ctx.prefill, ctx.decode, self._dispatch
        self._routed(ctx, prefill)
        unsent = len(parts)

        def sent() -> None:
            # The lease's slots are all in D once every part's request went out.
            nonlocal unsent
            unsent -= 1
            if unsent == 0 and ctx.lease is not None:
                ctx.lease.decode_sent()

        held = _still_held(decode, self.admission.placement_held)
        priority = self._priority(ctx)

        async def one(part: Part) -> EngineResponse:
            body = part.body if priority is None else {**part.body, "priority": priority}
            return await dispatch.open(
                ctx.endpoint, body, prefill, decode, ctx.engine_headers(self.new_id()), None, sent, held
            )

        try:
            results = await asyncio.gather(*(one(p) for p in parts), return_exceptions=True)
        finally:
            self.router.prefill_done(prefill)
        answers = [r for r in results if isinstance(r, EngineResponse)]
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is None:
            self._settle(ctx, True)
            return answers
        for answer in answers:
            await answer.close()
        if isinstance(failure, EngineError):
            log.info("request %s: a part failed: %s", ctx.request_id, failure.message)
            if failure.node is not None and counts_as_failure(failure.kind, failure.engine_status):
                self._engine_failed(failure.node, failure, ctx.permits.pop(failure.node, None))
        raise failure

    async def relay_parts(
        self, ctx: RequestContext, parts: list[Part], answers: list[EngineResponse]
    ) -> web.StreamResponse:
        assert ctx.decode is not None

        def first_output() -> None:
            self._first_output(ctx)

        try:
            if ctx.parsed.stream:
                resp = await relay_parts_stream(
                    ctx.request, ctx.parsed.kind, parts, answers, ctx.headers, ctx.metrics, ctx.arrived,
                    first_output, ctx.lease or NO_LEASE,
                )  # fmt: skip
                self._stream_stalled(ctx, answers)
                return resp
            resp = await relay_parts_body(
                ctx.parsed.kind, parts, answers, ctx.headers, ctx.metrics, ctx.arrived, first_output
            )
            self._answered(ctx)
            return resp
        except (EngineError, OSError) as exc:
            raise self._relay_failed(ctx, exc) from None

    async def relay(self, ctx: RequestContext, answer: EngineResponse) -> web.StreamResponse:
        def first_output() -> None:
            self._first_output(ctx)

        assert ctx.decode is not None
        try:
            if ctx.parsed.stream:
                lease = ctx.lease or NO_LEASE
                resp = await relay_stream(
                    ctx.request, answer, ctx.headers, ctx.metrics, ctx.arrived, first_output, lease,
                    self._answer_events(ctx),
                )  # fmt: skip
                self._stream_stalled(ctx, (answer,))
                return resp
            resp = await relay_body(
                answer, ctx.headers, ctx.metrics, ctx.arrived, first_output,
                lambda body: self._learn_prompt(ctx, body),
            )  # fmt: skip
            self._answered(ctx)
            return resp
        except (EngineError, OSError) as exc:
            raise self._relay_failed(ctx, exc) from None

    def _answer_events(self, ctx: RequestContext) -> Callable[[int, bytes], None] | None:
        """What learns from a streamed answer: its length from the relay's event count, and the
        engine's count of a text prompt's tokens where the stream's end carries it (None: nothing)."""
        charges = self.charges
        if charges is None or ctx.parsed.prompts is not None:
            return None
        choices = ctx.parsed.n

        def learn(events: int, tail: bytes) -> None:
            # one event per token and choice; besides them a role and a final chunk per choice
            # (chat), the usage chunk and [DONE]: at most two per choice and two more
            charges.observe_output(max(0, (events - 2) // choices - 2))
            self._learn_prompt(ctx, tail)

        return learn

    def _learn_prompt(self, ctx: RequestContext, answer: bytes) -> None:
        """A text prompt's token count as the engine reports it in ``answer`` (OpenAI usage,
        SGLang's meta_info: both say ``prompt_tokens``), for the characters-per-token estimate."""
        parsed, charges = ctx.parsed, self.charges
        if charges is None or parsed.input_ids is not None or parsed.prompts is not None:
            return
        tokens = prompt_tokens_in(answer)
        if tokens is not None:
            charges.observe_prompt(len(parsed.prompt_text), tokens)

    @staticmethod
    def _answered(ctx: RequestContext) -> None:
        """Every engine answer was read whole: the lease ends as a finished one (a streamed answer's
        relay does the same), not as an abandoned one when the ``async with`` around it ends."""
        if ctx.lease is not None:
            ctx.lease.release()

    def _stream_stalled(self, ctx: RequestContext, answers: Sequence[EngineResponse]) -> None:
        """A stream that ended with an SSE error event because D stalled (in any of its parts): D's
        breaker hears it once."""
        error = next((a.error for a in answers if _stalled(a.error)), None)
        if error is not None:
            assert ctx.decode is not None
            self._engine_failed(ctx.decode.node_id, error, None)

    def _relay_failed(self, ctx: RequestContext, exc: EngineError | OSError) -> RequestFailed:
        """D failed while its answer was read whole (before any byte went out): 502, or the timeout's
        504 for a stalled answer, which its breaker hears."""
        assert ctx.decode is not None
        status = 502
        if isinstance(exc, EngineError) and _stalled(exc):
            self._engine_failed(ctx.decode.node_id, exc, None)
            status = exc.status
        return RequestFailed(status, f"decode {ctx.decode.node_id} failed: {exc}", type_="upstream_error")
