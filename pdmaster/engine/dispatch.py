"""How one admitted request is sent to its prefill and decode engines: one strategy per PD protocol,
chosen once at start-up (:func:`make_dispatch`).

``sglang``: the same body goes to P and D at once, carrying ``bootstrap_host``/``bootstrap_port``/
``bootstrap_room`` so D can pull the KV cache from P; the response streams from D.
``vllm``: P first (``max_tokens: 1``, ``stream: false``, ``kv_transfer_params.do_remote_decode``),
then D with the ``kv_transfer_params`` P returned.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pdmaster.engine.errors import EngineError
from pdmaster.engine.pool import EnginePool, Exchange, origin

__all__ = [
    "PROTOCOLS",
    "Dispatch",
    "EngineNode",
    "EngineResponse",
    "SGLangDispatch",
    "VLLMDispatch",
    "append_fields",
    "make_dispatch",
    "with_bootstrap",
]


class EngineNode(Protocol):
    """What dispatch needs of a node (the registry's ``Node`` is one)."""

    @property
    def node_id(self) -> str: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def bootstrap_port(self) -> int | None: ...


class EngineResponse:
    """D's answer (a 200): its body is read whole (``read()``) or relayed as it arrives (``relay()``,
    ``wait()``, ``pause()``/``resume()`` for back-pressure). ``close()`` frees both engines' sides."""

    __slots__ = ("_d", "_p", "content_type", "status")

    def __init__(self, decode: Exchange, prefill: Exchange | None = None) -> None:
        self._d = decode
        self._p = prefill
        self.status = decode.status
        self.content_type = decode.content_type

    async def read(self) -> bytes:
        return await self._d.read()

    def relay(self, sink: Callable[[bytes], None]) -> None:
        self._d.relay(sink)

    async def wait(self) -> None:
        """Until the body is complete or paused; raises EngineError if the engine failed."""
        await self._d.wait()

    @property
    def paused(self) -> bool:
        return self._d.paused

    def pause(self) -> None:
        self._d.pause()

    def resume(self) -> None:
        self._d.resume()

    def abort(self, error: EngineError) -> None:
        self._d.abort(error)

    @property
    def error(self) -> EngineError | None:
        """How D's exchange failed once it ended (None: not ended, or ended well)."""
        return self._d.error

    async def close(self) -> None:
        self._d.abort()  # a no-op once the body is complete
        if self._p is not None:
            self._p.abort()


def _failure(ex: Exchange, who: str, node: str | None = None) -> EngineError | None:
    """What the client should see for an engine's answer, or None if it was a 200."""
    if ex.error is not None and not ex.status:
        err = ex.error
        return EngineError(
            f"{who}: {err.message}",
            status=err.status,
            kind=err.kind,
            body=err.body,
            engine_status=err.engine_status,
            node=err.node or node,
        )
    if ex.status == 200:
        return None
    body = ex.body
    status = ex.status if 400 <= ex.status < 500 and ex.status != 429 else 502
    return EngineError(
        f"{who} answered HTTP {ex.status}: {body[:300].decode(errors='replace')}",
        status=status,
        kind="status",
        body=body,
        engine_status=ex.status,
        node=node,
    )


async def _sent(pool: EnginePool, node: EngineNode, path: str, data: bytes, headers: Mapping[str, str],
                *, discard: bool = False, check: Callable[[], None] | None = None) -> Exchange:  # fmt: skip
    """``pool.send`` to ``node``, its failure (no connection) named after the node."""
    try:
        return await pool.send(node.endpoint, path, data, headers, discard=discard, check=check)
    except EngineError as exc:
        if exc.node is None:
            exc.node = node.node_id
        raise


async def _answer(ex: Exchange, who: str, node: str | None = None) -> None:
    """Wait for ``ex``'s head; raise EngineError unless it is a 200 (reading the error body)."""
    try:
        await ex.head()
        if ex.status != 200:
            await ex.wait()
    except EngineError:
        pass  # described by _failure
    failure = _failure(ex, who, node)
    if failure is not None:
        ex.abort()
        raise failure


def append_fields(raw: bytes | None, has_members: bool, fields: bytes, unless: bytes) -> bytes | None:
    """The client's JSON text ``raw`` with the members ``fields`` (``"k":v,...``) appended, or None
    when it cannot be done in place: no text, text that does not end in ``}``, or text that holds
    ``unless`` (a key it would duplicate). Re-encoding a whole prompt with ``json.dumps`` is a
    visible share of the master's CPU per request; this is what lets the engines' bodies skip it.
    ``has_members``: the object is not empty (the fields need a comma before them)."""
    if raw is None or unless in raw:
        return None
    head = raw.rstrip()
    if not head.endswith(b"}"):
        return None
    return head[:-1] + (b"," if has_members else b"") + fields + b"}"


def with_bootstrap(raw: bytes | None, body: Mapping[str, Any], host: str, port: int, room: int) -> bytes:
    """The request for P and D: the client's JSON plus bootstrap_host/port/room, appended to the
    client's own text when possible (:func:`append_fields`), else the parsed body encoded afresh."""
    fields = f'"bootstrap_host":{json.dumps(host)},"bootstrap_port":{int(port)},"bootstrap_room":{room}'
    appended = append_fields(raw, bool(body), fields.encode(), b"bootstrap_")
    if appended is not None:
        return appended
    routed = dict(body)
    routed["bootstrap_host"] = host
    routed["bootstrap_port"] = port
    routed["bootstrap_room"] = room
    return json.dumps(routed).encode()


class Dispatch:
    """A PD protocol: ``open()`` sends one request to its P and D and returns D's 200 answer, or raises
    EngineError with what the client should see."""

    protocol = ""
    # Whether the engines need n > 1 split into single samples (see pdmaster/fanout.py).
    split_samples = False
    # Whether D's request goes out only after P answered (``prefill`` and ``decode`` apart), so that
    # the decode lease can be taken between them (two-stage admission).
    staged = False
    # The client routes this protocol's engines serve (the API refuses the others with a 400).
    routes: frozenset[str] = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    async def open(
        self,
        path: str,
        body: Mapping[str, Any],
        prefill: EngineNode,
        decode: EngineNode,
        headers: Mapping[str, str],
        raw: bytes | None = None,
        on_decode_sent: Callable[[], None] | None = None,
        may_send_decode: Callable[[], bool] | None = None,
    ) -> EngineResponse:
        """``raw``: the client's JSON text of ``body``, reused (not re-encoded) when possible;
        ``on_decode_sent``: called once D's request went out (from then on D holds it);
        ``may_send_decode``: asked just before, False when the slot it was placed on may no longer be
        this master's (EngineError ``lost``, which another pair may serve)."""
        raise NotImplementedError

    async def prefill(
        self, path: str, body: Mapping[str, Any], prefill: EngineNode, headers: Mapping[str, str]
    ) -> dict[str, Any]:
        """A ``staged`` protocol's first half: P's answer that D needs."""
        raise NotImplementedError(f"{self.protocol} sends P and D together")

    async def decode(
        self,
        path: str,
        body: Mapping[str, Any],
        params: Mapping[str, Any],
        decode: EngineNode,
        headers: Mapping[str, str],
        on_decode_sent: Callable[[], None] | None = None,
        may_send_decode: Callable[[], bool] | None = None,
    ) -> EngineResponse:
        """A ``staged`` protocol's second half: D's 200 answer (arguments as for ``open``)."""
        raise NotImplementedError(f"{self.protocol} sends P and D together")


class SGLangDispatch(Dispatch):
    protocol = "sglang"
    split_samples = True  # SGLang sends every sample of a prompt with the prompt's one room

    async def open(
        self,
        path: str,
        body: Mapping[str, Any],
        prefill: EngineNode,
        decode: EngineNode,
        headers: Mapping[str, str],
        raw: bytes | None = None,
        on_decode_sent: Callable[[], None] | None = None,
        may_send_decode: Callable[[], bool] | None = None,
    ) -> EngineResponse:
        port = prefill.bootstrap_port
        if port is None:
            raise EngineError(
                f"prefill node {prefill.node_id} registered no bootstrap_port", status=503, kind="config"
            )
        data = with_bootstrap(raw, body, origin(prefill.endpoint).host, port, random.getrandbits(63))
        guard = _decode_guard(decode, may_send_decode)
        if guard is not None:
            guard()  # no P for a slot that is no longer ours
        # The same body goes to P and D at once; P's answer is dropped as it arrives.
        p = await _sent(self.pool, prefill, path, data, headers, discard=True)
        try:
            # Asked again with D's connection in hand: sending P (a new connection) may have awaited
            # across a pause of this process, after which the slot may be another master's.
            d = await _sent(self.pool, decode, path, data, headers, check=guard)
        except BaseException:
            p.abort()
            raise
        if on_decode_sent is not None:
            on_decode_sent()
        who = f"prefill {prefill.node_id}"

        def prefill_done(ex: Exchange) -> None:
            failure = _failure(ex, who, prefill.node_id)
            if failure is not None and not d.status:
                # D would wait for a KV transfer that never comes: stop waiting for its answer.
                d.abort(failure)

        p.on_done(prefill_done)
        try:
            await _answer(d, f"decode {decode.node_id}", decode.node_id)
        except BaseException:
            p.abort()
            raise
        return EngineResponse(d, p)


_KV_PREFILL = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class VLLMDispatch(Dispatch):
    """P first, then D with what P returned. The two halves are also offered apart (``prefill``,
    ``decode``): a master that admits in two stages takes the decode lease between them."""

    protocol = "vllm"
    routes = frozenset({"/v1/chat/completions", "/v1/completions"})  # vLLM has no /generate
    staged = True

    async def open(
        self,
        path: str,
        body: Mapping[str, Any],
        prefill: EngineNode,
        decode: EngineNode,
        headers: Mapping[str, str],
        raw: bytes | None = None,
        on_decode_sent: Callable[[], None] | None = None,
        may_send_decode: Callable[[], bool] | None = None,
    ) -> EngineResponse:
        params = await self.prefill(path, body, prefill, headers)
        return await self.decode(path, body, params, decode, headers, on_decode_sent, may_send_decode)

    async def prefill(
        self, path: str, body: Mapping[str, Any], prefill: EngineNode, headers: Mapping[str, str]
    ) -> dict[str, Any]:
        """P's ``kv_transfer_params`` for ``body`` (P computes one token and keeps the KV for D)."""
        p_body = dict(body)
        p_body["stream"] = False
        p_body.pop("stream_options", None)
        # vLLM refuses min_tokens > max_tokens: P computes one token, D keeps the client's minimum.
        p_body.pop("min_tokens", None)
        p_body.pop("min_completion_tokens", None)
        p_body["max_tokens"] = 1
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        if "sampling_params" in p_body and isinstance(p_body["sampling_params"], dict):
            p_body["sampling_params"] = {**p_body["sampling_params"], "max_new_tokens": 1, "n": 1}
        p_body["n"] = 1
        p_body["kv_transfer_params"] = dict(_KV_PREFILL)
        p = await _sent(self.pool, prefill, path, json.dumps(p_body).encode(), headers)
        try:
            await _answer(p, f"prefill {prefill.node_id}", prefill.node_id)
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
            raise EngineError(
                f"prefill {prefill.node_id} returned no kv_transfer_params",
                kind="protocol",
                node=prefill.node_id,
            )
        return params

    async def decode(
        self,
        path: str,
        body: Mapping[str, Any],
        params: Mapping[str, Any],
        decode: EngineNode,
        headers: Mapping[str, str],
        on_decode_sent: Callable[[], None] | None = None,
        may_send_decode: Callable[[], bool] | None = None,
    ) -> EngineResponse:
        """D's 200 answer to ``body`` with P's ``params``."""
        d_body = dict(body)
        d_body["kv_transfer_params"] = dict(params)
        # the prefill took a while: is the slot still ours? (asked with D's connection in hand)
        d = await _sent(
            self.pool, decode, path, json.dumps(d_body).encode(), headers,
            check=_decode_guard(decode, may_send_decode),
        )  # fmt: skip
        if on_decode_sent is not None:
            on_decode_sent()
        try:
            await _answer(d, f"decode {decode.node_id}", decode.node_id)
        except BaseException:
            d.abort()
            raise
        return EngineResponse(d)


def _decode_guard(decode: EngineNode, may_send: Callable[[], bool] | None) -> Callable[[], None] | None:
    """What ``pool.send`` calls just before D's request is written (None: nothing to ask).

    Strict handover: an agent may free a lost master's slots once no engine sample shows them in
    use, and a decode request that was not yet sent shows in none, so none goes out after the loss."""
    return None if may_send is None else lambda: _check_decode(decode, may_send)


def _check_decode(decode: EngineNode, may_send: Callable[[], bool]) -> None:
    if not may_send():
        raise EngineError(
            f"decode {decode.node_id}: this master lost its stream to the node's agent before the decode "
            "request went out",
            status=503,
            kind="lost",
            node=decode.node_id,
        )


PROTOCOLS: dict[str, type[Dispatch]] = {"sglang": SGLangDispatch, "vllm": VLLMDispatch}


def make_dispatch(protocol: str, pool: EnginePool) -> Dispatch:
    try:
        return PROTOCOLS[protocol](pool)
    except KeyError:
        raise ValueError(f"unknown engine protocol {protocol!r} (one of {', '.join(PROTOCOLS)})") from None
