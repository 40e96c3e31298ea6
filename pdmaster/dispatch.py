"""Dispatch adapters: how one admitted request is sent to its prefill and decode servers.

``sglang``: the same body goes to P and D at once, carrying ``bootstrap_host``/``bootstrap_port``/
``bootstrap_room`` so D can pull the KV cache from P; the response streams from D.
``vllm``: P first (``max_tokens: 1``, ``stream: false``, ``kv_transfer_params.do_remote_decode``),
then D with the ``kv_transfer_params`` P returned.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from pdmaster.upstream import EnginePool, Exchange, origin


class UpstreamError(Exception):
    """An engine failed; ``status`` is what the client should see (502/503/504 or the engine's 4xx)."""

    def __init__(self, status: int, message: str, body: bytes | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.body = body


@dataclass(frozen=True)
class Target:
    node_id: str
    endpoint: str
    bootstrap_port: int | None = None


@dataclass
class UpstreamResponse:
    """D's response: status, content type and its exchange; ``close()`` frees both sides."""

    status: int
    content_type: str
    exchange: Exchange
    prefill: Exchange | None = None

    async def read(self) -> bytes:
        return await self.exchange.read()

    async def close(self) -> None:
        self.exchange.abort()  # a no-op once the body is complete
        if self.prefill is not None:
            self.prefill.abort()


def _failure(ex: Exchange, who: str) -> UpstreamError | None:
    """What the client should see for an engine's answer, or None if it was a 200."""
    if ex.error is not None and not ex.status:
        if isinstance(ex.error, UpstreamError):
            return ex.error
        if isinstance(ex.error, TimeoutError):
            return UpstreamError(504, f"{who} timed out: {ex.error}")
        return UpstreamError(502, f"{who} failed: {ex.error}")
    if ex.status == 200:
        return None
    body = ex.body
    status = ex.status if 400 <= ex.status < 500 and ex.status != 429 else 502
    return UpstreamError(
        status, f"{who} answered HTTP {ex.status}: {body[:300].decode(errors='replace')}", body
    )


async def _answer(ex: Exchange, who: str) -> None:
    """Wait for ``ex``'s head; raise UpstreamError unless it is a 200 (reading the error body)."""
    try:
        await ex.head()
        if ex.status != 200:
            await ex.wait()
    except (OSError, TimeoutError):
        pass  # described by _failure
    failure = _failure(ex, who)
    if failure is not None:
        ex.abort()
        raise failure


def with_bootstrap(raw: bytes | None, body: dict[str, Any], host: str, port: int, room: int) -> bytes:
    """The request for P and D: the client's JSON plus bootstrap_host/port/room.

    When the client's own bytes end in ``}`` and carry no bootstrap field, the three fields are
    appended to them: re-encoding the whole body with ``json.dumps`` is a visible share of the
    master's CPU per request. Otherwise the parsed body is encoded afresh.
    """
    if raw is not None and b"bootstrap_" not in raw:
        head = raw.rstrip()
        if head.endswith(b"}"):
            fields = (
                f'"bootstrap_host":{json.dumps(host)},"bootstrap_port":{int(port)},"bootstrap_room":{room}}}'
            )
            return head[:-1] + (b"," if body else b"") + fields.encode()
    routed = dict(body)
    routed["bootstrap_host"] = host
    routed["bootstrap_port"] = port
    routed["bootstrap_room"] = room
    return json.dumps(routed).encode()


class Dispatcher:
    def __init__(self, protocol: str, pool: EnginePool) -> None:
        if protocol not in ("sglang", "vllm"):
            raise ValueError(f"unknown engine protocol {protocol!r}")
        self.protocol = protocol
        self.pool = pool

    async def open(
        self,
        path: str,
        body: dict[str, Any],
        prefill: Target,
        decode: Target,
        headers: dict[str, str],
        raw: bytes | None = None,
    ) -> UpstreamResponse:
        """``raw``: the client's JSON text of ``body``, reused (not re-encoded) when possible."""
        try:
            if self.protocol == "sglang":
                return await self._sglang(path, body, prefill, decode, headers, raw)
            return await self._vllm(path, body, prefill, decode, headers)
        except TimeoutError as exc:
            raise UpstreamError(504, f"engine timed out: {exc}") from exc
        except OSError as exc:
            raise UpstreamError(502, f"engine unreachable: {exc}") from exc

    async def _sglang(
        self,
        path: str,
        body: dict[str, Any],
        prefill: Target,
        decode: Target,
        headers: dict[str, str],
        raw: bytes | None = None,
    ) -> UpstreamResponse:
        if prefill.bootstrap_port is None:
            raise UpstreamError(503, f"prefill node {prefill.node_id} registered no bootstrap_port")
        data = with_bootstrap(
            raw, body, origin(prefill.endpoint).host, prefill.bootstrap_port, random.getrandbits(63)
        )
        # The same body goes to P and D at once; P's answer is dropped as it arrives.
        p = await self.pool.send(prefill.endpoint, path, data, headers, discard=True)
        try:
            d = await self.pool.send(decode.endpoint, path, data, headers)
        except BaseException:
            p.abort()
            raise
        who = f"prefill {prefill.node_id}"

        def prefill_done(ex: Exchange) -> None:
            failure = _failure(ex, who)
            if failure is not None and not d.status:
                # D would wait for a KV transfer that never comes: stop waiting for its answer.
                d.abort(failure)

        p.on_done(prefill_done)
        try:
            await _answer(d, f"decode {decode.node_id}")
        except BaseException:
            p.abort()
            raise
        return UpstreamResponse(d.status, d.content_type, d, p)

    async def _vllm(
        self, path: str, body: dict[str, Any], prefill: Target, decode: Target, headers: dict[str, str]
    ) -> UpstreamResponse:
        p_body = dict(body)
        p_body["stream"] = False
        p_body.pop("stream_options", None)
        p_body["max_tokens"] = 1
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        if "sampling_params" in p_body and isinstance(p_body["sampling_params"], dict):
            p_body["sampling_params"] = {**p_body["sampling_params"], "max_new_tokens": 1, "n": 1}
        p_body["n"] = 1
        p_body["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        p = await self.pool.send(prefill.endpoint, path, json.dumps(p_body).encode(), headers)
        try:
            await _answer(p, f"prefill {prefill.node_id}")
            answer_bytes = await p.read()
        except BaseException:
            p.abort()
            raise
        try:
            answer = json.loads(answer_bytes)
        except ValueError:
            answer = None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            raise UpstreamError(502, f"prefill {prefill.node_id} returned no kv_transfer_params")
        d_body = dict(body)
        d_body["kv_transfer_params"] = params
        d = await self.pool.send(decode.endpoint, path, json.dumps(d_body).encode(), headers)
        try:
            await _answer(d, f"decode {decode.node_id}")
        except BaseException:
            d.abort()
            raise
        return UpstreamResponse(d.status, d.content_type, d)
