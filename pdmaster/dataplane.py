"""The master's data plane: OpenAI / SGLang HTTP API → classify → admit → route → dispatch → stream.

Per request: parse and validate; classify (session tracker, prefix estimate made once and reused);
take the admission lease (its placement is the decode node); choose the prefill node cache-aware;
dispatch with the configured PD protocol; stream back; release. The lease is held by an
``async with`` block, so a client that goes away (aiohttp cancels the handler), an engine error
or a bug all release it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CollectorRegistry, Counter, Histogram

from pdmaster.admission_controller import AdmissionController, AdmissionRejected
from pdmaster.dispatch import Dispatcher, Target, UpstreamError, UpstreamResponse
from pdmaster.http_api import error_body, json_error
from pdmaster.prefix_index import PrefixIndex, choose_prefill
from pdmaster.registry import PREFILL, Node, NodeRegistry
from pdmaster.upstream import EnginePool
from pdmaster.validation import (
    InvalidRequest,
    Limits,
    ParsedRequest,
    parse_chat,
    parse_completion,
    parse_generate,
)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}
# Relay flow control: stop reading the engine above this many bytes queued for the client.
_WRITE_HIGH = 256 * 1024
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "pdcoord_requests", "Client requests by endpoint and HTTP status", ["endpoint", "status"],
            registry=registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "pdcoord_time_to_first_token_seconds", "Arrival to first streamed byte", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.duration = Histogram(
            "pdcoord_request_duration_seconds", "Arrival to end of response", ["endpoint"],
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.tokens = Counter(
            "pdcoord_tokens_streamed", "Stream events relayed to clients", ["endpoint"], registry=registry
        )
        self.classes = Counter(
            "pdcoord_requests_classified", "Requests by admission class", ["class"], registry=registry
        )
        self._per_endpoint: dict[str, _EndpointMetrics] = {}
        self._per_class: dict[str, Any] = {}

    def endpoint(self, endpoint: str) -> _EndpointMetrics:
        """The children of one route, looked up once: labels() costs a lock and a dict per call."""
        em = self._per_endpoint.get(endpoint)
        if em is None:
            em = self._per_endpoint[endpoint] = _EndpointMetrics(self, endpoint)
        return em

    def classified(self, name: str) -> None:
        child = self._per_class.get(name)
        if child is None:
            child = self._per_class[name] = self.classes.labels(**{"class": name})
        child.inc()


class _EndpointMetrics:
    __slots__ = ("duration", "ok", "tokens", "ttft")

    def __init__(self, m: RequestMetrics, endpoint: str) -> None:
        self.ok = m.requests.labels(endpoint=endpoint, status="200")
        self.ttft = m.ttft.labels(endpoint=endpoint)
        self.duration = m.duration.labels(endpoint=endpoint)
        self.tokens = m.tokens.labels(endpoint=endpoint)


def _sse_error(message: str, type_: str = "upstream_error", code: str = "upstream_failed") -> bytes:
    return (
        b"data: " + json.dumps(error_body(message, type_=type_, code=code)).encode() + b"\n\ndata: [DONE]\n\n"
    )


class DataPlane:
    def __init__(
        self,
        *,
        registry: NodeRegistry,
        admission: AdmissionController,
        dispatcher_factory: Callable[[EnginePool], Dispatcher],
        limits: Limits,
        metrics_registry: CollectorRegistry,
        is_draining: Callable[[], bool],
        round_robin: bool = False,
    ) -> None:
        self.registry = registry
        self.admission = admission
        self.dispatcher_factory = dispatcher_factory
        self.dispatcher: Dispatcher | None = None
        self.limits = limits
        self.metrics = RequestMetrics(metrics_registry)
        self.is_draining = is_draining
        self.round_robin = round_robin
        self._turn = 0
        self.index: PrefixIndex[str] = PrefixIndex()
        self.prefill_inflight: dict[str, int] = defaultdict(int)
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._pool: EnginePool | None = None
        # Request ids: a random per-process prefix and a counter, unique across masters and
        # restarts without reading the system's random source per request (uuid4 does).
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count(1)

    def _new_request_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):016x}"

    # -- lifecycle ----------------------------------------------------------------------------
    def install(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)

    async def _open(self, _app: web.Application) -> None:
        self._pool = EnginePool()
        self.dispatcher = self.dispatcher_factory(self._pool)

    async def _close(self, _app: web.Application) -> None:
        if self._pool is not None:
            await self._pool.close()

    # -- routes -------------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_completion)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, parse_generate)

    async def models(self, _request: web.Request) -> web.Response:
        names = {self.limits.model} if self.limits.model else set()
        if not names:
            names = {n.start_args["model"] for n in self.registry.nodes.values() if n.start_args.get("model")}
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "pdcoord"} for m in sorted(names)
        ]
        return web.json_response({"object": "list", "data": data or [
            {"id": "default", "object": "model", "created": created, "owned_by": "pdcoord"}]})  # fmt: skip

    # -- the request path ---------------------------------------------------------------------
    def _error(self, endpoint: str, status: int, message: str, **kw: Any) -> web.Response:
        self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        kw.setdefault("type_", _ERROR_TYPES.get(status, "api_error"))
        return json_error(status, message, **kw)

    def _pick_prefill(self, estimate: Any) -> Node | None:
        candidates = self.registry.live(PREFILL)  # sorted by id, cached by the registry
        if not candidates:
            return None
        self._turn += 1
        if self.round_robin:
            return candidates[self._turn % len(candidates)]
        by_id = {n.node_id: n for n in candidates}
        loads = {nid: float(self.prefill_inflight[nid]) for nid in by_id}
        chosen = choose_prefill(estimate, loads, list(by_id), tie_breaker=self._turn)
        return by_id[chosen.node] if chosen is not None else None

    async def _handle(
        self, request: web.Request, parser: Callable[[bytes, Limits], ParsedRequest]
    ) -> web.StreamResponse:
        endpoint = request.path
        arrived = time.perf_counter()
        if self.is_draining():
            resp = self._error(
                endpoint,
                503,
                "this master is shutting down; retry on another",
                code="draining",
                retry_after=1,
            )
            resp.force_close()  # no keep-alive into a closing server
            return resp
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            limit = request.app._client_max_size
            return self._error(endpoint, 413, f"request body exceeds {limit} bytes (--max-body-bytes)")
        except RequestPayloadError as exc:  # e.g. Content-Encoding: gzip over a body that is not gzip
            return self._error(endpoint, 400, f"request body could not be read: {exc}".replace("\n", " "))
        try:
            parsed = parser(raw, self.limits)
        except InvalidRequest as exc:
            return self._error(endpoint, exc.status, exc.message, param=exc.param, code=exc.code)
        session_id = request.headers.get("X-Session-Id") or None
        if session_id is not None and len(session_id) > 256:
            return self._error(
                endpoint, 400, "X-Session-Id must be at most 256 characters", param="X-Session-Id"
            )
        request_id = request.headers.get("X-Request-Id") or self._new_request_id()
        # The prefix estimate is computed once here and reused for choosing the prefill node.
        hashes = self.index.hashes(parsed.input_ids if parsed.input_ids is not None else parsed.prompt_text)
        estimate = self.index.estimate(hashes)
        klass = self.admission.classify(session_id, estimate.hit_ratio)
        self.metrics.classified(klass.name.lower())

        self.inflight += 1
        self.idle.clear()
        try:
            async with self.admission.acquire(
                slots=parsed.n, request_class=klass, session_id=session_id
            ) as lease:
                decode = self.registry.nodes.get(lease.node or "")
                prefill = self._pick_prefill(estimate)
                if decode is None or prefill is None:
                    what = "prefill" if prefill is None else "decode"
                    return self._error(endpoint, 503, f"no {what} node available", retry_after=1)
                self.index.record(prefill.node_id, hashes)
                tags = {
                    "X-Request-Id": request_id,
                    "X-Admission-Class": klass.value,
                    "X-Admission-Wait-Ms": f"{lease.wait_s * 1000:.1f}",
                    "X-Decode-Node": decode.node_id,
                    "X-Prefill-Node": prefill.node_id,
                }
                return await self._dispatch(
                    request, endpoint, parsed, raw, prefill, decode, session_id, tags, arrived
                )
        except AdmissionRejected as exc:
            return self._error(endpoint, exc.status, exc.message, code=exc.code, retry_after=exc.retry_after)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()
            self.metrics.endpoint(endpoint).duration.observe(time.perf_counter() - arrived)

    async def _dispatch(
        self,
        request: web.Request,
        endpoint: str,
        parsed: ParsedRequest,
        raw: bytes,
        prefill: Node,
        decode: Node,
        session_id: str | None,
        tags: dict[str, str],
        arrived: float,
    ) -> web.StreamResponse:
        assert self.dispatcher is not None
        request_id = tags["X-Request-Id"]
        bport = prefill.start_args.get("bootstrap_port")
        headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        self.prefill_inflight[prefill.node_id] += 1
        try:
            upstream = await self.dispatcher.open(
                endpoint,
                parsed.body,
                Target(prefill.node_id, prefill.endpoint, int(bport) if bport and bport.isdigit() else None),
                Target(decode.node_id, decode.endpoint),
                headers,
                raw,
            )
        except UpstreamError as exc:
            return self._error(
                endpoint, exc.status, exc.message, type_="upstream_error", code="upstream_failed"
            )
        finally:
            self.prefill_inflight[prefill.node_id] -= 1
        try:
            if parsed.stream:
                return await self._relay_stream(request, endpoint, upstream, session_id, tags, arrived)
            body = await upstream.read()
            em = self.metrics.endpoint(endpoint)
            em.ttft.observe(time.perf_counter() - arrived)
            self._output_seen(session_id)
            em.ok.inc()
            return web.Response(body=body, content_type="application/json", headers=tags)
        except (OSError, TimeoutError) as exc:
            return self._error(
                endpoint, 502, f"decode {decode.node_id} failed: {exc}", type_="upstream_error"
            )
        finally:
            await upstream.close()

    def _output_seen(self, session_id: str | None) -> None:
        self.admission.observe_output(session_id)

    async def _relay_stream(
        self,
        request: web.Request,
        endpoint: str,
        upstream: UpstreamResponse,
        session_id: str | None,
        tags: dict[str, str],
        arrived: float,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **tags}
        )
        await resp.prepare(request)  # a StreamResponse sends its head here
        out = request.transport
        ex = upstream.exchange
        if out is None or out.is_closing():
            return resp  # the client is gone; closing the upstream tells the engine
        em = self.metrics.endpoint(endpoint)
        # aiohttp chose the framing in prepare(): chunked for HTTP/1.1, until-close for HTTP/1.0.
        chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
        first = True
        events = 0

        # Events are written to the client's transport from the engine socket's callback: no task
        # wakes per event. The head went out through aiohttp, and write_eof() below ends the body.
        def sink(data: bytes) -> None:
            nonlocal first, events
            if first:
                first = False
                em.ttft.observe(time.perf_counter() - arrived)
                self._output_seen(session_id)
            if out.is_closing():
                ex.abort(ConnectionResetError("the client went away"))
                return
            events += data.count(b"data:")
            out.write(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)
            if out.get_write_buffer_size() > _WRITE_HIGH:
                ex.pause()

        ex.relay(sink)
        try:
            while True:
                await ex.wait()
                if not ex.paused:
                    break
                # The client reads slower than the engine writes: stop reading the engine.
                await request.writer.drain()  # returns once the transport has room again
                ex.resume()
        except (OSError, TimeoutError) as exc:
            if out.is_closing():
                return resp
            # Headers are gone already: the error becomes an SSE event and the stream ends.
            await resp.write(_sse_error(f"decode stream failed: {exc}"))
        em.tokens.inc(events)
        em.ok.inc()
        if not out.is_closing():
            await resp.write_eof()
        return resp
