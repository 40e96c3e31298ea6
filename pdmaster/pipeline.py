"""The request path, as named stages over a :class:`~pdmaster.context.RequestContext`:

classify → admit → route → dispatch → relay.

* classify: the prompt's prefix estimate (made once, reused for routing) and the session decide the
  admission class (``classify``);
* admit: the admission lease, held by an ``async with`` block, so a client that goes away (aiohttp
  cancels the handler), an engine error or a bug all release it; its placement is the decode node;
* route: the prefill node (``routing``);
* dispatch: the request goes to P and D with the configured PD protocol (``engine``);
* relay: D's answer goes back to the client (``relay``).

Parsing and HTTP errors are the API's (``api``): a stage that fails raises ``RequestFailed``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Callable

from aiohttp import web

from pdmaster.admission_controller import AdmissionController, AdmissionRejected
from pdmaster.context import RequestContext, RequestFailed
from pdmaster.engine import Dispatch, EngineError, EnginePool, EngineResponse
from pdmaster.fanout import Part, split
from pdmaster.lifecycle import Lifecycle
from pdmaster.metrics import RequestMetrics
from pdmaster.relay import relay_body, relay_parts_body, relay_parts_stream, relay_stream
from pdmaster.routing import Router

__all__ = ["RequestPipeline"]

log = logging.getLogger(__name__)


class RequestPipeline:
    def __init__(
        self,
        *,
        router: Router,
        admission: AdmissionController,
        dispatch_factory: Callable[[EnginePool], Dispatch],
        lifecycle: Lifecycle,
        metrics: RequestMetrics,
    ) -> None:
        self.router = router
        self.admission = admission
        self.dispatch_factory = dispatch_factory
        self.lifecycle = lifecycle
        self.metrics = metrics
        self._pool: EnginePool | None = None
        self._dispatch: Dispatch | None = None
        # Ids: a random per-process prefix and a counter, unique across masters and restarts
        # without reading the system's random source per request (uuid4 does).
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count(1)

    def new_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):016x}"

    async def open(self) -> None:
        self._pool = EnginePool()
        self._dispatch = self.dispatch_factory(self._pool)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    async def serve(self, ctx: RequestContext) -> web.StreamResponse:
        self.classify(ctx)
        self.lifecycle.enter()
        try:
            assert ctx.request_class is not None
            try:
                async with self.admission.acquire(
                    slots=ctx.parsed.slots, request_class=ctx.request_class, session_id=ctx.session_id
                ) as lease:
                    ctx.lease = lease
                    self.route(ctx)
                    parts = self.split(ctx)
                    if parts is not None:
                        return await self.serve_parts(ctx, parts)
                    answer = await self.dispatch(ctx)
                    try:
                        return await self.relay(ctx, answer)
                    finally:
                        await answer.close()
            except AdmissionRejected as exc:
                raise RequestFailed(
                    exc.status, exc.message, code=exc.code, retry_after=exc.retry_after
                ) from None
        finally:
            self.lifecycle.leave()
            ctx.metrics.duration.observe(time.perf_counter() - ctx.arrived)

    # -- stages ---------------------------------------------------------------------------------
    def classify(self, ctx: RequestContext) -> None:
        parsed = ctx.parsed
        ctx.hashes, ctx.estimate = self.router.estimate(
            parsed.input_ids if parsed.input_ids is not None else parsed.prompt_text
        )
        ctx.request_class = self.admission.classify(ctx.session_id, ctx.estimate.hit_ratio)
        self.metrics.classified(ctx.request_class.name.lower())

    def route(self, ctx: RequestContext) -> None:
        assert ctx.lease is not None and ctx.estimate is not None and ctx.request_class is not None
        decode = self.router.decode(ctx.lease.node)
        prefill = self.router.prefill(ctx.estimate)
        if decode is None or prefill is None:
            what = "prefill" if prefill is None else "decode"
            raise RequestFailed(503, f"no {what} node available", retry_after=1)
        ctx.prefill, ctx.decode = prefill, decode
        ctx.headers = {
            "X-Request-Id": ctx.request_id,
            "X-Admission-Class": ctx.request_class.value,
            "X-Admission-Wait-Ms": f"{ctx.lease.wait_s * 1000:.1f}",
            "X-Decode-Node": decode.node_id,
            "X-Prefill-Node": prefill.node_id,
        }

    async def dispatch(self, ctx: RequestContext) -> EngineResponse:
        assert self._dispatch is not None and ctx.prefill is not None and ctx.decode is not None
        prefill = ctx.prefill
        # A fresh id per dispatch: two clients reusing an X-Request-Id must not collide inside an
        # engine (vLLM keys its requests by it); the client's id stays in the response and the logs.
        ctx.engine_request_id = self.new_id()
        self.router.routed(prefill, ctx.hashes)
        try:
            return await self._dispatch.open(
                ctx.endpoint, ctx.parsed.body, prefill, ctx.decode, ctx.engine_headers(), ctx.raw
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
            raise RequestFailed(
                exc.status, exc.message, type_="upstream_error", code="upstream_failed"
            ) from None
        finally:
            self.router.prefill_done(prefill)

    # -- requests the engines take in parts (n > 1 on SGLang, batches; see fanout) -------------------
    def split(self, ctx: RequestContext) -> list[Part] | None:
        parsed = ctx.parsed
        if parsed.n == 1 and parsed.prompts is None:
            return None  # the common case, without a call
        assert self._dispatch is not None
        return split(parsed, split_samples=self._dispatch.split_samples)

    async def serve_parts(self, ctx: RequestContext, parts: list[Part]) -> web.StreamResponse:
        assert self._dispatch is not None and ctx.prefill is not None and ctx.decode is not None
        prefill, decode, dispatch = ctx.prefill, ctx.decode, self._dispatch
        self.router.routed(prefill, ctx.hashes)

        async def one(part: Part) -> EngineResponse:
            headers = {"X-Request-Id": self.new_id(), "Content-Type": "application/json"}
            return await dispatch.open(ctx.endpoint, part.body, prefill, decode, headers)

        try:
            results = await asyncio.gather(*(one(p) for p in parts), return_exceptions=True)
        finally:
            self.router.prefill_done(prefill)
        answers = [r for r in results if isinstance(r, EngineResponse)]
        try:
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            if failure is not None:
                if not isinstance(failure, EngineError):
                    raise failure
                log.info("request %s: a part failed: %s", ctx.request_id, failure.message)
                raise RequestFailed(
                    failure.status, failure.message, type_="upstream_error", code="upstream_failed"
                )
            if ctx.parsed.stream:
                return await relay_parts_stream(
                    ctx.request, ctx.parsed.kind, parts, answers, ctx.headers, ctx.metrics, ctx.arrived,
                    lambda: self.admission.observe_output(ctx.session_id),
                )  # fmt: skip
            return await relay_parts_body(
                ctx.parsed.kind, parts, answers, ctx.headers, ctx.metrics, ctx.arrived,
                lambda: self.admission.observe_output(ctx.session_id),
            )  # fmt: skip
        except (EngineError, OSError) as exc:
            raise RequestFailed(
                502, f"decode {decode.node_id} failed: {exc}", type_="upstream_error"
            ) from None
        finally:
            for a in answers:
                await a.close()

    async def relay(self, ctx: RequestContext, answer: EngineResponse) -> web.StreamResponse:
        def first_output() -> None:
            self.admission.observe_output(ctx.session_id)

        try:
            if ctx.parsed.stream:
                return await relay_stream(
                    ctx.request, answer, ctx.headers, ctx.metrics, ctx.arrived, first_output
                )
            return await relay_body(answer, ctx.headers, ctx.metrics, ctx.arrived, first_output)
        except (EngineError, OSError) as exc:
            assert ctx.decode is not None
            raise RequestFailed(
                502, f"decode {ctx.decode.node_id} failed: {exc}", type_="upstream_error"
            ) from None
