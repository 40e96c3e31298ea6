"""The simulated engine: aiohttp handlers around the prefix cache, the slot pool and the KV rooms."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import ClientSession, ClientTimeout, web
from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdsim.cache import PrefixCache, count_tokens
from pdsim.kvstore import KVStore
from pdsim.protocol import (
    SSE_DONE,
    Api,
    BadRequest,
    Formatter,
    GenRequest,
    Limits,
    error_body,
    parse_request,
    sse,
)
from pdsim.slots import SlotPool

log = logging.getLogger("pdsim")

Role = Literal["prefill", "decode"]
VERSION = "pdsim-0.1.0"


@dataclass(frozen=True, slots=True)
class Timing:
    prefill_base_ms: float
    prefill_per_token_ms: float
    decode_base_ms: float
    decode_per_seq_ms: float


@dataclass(frozen=True, slots=True)
class Config:
    role: Role
    host: str
    advertise_host: str
    model: str
    running_max_req_size: int
    max_n: int
    context_length: int
    default_max_tokens: int
    max_total_tokens: int
    cache_blocks: int
    cache_block_tokens: int
    prefill_parallel: int
    kv_wait_timeout_s: float
    kv_ttl_s: float
    max_body_bytes: int
    timing: Timing


class KVTransferError(Exception):
    pass


class _Collector(Collector):
    """Gauges read from the engine's state at scrape time, under both SGLang's and vLLM's names."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        pool = e.pool
        usage = min(1.0, e.kv_tokens / e.cfg.max_total_tokens)
        labels = {"model_name": e.cfg.model}

        def gauge(name: str, doc: str, value: float, labelled: bool = True) -> GaugeMetricFamily:
            if not labelled:
                return GaugeMetricFamily(name, doc, value=value)
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            g.add_metric(list(labels.values()), value)
            return g

        yield gauge("sglang:num_running_reqs", "Running sequences (slots in use).", pool.running)
        yield gauge(
            "sglang:num_queue_reqs", "Sequences waiting for a slot inside the engine.", pool.waiting_slots
        )
        yield gauge("sglang:token_usage", "Fraction of the KV token pool in use.", usage)
        yield gauge("vllm:num_requests_running", "Running sequences (slots in use).", pool.running)
        yield gauge("vllm:num_requests_waiting", "Sequences waiting for a slot.", pool.waiting_slots)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache in use (0-1).", usage)
        yield gauge("pdsim_running", "Slots in use.", pool.running, False)
        yield gauge("pdsim_waiting_requests", "Requests waiting for slots.", pool.waiting_requests, False)
        yield gauge("pdsim_max_running", "Peak slots in use since start.", pool.max_running, False)
        yield gauge("pdsim_capacity", "running_max_req_size.", pool.capacity, False)
        yield gauge("pdsim_kv_waiting", "Decode requests waiting for their KV transfer.", e.kv_waiting, False)
        yield gauge("pdsim_kv_rooms", "KV transfer rooms held by the bootstrap listener.", len(e.kv), False)
        c = CounterMetricFamily(
            "pdsim_queued", "Requests that ever had to wait for a slot inside the engine."
        )
        c.add_metric([], pool.queued_total)
        yield c


class Engine:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.limits = Limits(cfg.max_n, cfg.context_length, cfg.default_max_tokens)
        self.engine_id = f"pdsim-{uuid.uuid4().hex[:12]}"
        self.pool = SlotPool(cfg.running_max_req_size)
        self.cache = PrefixCache(cfg.cache_blocks, cfg.cache_block_tokens)
        self.kv = KVStore(cfg.kv_ttl_s)
        self.kv_tokens = 0
        self.kv_waiting = 0  # decode requests waiting for their KV transfer
        self.bootstrap_port = 0  # set once the bootstrap listener is bound
        self._prefill_sem = asyncio.Semaphore(cfg.prefill_parallel)
        self._client: ClientSession | None = None
        disable_created_metrics()  # keep the scrape small: no *_created series
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_total = Counter("pdsim_requests", "Valid generation requests.", registry=r)
        self.bad_requests_total = Counter("pdsim_bad_requests", "Requests refused with a 4xx.", registry=r)
        self.cancelled_total = Counter(
            "pdsim_cancelled", "Requests whose client went away before completion.", registry=r
        )
        self.errors_total = Counter(
            "pdsim_errors", "Requests failed by the engine (e.g. KV transfer).", registry=r
        )
        self.tokens_total = Counter("pdsim_tokens", "Generated tokens (all choices).", registry=r)
        self.prompt_tokens_total = Counter("pdsim_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.cached_tokens_total = Counter(
            "pdsim_cached_tokens", "Prompt tokens found in the prefix cache.", registry=r
        )
        self.kv_transfers_total = Counter("pdsim_kv_transfers", "KV transfers completed.", registry=r)
        r.register(_Collector(self))

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._client = ClientSession()
        self._purger = asyncio.create_task(self._purge_loop())

    async def close(self) -> None:
        self._purger.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._purger
        if self._client is not None:
            await self._client.close()

    async def _purge_loop(self) -> None:
        while True:
            await asyncio.sleep(min(5.0, self.cfg.kv_ttl_s))
            self.kv.purge()

    # ---- helpers ---------------------------------------------------------------------------

    def error(self, status: int, message: str, *, code: str | None, param: str | None = None) -> web.Response:
        err_type = "invalid_request_error" if status < 500 else "server_error"
        if status < 500:
            self.bad_requests_total.inc()
        else:
            self.errors_total.inc()
        return web.json_response(
            error_body(message, err_type=err_type, code=code, param=param), status=status
        )

    async def _read_body(self, request: web.Request) -> object:
        if request.content_length is not None and request.content_length > self.cfg.max_body_bytes:
            raise _HttpError(413, f"request body over {self.cfg.max_body_bytes} bytes", "body_too_large")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise _HttpError(
                413, f"request body over {self.cfg.max_body_bytes} bytes", "body_too_large"
            ) from exc
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _HttpError(400, f"invalid JSON body: {exc}", "invalid_json") from exc

    def _token_delay_s(self) -> float:
        t = self.cfg.timing
        return (t.decode_base_ms + t.decode_per_seq_ms * self.pool.running) / 1000.0

    # ---- generation endpoints --------------------------------------------------------------

    async def handle(self, request: web.Request, api: Api) -> web.StreamResponse:
        try:
            body = await self._read_body(request)
            req = parse_request(api, body, self.limits, prompt_tokens_of=count_tokens)
            if self.cfg.role == "decode" and req.n > self.cfg.running_max_req_size:
                raise BadRequest(
                    f"n={req.n} exceeds this server's running_max_req_size {self.cfg.running_max_req_size}",
                    param="n",
                )
            if (
                self.cfg.role == "decode"
                and req.bootstrap_room is not None
                and (req.bootstrap_host is None or req.bootstrap_port is None)
            ):
                raise BadRequest(
                    "'bootstrap_room' needs 'bootstrap_host' and 'bootstrap_port'", param="bootstrap_host"
                )
        except _HttpError as exc:
            return self.error(exc.status, exc.message, code=exc.code)
        except BadRequest as exc:
            return self.error(400, exc.message, code=exc.code, param=exc.param)
        self.requests_total.inc()
        rid = req.rid or request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            if self.cfg.role == "prefill":
                return await self._prefill(request, req, rid)
            return await self._decode(request, req, rid)
        except asyncio.CancelledError:
            self.cancelled_total.inc()
            raise
        except ConnectionResetError:
            # Client went away between two writes (before the handler got cancelled).
            self.cancelled_total.inc()
            raise

    async def _prefill(self, request: web.Request, req: GenRequest, rid: str) -> web.StreamResponse:
        kv_params = req.kv_transfer_params or {}
        key: str | None = None
        if req.bootstrap_room is not None:
            key = str(req.bootstrap_room)
        elif kv_params.get("do_remote_decode"):
            if not self.bootstrap_port:
                return self.error(400, "this prefill server has no KV bootstrap listener", code="kv_disabled")
            key = f"vllm-{uuid.uuid4().hex}"
        if key is not None:
            self.kv.begin(key)
        try:
            await self.pool.acquire(1)
            try:
                async with self._prefill_sem:
                    lookup = self.cache.lookup_and_insert(req.prompt)
                    self.prompt_tokens_total.inc(lookup.prompt_tokens)
                    self.cached_tokens_total.inc(lookup.cached_tokens)
                    t = self.cfg.timing
                    delay_ms = t.prefill_base_ms + t.prefill_per_token_ms * lookup.uncached_tokens
                    await asyncio.sleep(delay_ms / 1000.0)
            finally:
                self.pool.release(1)
            if key is not None:
                self.kv.finish(key, lookup.prompt_tokens)
        except BaseException:
            if key is not None:
                self.kv.abort(key)
            raise
        extra: dict[str, Any] | None = None
        if key is not None and req.bootstrap_room is None:
            n_blocks = -(-lookup.prompt_tokens // self.cfg.cache_block_tokens)
            extra = {
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": self.engine_id,
                    "remote_block_ids": list(range(n_blocks)),
                    "remote_host": self.cfg.advertise_host,
                    "remote_port": self.bootstrap_port,
                    "remote_request_id": key,
                    "tp_size": 1,
                }
            }
        # The prefill's own answer is one token, unpaced: the PD router discards it.
        total = min(1, req.max_tokens)
        self.tokens_total.inc(total)
        return await self._respond(
            request, req, rid, lookup.prompt_tokens, lookup.cached_tokens, total, extra
        )

    async def _pull_kv(self, host: str, port: int, key: str, timeout_s: float) -> None:
        assert self._client is not None
        hostpart = f"[{host}]" if ":" in host else host
        url = f"http://{hostpart}:{port}/kv/{key}"
        self.kv_waiting += 1
        try:
            async with self._client.get(
                url, params={"timeout": f"{timeout_s:.3f}"}, timeout=ClientTimeout(total=timeout_s + 5.0)
            ) as resp:
                if resp.status != 200:
                    detail = (await resp.text())[:200]
                    raise KVTransferError(
                        f"KV transfer {key} from {host}:{port} failed: {resp.status} {detail}"
                    )
        except KVTransferError:
            raise
        except Exception as exc:  # connection refused, timeout, bad payload: all a failed transfer
            raise KVTransferError(f"KV transfer {key} from {host}:{port} failed: {exc!r}") from exc
        finally:
            self.kv_waiting -= 1
        self.kv_transfers_total.inc()

    async def _decode(self, request: web.Request, req: GenRequest, rid: str) -> web.StreamResponse:
        kv_params = req.kv_transfer_params or {}
        try:
            if req.bootstrap_room is not None:
                assert req.bootstrap_host is not None and req.bootstrap_port is not None
                await self._pull_kv(
                    req.bootstrap_host,
                    req.bootstrap_port,
                    str(req.bootstrap_room),
                    self.cfg.kv_wait_timeout_s,
                )
            elif kv_params.get("do_remote_prefill"):
                host, port, key = (
                    kv_params.get("remote_host"),
                    kv_params.get("remote_port"),
                    kv_params.get("remote_request_id"),
                )
                if not (
                    isinstance(host, str) and isinstance(port, int) and isinstance(key, str) and port > 0
                ):
                    raise BadRequest(
                        "kv_transfer_params needs remote_host, remote_port and remote_request_id",
                        param="kv_transfer_params",
                    )
                # The prefill finished before the router got its response: the room is done or gone.
                await self._pull_kv(host, port, key, min(0.2, self.cfg.kv_wait_timeout_s))
        except BadRequest as exc:
            return self.error(400, exc.message, code=exc.code, param=exc.param)
        except KVTransferError as exc:
            log.warning("%s: %s", rid, exc)
            return self.error(502, str(exc), code="kv_transfer_failed")
        prompt_tokens = count_tokens(req.prompt)
        total = req.max_tokens
        if total == 0:
            return await self._respond(request, req, rid, prompt_tokens, 0, 0, None)
        n = req.n
        await self.pool.acquire(n)
        generated = 0
        self.kv_tokens += n * prompt_tokens

        def on_token() -> None:
            nonlocal generated
            generated += 1
            self.kv_tokens += n
            self.tokens_total.inc(n)

        try:
            return await self._respond(request, req, rid, prompt_tokens, 0, total, None, on_token=on_token)
        finally:
            # Runs on completion, error and cancellation alike: the slot never leaks.
            self.kv_tokens -= n * (prompt_tokens + generated)
            self.pool.release(n)

    async def _respond(
        self,
        request: web.Request,
        req: GenRequest,
        rid: str,
        prompt_tokens: int,
        cached_tokens: int,
        total: int,
        extra: dict[str, Any] | None,
        *,
        on_token: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """Write the response; with ``on_token`` the tokens are paced by the decode timing model."""
        prefix = {"generate": "", "completions": "cmpl-", "chat": "chatcmpl-"}[req.api]
        fmt = Formatter(
            req=req,
            rid=prefix + rid if req.api != "generate" else rid,
            created=int(time.time()),
            model=req.model or self.cfg.model,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
        )
        resp: web.StreamResponse | None = None
        if req.stream:
            resp = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Request-Id": rid,
                }
            )
            await resp.prepare(request)
            await _write(resp, fmt.start_chunks())
        if total == 0 and resp is not None:
            await _write(resp, fmt.token_chunks(0, 0))
        for k in range(1, total + 1):
            if on_token is not None:
                await asyncio.sleep(self._token_delay_s())
                on_token()
            if resp is not None:
                await _write(resp, fmt.token_chunks(k, total))
        if resp is not None:
            await _write(resp, fmt.end_chunks(total))
            await resp.write(SSE_DONE)
            await resp.write_eof()
            return resp
        return web.json_response(fmt.full_response(total, extra), headers={"X-Request-Id": rid})

    # ---- info endpoints --------------------------------------------------------------------

    def server_info(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "version": VERSION,
            "model_path": cfg.model,
            "served_model_name": cfg.model,
            "max_running_requests": cfg.running_max_req_size,
            "max_total_num_tokens": cfg.max_total_tokens,
            "context_length": cfg.context_length,
            "disaggregation_mode": cfg.role,
            "disaggregation_bootstrap_port": self.bootstrap_port or None,
            "tp_size": 1,
            "dp_size": 1,
            "engine_id": self.engine_id,
            "internal_states": [{"max_running_requests": cfg.running_max_req_size}],
        }


class _HttpError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


async def _write(resp: web.StreamResponse, chunks: Iterator[dict[str, Any]]) -> None:
    data = b"".join(sse(c) for c in chunks)
    if data:
        await resp.write(data)


def build_app(engine: Engine) -> web.Application:
    app = web.Application(client_max_size=engine.cfg.max_body_bytes)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def server_info(_: web.Request) -> web.Response:
        return web.json_response(engine.server_info())

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"model_path": engine.cfg.model, "is_generation": True})

    async def models(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": engine.cfg.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "pdsim",
                        "root": engine.cfg.model,
                        "max_model_len": engine.cfg.context_length,
                    }
                ],
            }
        )

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(engine.registry), content_type="text/plain", charset="utf-8")

    async def generate(request: web.Request) -> web.StreamResponse:
        return await engine.handle(request, "generate")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await engine.handle(request, "completions")

    async def chat(request: web.Request) -> web.StreamResponse:
        return await engine.handle(request, "chat")

    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def build_bootstrap_app(engine: Engine) -> web.Application:
    """The prefill server's KV-transfer listener (SGLang's bootstrap port, vLLM's side channel)."""
    app = web.Application()

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def kv(request: web.Request) -> web.Response:
        key = request.match_info["key"]
        try:
            timeout_s = float(request.query.get("timeout", "0"))
        except ValueError:
            return web.json_response({"error": "timeout must be a number"}, status=400)
        timeout_s = max(0.0, min(timeout_s, 300.0))
        status = await engine.kv.wait(key, timeout_s)
        if status == "done":
            return web.json_response({"key": key, "status": "done"})
        if status == "aborted":
            return web.json_response({"key": key, "status": "aborted"}, status=410)
        return web.json_response({"key": key, "status": "not_found"}, status=404)

    app.router.add_get("/health", health)
    app.router.add_get("/kv/{key}", kv)
    return app
