"""The one error type of the engine client."""

from __future__ import annotations

__all__ = ["EngineError"]


class EngineError(Exception):
    """An exchange with an engine failed.

    ``status`` is what the client should see: 502 when the engine was unreachable, broke the protocol
    or closed the connection; 504 when it did not answer in time; 503 when the node cannot serve the
    request as registered; or the engine's own 4xx. ``kind`` names the failure for logs and metrics
    (``connect``, ``timeout``, ``closed``, ``protocol``, ``status``, ``aborted``, ``config``).
    ``body`` holds an error answer's body when there was one. ``engine_status`` is the engine's own
    HTTP status (0 when it sent none) and ``node`` the id of the node whose engine failed, when known:
    the circuit breaker counts the failure against that node.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 502,
        kind: str = "closed",
        body: bytes | None = None,
        engine_status: int = 0,
        node: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind
        self.body = body
        self.engine_status = engine_status
        self.node = node
