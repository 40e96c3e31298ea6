"""Dispatch adapters: how one admitted request is sent to its prefill and decode servers.

``sglang``: the same body goes to P and D at once, carrying ``bootstrap_host``/``bootstrap_port``/
``bootstrap_room`` so D can pull the KV cache from P; the response streams from D.
``vllm``: P first (``max_tokens: 1``, ``stream: false``, ``kv_transfer_params.do_remote_decode``),
then D with the ``kv_transfer_params`` P returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp


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
    """D's response: status, headers that matter, and a body stream; ``close()`` frees it."""

    status: int
    content_type: str
    resp: aiohttp.ClientResponse
    prefill_task: asyncio.Task[None] | None = None

    def chunks(self) -> AsyncIterator[bytes]:
        return self.resp.content.iter_any()

    async def read(self) -> bytes:
        return await self.resp.read()

    async def close(self) -> None:
        self.resp.close()
        if self.prefill_task is not None and not self.prefill_task.done():
            self.prefill_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.prefill_task


async def _check(resp: aiohttp.ClientResponse, who: str) -> None:
    if resp.status == 200:
        return
    body = await resp.read()
    status = resp.status if 400 <= resp.status < 500 and resp.status != 429 else 502
    raise UpstreamError(
        status, f"{who} answered HTTP {resp.status}: {body[:300].decode(errors='replace')}", body
    )


@functools.lru_cache(maxsize=1024)
def _hostname(endpoint: str) -> str:
    return urlsplit(endpoint).hostname or "127.0.0.1"


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
    def __init__(self, protocol: str, session: aiohttp.ClientSession, *, timeout_s: float = 600.0) -> None:
        if protocol not in ("sglang", "vllm"):
            raise ValueError(f"unknown engine protocol {protocol!r}")
        self.protocol = protocol
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0)

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
        except aiohttp.ClientError as exc:
            raise UpstreamError(502, f"engine unreachable: {exc}") from exc
        except TimeoutError as exc:
            raise UpstreamError(504, "engine timed out") from exc

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
            raw, body, _hostname(prefill.endpoint), prefill.bootstrap_port, random.getrandbits(63)
        )
        decode_req = asyncio.ensure_future(
            self.session.post(decode.endpoint + path, data=data, headers=headers, timeout=self.timeout)
        )
        failure: list[UpstreamError] = []

        async def run_prefill() -> None:
            try:
                async with self.session.post(
                    prefill.endpoint + path, data=data, headers=headers, timeout=self.timeout
                ) as resp:
                    await _check(resp, f"prefill {prefill.node_id}")
                    await resp.read()
                return
            except UpstreamError as exc:
                failure.append(exc)
            except (aiohttp.ClientError, TimeoutError) as exc:
                failure.append(UpstreamError(502, f"prefill {prefill.node_id} failed: {exc}"))
            # D would wait for a KV transfer that never comes: stop waiting for its headers
            # (a no-op when D has answered already).
            decode_req.cancel()

        prefill_task = asyncio.create_task(run_prefill())
        # Awaiting D directly (no asyncio.wait over two futures) keeps the per-request cost low;
        # a prefill failure reaches us as the cancellation of D's request.
        try:
            resp = await decode_req
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if failure and me is not None and not me.cancelling():
                raise failure[0] from None
            prefill_task.cancel()
            raise
        except BaseException:
            prefill_task.cancel()
            raise
        try:
            await _check(resp, f"decode {decode.node_id}")
        except BaseException:
            prefill_task.cancel()
            raise
        return UpstreamResponse(resp.status, resp.content_type, resp, prefill_task)

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
        async with self.session.post(
            prefill.endpoint + path, json=p_body, headers=headers, timeout=self.timeout
        ) as resp:
            await _check(resp, f"prefill {prefill.node_id}")
            answer = await resp.json(content_type=None)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            raise UpstreamError(502, f"prefill {prefill.node_id} returned no kv_transfer_params")
        d_body = dict(body)
        d_body["kv_transfer_params"] = params
        resp = await self.session.post(
            decode.endpoint + path, json=d_body, headers=headers, timeout=self.timeout
        )
        try:
            await _check(resp, f"decode {decode.node_id}")
        except BaseException:
            resp.close()
            raise
        return UpstreamResponse(resp.status, resp.content_type, resp)
