"""The OpenAI error envelope: the JSON body of every error the master answers, whole or as the last
event of a stream (``pdmaster.api``, ``pdmaster.relay``)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

__all__ = ["ERROR_TYPES", "error_body", "json_error"]

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


def error_body(
    message: str, *, type_: str, code: str | int | None = None, param: str | None = None
) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


def json_error(
    status: int,
    message: str,
    *,
    type_: str | None = None,
    code: str | int | None = None,
    param: str | None = None,
    retry_after: float | None = None,
) -> web.Response:
    """An error response with the envelope; ``Retry-After`` in whole seconds, rounded up."""
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, int(retry_after + 0.999)))
    type_ = type_ or ERROR_TYPES.get(status, "api_error")
    return web.json_response(
        error_body(message, type_=type_, code=code, param=param), status=status, headers=headers
    )
