"""The master's HTTP surface (aiohttp): health, readiness, metrics and the admission snapshot.

The data-plane routes (OpenAI / SGLang API) are added by ``pdmaster.dataplane``.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pdmaster.registry import DECODE, PREFILL, NodeRegistry


def error_body(
    message: str, *, type_: str, code: str | int | None = None, param: str | None = None
) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


def json_error(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    code: str | int | None = None,
    param: str | None = None,
    retry_after: float | None = None,
) -> web.Response:
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(retry_after + 0.999)))
    return web.json_response(
        error_body(message, type_=type_, code=code, param=param), status=status, headers=headers
    )


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


class ControlRoutes:
    def __init__(
        self,
        *,
        master_id: str,
        registry: NodeRegistry,
        metrics_registry: CollectorRegistry,
        admission_snapshot: Callable[[], dict[str, Any]],
        is_draining: Callable[[], bool],
    ) -> None:
        self.master_id = master_id
        self.registry = registry
        self.metrics_registry = metrics_registry
        self.admission_snapshot = admission_snapshot
        self.is_draining = is_draining

    def install(self, app: web.Application, *, probes: bool = True, admin: bool = True) -> None:
        if probes:
            app.router.add_get("/health", self.health)
            app.router.add_get("/readiness", self.readiness)
        if admin:
            app.router.add_get("/metrics", self.metrics)
            app.router.add_get("/admission", self.admission)

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "master_id": self.master_id})

    def ready_reason(self) -> str | None:
        if self.is_draining():
            return "draining"
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

    async def admission(self, _request: web.Request) -> web.Response:
        body: dict[str, Any] = {
            "master_id": self.master_id,
            "capacity": self.registry.capacity,
            "draining": self.is_draining(),
            "nodes": self.registry.snapshot(),
        }
        snap = self.admission_snapshot()
        # the admission core's per-node view goes under its own key: "nodes" is the registry's
        if "nodes" in snap:
            snap["admission_nodes"] = snap.pop("nodes")
        body.update({k: v for k, v in snap.items() if k not in ("capacity", "master_id")})
        return web.Response(text=json.dumps(body), content_type="application/json")
