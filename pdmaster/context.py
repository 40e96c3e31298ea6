"""What one client request carries through the stages of the request path (``pipeline``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web

    from pdmaster.admission import RequestClass
    from pdmaster.admission_controller import Lease
    from pdmaster.metrics import EndpointMetrics
    from pdmaster.prefix_index import PrefixEstimate
    from pdmaster.registry import Node
    from pdmaster.validation import ParsedRequest

__all__ = ["RequestContext", "RequestFailed"]


@dataclass(slots=True, eq=False)
class RequestContext:
    request: web.Request
    endpoint: str  # the route's path, also the metrics label
    arrived: float  # perf_counter() at arrival
    metrics: EndpointMetrics
    parsed: ParsedRequest
    raw: bytes  # the client's JSON text, reused for the engines when possible
    session_id: str | None
    request_id: str  # the client's X-Request-Id (or ours): logs and the response header
    engine_request_id: str = ""  # fresh per dispatch: engines key their own state by it
    # Filled in by the stages, in order.
    hashes: list[int] = field(default_factory=list)
    estimate: PrefixEstimate[str] | None = None
    request_class: RequestClass | None = None
    from_peer: bool = False  # another master spilled it here (X-Pdcoord-Spilled, pdmaster/spill.py)
    lease: Lease | None = None
    prefill: Node | None = None
    decode: Node | None = None
    headers: dict[str, str] = field(default_factory=dict)  # for the client's response
    # Circuit-breaker permissions of the current attempt (node id -> token), settled once it ends.
    permits: dict[str, int] = field(default_factory=dict)
    retries: int = 0  # attempts made again on another P/D pair after a failure before the first byte
    tokens: int = 0  # KV tokens its lease charges on the decode node (pdmaster/token_charge.py)
    prompt_tokens: int = 0  # its prompts' tokens (exact for ids, estimated for text)
    # Prefill in tokens (pdmaster/routing.py): the prompt tokens its prefill node had to compute before
    # its last one when it was sent, and (node, its own uncached tokens) while they wait there.
    tokens_ahead: int = 0
    prefill_backlog: tuple[str, int] | None = None

    def engine_headers(self, engine_request_id: str) -> dict[str, str]:
        """What every engine request of this client request carries; the id is fresh per dispatch."""
        return {"X-Request-Id": engine_request_id, "Content-Type": "application/json"}


class RequestFailed(Exception):
    """A stage ends the request with an HTTP error (the API renders it as an OpenAI error)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str | None = None,
        code: str | int | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type_ = type_
        self.code = code
        self.param = param
        self.retry_after = retry_after
