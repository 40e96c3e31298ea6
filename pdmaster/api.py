"""The master's HTTP surface (aiohttp): the OpenAI / SGLang routes, the control routes (health,
readiness, metrics, the admission snapshot), API-key authentication, and the hardening of aiohttp
against malformed requests. The OpenAI error envelope is ``pdmaster.errors`` (re-exported here).

The OpenAI routes read and parse the request (``validation``) and hand it to the request pipeline
(``pipeline``); a stage that fails raises ``RequestFailed``, rendered here as an OpenAI error.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import http_exceptions, web, web_protocol, web_urldispatcher
from aiohttp.http import HttpVersion11
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pdmaster.context import RequestContext, RequestFailed
from pdmaster.engine.dispatch import PROTOCOLS
from pdmaster.errors import error_body, json_error
from pdmaster.lifecycle import Lifecycle
from pdmaster.metrics import RequestMetrics
from pdmaster.registry import DECODE, PREFILL, NodeRegistry
from pdmaster.validation import (
    InvalidRequest,
    Limits,
    ParsedRequest,
    parse_chat,
    parse_completion,
    parse_generate,
)

if TYPE_CHECKING:
    from pdmaster.pipeline import RequestPipeline

__all__ = [
    "ControlRoutes",
    "OpenAIRoutes",
    "api_key_middleware",
    "error_body",
    "harden_aiohttp",
    "json_error",
    "load_api_keys",
]

# -- API keys --------------------------------------------------------------------------------------
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def load_api_keys(keys: Sequence[str], keys_file: str | None) -> list[bytes]:
    """API keys from the flag values and the file (one per line; blank lines and ``#`` comments ignored).

    ValueError, naming the flag, when the file cannot be read or holds no key.
    """
    out = [k.strip() for k in keys if k.strip()]
    if keys_file is not None:
        try:
            lines = Path(keys_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-keys-file {keys_file}: cannot read: {exc}") from exc
        from_file = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        if not from_file:
            raise ValueError(f"--api-keys-file {keys_file}: holds no key")
        out += from_file
    return [k.encode() for k in dict.fromkeys(out)]


def _bearer_matches(header: str | None, keys: Sequence[bytes]) -> bool:
    if header is None:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    presented = token.strip().encode("utf-8", "surrogateescape")
    # Compare against every key, without stopping early, so timing says nothing about which matched.
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(presented, key)
    return ok


def api_key_middleware(keys: Sequence[bytes], *, open_paths: Collection[str]) -> Any:
    """Refuse requests without ``Authorization: Bearer <one of keys>`` with a 401 OpenAI error."""
    frozen = list(keys)

    @web.middleware
    async def check_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths or _bearer_matches(request.headers.get("Authorization"), frozen):
            return await handler(request)
        missing = "Authorization" not in request.headers
        resp = json_error(
            401,
            "Missing API key: send 'Authorization: Bearer <key>'"
            if missing
            else "Incorrect API key provided",
            type_="authentication_error",
            code="missing_api_key" if missing else "invalid_api_key",
        )
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp

    return check_api_key


# -- aiohttp hardening -----------------------------------------------------------------------------
class _MalformedRequestFilter(logging.Filter):
    """aiohttp logs every unparsable request (a 400 it already answered) with a traceback at ERROR;
    from hostile or broken clients that is noise an attacker controls. Keep one line at INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, http_exceptions.HttpProcessingError) and (exc.code or 400) < 500:
            detail = exc.message
        elif isinstance(exc, web_protocol.RequestPayloadError):  # e.g. a body that is not the gzip it claims
            detail = str(exc).replace("\n", " ")
        else:
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args, record.exc_info = "refused malformed HTTP request: %s", (detail,), None
        return True


_MALFORMED_FILTER = _MalformedRequestFilter()


async def _expect_handler(request: web.Request) -> None:
    """aiohttp's default, except that an unknown Expect value is not echoed: aiohttp 3.14 echoes it
    into its 417 text and a non-UTF-8 value then fails the encode, answering 500."""
    if request.version == HttpVersion11:
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        else:
            raise web.HTTPExpectationFailed(text="unsupported Expect header (only 100-continue)")


def harden_aiohttp() -> None:
    """Install the two fixes above; idempotent. Call before building the applications: routes,
    including the router's own 404/405 routes, look the default expect handler up when created, and
    aiohttp offers no per-application setting for it."""
    web_urldispatcher._default_expect_handler = _expect_handler
    logging.getLogger("aiohttp.server").addFilter(_MALFORMED_FILTER)


# -- control routes --------------------------------------------------------------------------------
class ControlRoutes:
    def __init__(
        self,
        *,
        master_id: str,
        registry: NodeRegistry,
        metrics_registry: CollectorRegistry,
        admission_snapshot: Callable[[], dict[str, Any]],
        lifecycle: Lifecycle,
    ) -> None:
        self.master_id = master_id
        self.registry = registry
        self.metrics_registry = metrics_registry
        self.admission_snapshot = admission_snapshot
        self.lifecycle = lifecycle

    def install(self, app: web.Application, *, probes: bool = True, admin: bool = True) -> None:
        if probes:
            app.router.add_get("/health", self.health)
            app.router.add_get("/readiness", self.readiness)
        if admin:
            app.router.add_get("/metrics", self.metrics)
            app.router.add_get("/admission", self.admission)

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "master_id": self.master_id, "registered": self.lifecycle.registered}
        )

    def ready_reason(self) -> str | None:
        if self.lifecycle.draining:
            return "draining"
        if self.lifecycle.lease_lost:
            return "etcd lease lost (no renewal confirmed in time; re-registering)"
        if not self.lifecycle.registered:
            return "not registered in etcd"
        if not self.registry.live(PREFILL):
            return "no prefill node holds a share"
        if not self.registry.live(DECODE):
            return "no decode node holds a share"
        return None

    async def readiness(self, _request: web.Request) -> web.Response:
        reason = self.ready_reason()
        if reason is None:
            return web.json_response({"ready": True, "master_id": self.master_id})
        return web.json_response({"ready": False, "reason": reason, "master_id": self.master_id}, status=503)

    async def metrics(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics_registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def admission(self, request: web.Request) -> web.Response:
        if request.query.get("nodes") == "0":
            # The totals only: O(1), for pollers of a thousand-node fleet (the full body is O(nodes)).
            return web.json_response(
                {
                    "master_id": self.master_id,
                    "capacity": self.registry.capacity,
                    "draining": self.lifecycle.draining,
                    "streams": self.registry.connected_streams,
                }
            )
        body: dict[str, Any] = {
            "master_id": self.master_id,
            "capacity": self.registry.capacity,
            "draining": self.lifecycle.draining,
            "nodes": self.registry.snapshot(),
        }
        snap = self.admission_snapshot()
        # the admission core's per-node view goes under its own key: "nodes" is the registry's
        if "nodes" in snap:
            snap["admission_nodes"] = snap.pop("nodes")
        body.update({k: v for k, v in snap.items() if k not in ("capacity", "master_id")})
        return web.Response(text=json.dumps(body), content_type="application/json")


# -- OpenAI / SGLang routes ------------------------------------------------------------------------
class OpenAIRoutes:
    def __init__(
        self,
        *,
        pipeline: RequestPipeline,
        registry: NodeRegistry,
        limits: Limits,
        lifecycle: Lifecycle,
        metrics: RequestMetrics,
        engine_protocol: str = "sglang",
    ) -> None:
        self.pipeline = pipeline
        self.registry = registry
        self.limits = limits
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.protocol = engine_protocol
        self.protocol_routes = PROTOCOLS[engine_protocol].routes

    def install(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)

    async def _open(self, _app: web.Application) -> None:
        await self.pipeline.open()

    async def _close(self, _app: web.Application) -> None:
        await self.pipeline.close()

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

    def _error(self, endpoint: str, status: int, message: str, **kw: Any) -> web.Response:
        self.metrics.failed(endpoint, status)
        return json_error(status, message, **kw)

    async def _handle(
        self, request: web.Request, parser: Callable[[bytes, Limits], ParsedRequest]
    ) -> web.StreamResponse:
        endpoint = request.path
        arrived = time.perf_counter()
        if self.lifecycle.draining:
            resp = self._error(
                endpoint,
                503,
                "this master is shutting down; retry on another",
                code="draining",
                retry_after=1,
            )
            resp.force_close()  # no keep-alive into a closing server
            return resp
        if self.lifecycle.lease_lost:
            # Its key may be gone from etcd: the agents hand its shares to the other masters.
            return self._error(
                endpoint,
                503,
                "this master cannot confirm its registration in etcd, so it admits nothing new until "
                "it can; retry on another master",
                code="etcd_lease_lost",
                retry_after=1,
            )
        if endpoint not in self.protocol_routes:
            return self._error(
                endpoint,
                400,
                f"{endpoint} is not served by {self.protocol} engines (--engine-protocol {self.protocol}); "
                "use /v1/completions or /v1/chat/completions",
                code="unsupported_by_engine_protocol",
            )
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
        ctx = RequestContext(
            request=request,
            endpoint=endpoint,
            arrived=arrived,
            metrics=self.metrics.endpoint(endpoint),
            parsed=parsed,
            raw=raw,
            session_id=session_id,
            request_id=request.headers.get("X-Request-Id") or self.pipeline.new_id(),
        )
        try:
            return await self.pipeline.serve(ctx)
        except RequestFailed as exc:
            return self._error(
                endpoint,
                exc.status,
                exc.message,
                type_=exc.type_,
                code=exc.code,
                param=exc.param,
                retry_after=exc.retry_after,
            )
