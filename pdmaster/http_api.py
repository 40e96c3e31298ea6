"""The master's HTTP surface (aiohttp): health, readiness, metrics and the admission snapshot.

The data-plane routes (OpenAI / SGLang API) are added by ``pdmaster.dataplane``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
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

    def install(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/readiness", self.readiness)
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
