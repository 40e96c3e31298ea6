"""The simulated engine: aiohttp handlers around the prefix cache, the slot pool and the KV rooms."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from aiohttp import ClientSession, ClientTimeout, web
from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdsim.batch_runner import BatchRunner, Ticket
from pdsim.cache import CacheLookup, PrefixCache, count_tokens
from pdsim.engine_model import EngineModel, ModelConfig, ModelRequest, Phase, QueueFull, StepCost
from pdsim.faults import ErrorDraw, FaultError, Faults, updated
from pdsim.kvstore import KVStore
from pdsim.profiles import VLLM_BLOCK_SIZE, Profile, transfer_time_s
from pdsim.protocol import (
    ANSWER_HEADER,
    SSE_DONE,
    Api,
    BadRequest,
    Flavor,
    Formatter,
    GenRequest,
    Limits,
    error_body,
    parse_request,
    sse,
)
from pdsim.reqlog import RequestLog
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
class ModelMode:
    """Model mode (``--profile``): a continuous-batch engine model instead of per-request timers."""

    profile: Profile
    time_scale: float = 1.0  # wall seconds per engine second
    max_prefill_tokens: int = 16384
    max_queued_requests: int | None = None
    kv_bandwidth_gbps: float = 25.0
    # Priority scheduling (SGLang --enable-priority-scheduling, vLLM --scheduling-policy priority):
    # the waiting queue by each request's ``priority``, higher first unless ``low_priority_first``.
    priority_scheduling: bool = False
    low_priority_first: bool = False


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
    flavor: Flavor = "both"
    metrics: bool = True
    # How long /health waits for a one-token generation before 503 (SGLang's
    # SGLANG_HEALTH_CHECK_TIMEOUT, 20 s by default).
    health_timeout_s: float = 20.0
    request_log_size: int = 1000
    # --api sglang: serve n > 1 with one room per sample (True), or refuse PD requests with n > 1
    # as real SGLang mishandles them (False).
    sglang_sample_rooms: bool = True
    faults: Faults = field(default_factory=Faults)
    model_mode: ModelMode | None = None


class KVTransferError(Exception):
    pass


def _capacity_check(over_total: int, high_water: int) -> Iterator[Metric]:
    """The invariant checker's two series (both modes; always 0 on a prefill server)."""
    c = CounterMetricFamily(
        "pdsim_over_capacity",
        "Decode requests that became held (running or waiting for a batch slot with their KV in) "
        "while more sequences than running_max_req_size were held: a router over-admitted.",
    )
    c.add_metric([], over_total)
    yield c
    yield GaugeMetricFamily(
        "pdsim_held_high_water",
        "Peak of held sequences (running + waiting for a batch slot) since start; above pdsim_capacity "
        "means a router over-admitted.",
        value=high_water,
    )


class _Collector(Collector):
    """Gauges read from the engine's state at scrape time, under both SGLang's and vLLM's names."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        if self.engine.model is not None:
            yield from self._collect_model(self.engine, self.engine.model)
            return
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
        if e.cfg.role == "decode":
            # As SGLang's decode server: requests waiting for their KV are in its transfer queue.
            yield gauge("sglang:num_decode_prealloc_queue_reqs", "Requests before KV preallocation.", 0)
            transfer = "sglang:num_decode_transfer_queue_reqs"
            yield gauge(transfer, "Requests waiting for their KV.", e.kv_waiting)
        yield gauge("sglang:token_usage", "Fraction of the KV token pool in use.", usage)
        yield gauge("vllm:num_requests_running", "Running sequences (slots in use).", pool.running)
        # vLLM keeps a request waiting for its remote KV in its waiting queue.
        yield gauge("vllm:num_requests_waiting", "Sequences waiting.", pool.waiting_slots + e.kv_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache in use (0-1).", usage)
        yield gauge("pdsim_running", "Slots in use.", pool.running, False)
        yield gauge("pdsim_waiting_requests", "Requests waiting for slots.", pool.waiting_requests, False)
        yield gauge("pdsim_max_running", "Peak slots in use since start.", pool.max_running, False)
        yield gauge("pdsim_capacity", "running_max_req_size.", pool.capacity, False)
        yield from _capacity_check(pool.over_capacity_total, pool.held_high_water)
        yield gauge("pdsim_kv_waiting", "Decode slots waiting for their KV transfer.", e.kv_waiting, False)
        yield gauge("pdsim_kv_rooms", "KV transfer rooms held by the bootstrap listener.", len(e.kv), False)
        yield gauge("pdsim_hung_requests", "Requests held open by a hang fault.", e.hung, False)
        c = CounterMetricFamily(
            "pdsim_queued", "Requests that ever had to wait for a slot inside the engine."
        )
        c.add_metric([], pool.queued_total)
        yield c

    def _collect_model(self, e: Engine, m: EngineModel) -> Iterator[Metric]:
        labels = {"model_name": e.cfg.model}

        def gauge(name: str, doc: str, value: float, labelled: bool = True) -> GaugeMetricFamily:
            if not labelled:
                return GaugeMetricFamily(name, doc, value=value)
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            g.add_metric(list(labels.values()), value)
            return g

        def counter(name: str, doc: str, value: float, labelled: bool = True) -> CounterMetricFamily:
            if not labelled:
                return CounterMetricFamily(name, doc, value=value)
            c = CounterMetricFamily(name, doc, labels=list(labels))
            c.add_metric(list(labels.values()), value)
            return c

        total = m.cfg.max_total_tokens
        usage = min(1.0, m.kv_used / total)
        running, waiting = m.running_seqs, m.waiting_seqs
        prealloc, transfer = m.seqs(Phase.PREALLOC), m.seqs(Phase.TRANSFER)
        yield gauge("sglang:num_running_reqs", "Running sequences.", running)
        yield gauge("sglang:num_queue_reqs", "Sequences in the waiting queue.", waiting)
        if e.cfg.role == "decode":
            yield gauge(
                "sglang:num_decode_prealloc_queue_reqs", "Sequences waiting to preallocate KV.", prealloc
            )
            yield gauge(
                "sglang:num_decode_transfer_queue_reqs", "Sequences whose KV is in transfer.", transfer
            )
            yield gauge(
                "sglang:pending_prealloc_token_usage",
                "KV tokens of the requests waiting to preallocate, as a fraction of the pool.",
                m.pending_prealloc_tokens / total,
            )
        else:
            # Neither engine publishes the prefill work queued on a prefill server in tokens (SGLang:
            # only request counts, sglang:num_queue_reqs and the PD queue gauges): pdsim's own name.
            yield gauge(
                "pdsim_prefill_queued_tokens",
                "Uncached prompt tokens still to prefill (waiting and running requests).",
                m.pending_prefill_tokens,
                False,
            )
        yield gauge("sglang:token_usage", "Fraction of the KV token pool in use.", usage)
        yield gauge("sglang:num_used_tokens", "KV tokens in use.", m.kv_used)
        yield gauge("sglang:max_total_num_tokens", "KV pool size in tokens.", total)
        yield gauge("sglang:new_token_ratio", "Admission reserve ratio.", m.new_token_ratio)
        yield counter("sglang:num_retracted_requests", "Requests retracted.", m.retracted_requests)
        yield counter(
            "sglang:num_retracted_input_tokens",
            "Input tokens of retracted requests.",
            m.retracted_input_tokens,
        )
        yield counter(
            "sglang:num_retracted_output_tokens",
            "Output tokens of retracted requests.",
            m.retracted_output_tokens,
        )
        yield gauge("vllm:num_requests_running", "Running sequences.", running)
        # vLLM counts a request waiting for (or receiving) its remote KV as waiting.
        yield gauge("vllm:num_requests_waiting", "Sequences waiting.", m.pending_seqs)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache in use (0-1).", usage)
        yield counter("vllm:num_preemptions", "Requests preempted by recompute.", m.preemptions)
        if e.cfg.flavor != "sglang":
            # vLLM's info gauge (vllm/v1/metrics/loggers.py, log_metrics_info("cache_config")): its
            # CacheConfig as labels, value 1; the pool in tokens is num_gpu_blocks x block_size.
            info = {
                "block_size": str(VLLM_BLOCK_SIZE),
                "cache_dtype": "auto",
                "enable_prefix_caching": "True",
                "engine": "0",
                "gpu_memory_utilization": "0.9",
                "num_gpu_blocks": str(total // VLLM_BLOCK_SIZE),
            }
            g = GaugeMetricFamily(
                "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
            )
            g.add_metric(list(info.values()), 1.0)
            yield g
        yield counter(
            "pdsim_recomputed_tokens",
            "Tokens prefilled again after a retraction or preemption.",
            m.recomputed_tokens,
            False,
        )
        yield gauge("pdsim_running", "Sequences running.", running, False)
        yield gauge(
            "pdsim_waiting_requests",
            "Requests waiting for the batch.",
            m.requests(Phase.WAITING) + m.requests(Phase.READY),
            False,
        )
        yield gauge("pdsim_max_running", "Peak sequences running since start.", m.max_running, False)
        yield gauge(
            "pdsim_max_waiting",
            "Peak sequences waiting, preallocating or in transfer since start.",
            m.max_waiting,
            False,
        )
        yield gauge("pdsim_capacity", "running_max_req_size.", m.cfg.max_running_seqs, False)
        yield from _capacity_check(m.over_capacity_total, m.held_high_water)
        yield gauge(
            "pdsim_kv_waiting", "Sequences preallocating or in KV transfer.", prealloc + transfer, False
        )
        yield gauge("pdsim_kv_rooms", "KV transfer rooms held by the bootstrap listener.", len(e.kv), False)
        yield gauge("pdsim_hung_requests", "Requests held open by a hang fault.", e.hung, False)
        if e.cfg.role == "prefill":
            c = CounterMetricFamily(
                "pdsim_prefill_tokens", "Prefill tokens computed for PD rooms, by fate.", labels=["outcome"]
            )
            c.add_metric(["transferred"], e.kv.transferred_tokens)
            c.add_metric(["wasted"], e.kv.wasted_tokens + e.prefill_wasted_tokens)
            yield c
        yield counter(
            "pdsim_queued",
            "Requests that ever waited for batch room or KV inside the engine.",
            m.queued_total,
            False,
        )


class Engine:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.limits = Limits(cfg.max_n, cfg.context_length, cfg.default_max_tokens)
        self.engine_id = f"pdsim-{uuid.uuid4().hex[:12]}"
        # A prefill server's in-flight limit is its own business, not a coordinated capacity.
        self.pool = SlotPool(cfg.running_max_req_size, check_capacity=cfg.role == "decode")
        self.cache = PrefixCache(cfg.cache_blocks, cfg.cache_block_tokens)
        self.kv = KVStore(cfg.kv_ttl_s)
        self.kv_tokens = 0
        self.kv_waiting = 0  # decode slots waiting for their KV transfer
        self.bootstrap_port = 0  # set once the bootstrap listener is bound
        self._prefill_sem = asyncio.Semaphore(cfg.prefill_parallel)
        self._client: ClientSession | None = None
        self.faults = cfg.faults
        self.error_draw = ErrorDraw(cfg.faults.seed)
        self.reqlog = RequestLog(cfg.request_log_size)
        self.hung = 0  # requests parked by a hang fault
        self.prompt_tokens_seen = 0  # for /v1/loads' cache_hit_rate
        self.cached_tokens_seen = 0
        self.inflight_ids: set[str] = set()  # vLLM flavour: request ids being served
        self.shutting_down = False
        self.admin_port = 0  # set when a separate admin listener is bound
        # Opens (True) or closes (False) the main listener; set by the process that owns it.
        self.listener_control: Callable[[bool], Awaitable[None]] | None = None
        self.listening = True
        self.model: EngineModel | None = None
        self.runner: BatchRunner | None = None
        self.prefill_wasted_tokens = 0  # model mode: prefill work for requests whose client left
        mm = cfg.model_mode
        if mm is not None:
            p = mm.profile
            self.model = EngineModel(
                ModelConfig(
                    role=cfg.role,
                    policy="vllm" if cfg.flavor == "vllm" else "sglang",
                    cost=StepCost(p.step_base_s, p.per_prefill_token_s, p.per_decode_seq_s),
                    max_total_tokens=cfg.max_total_tokens,
                    max_running_seqs=cfg.running_max_req_size,
                    max_prefill_tokens=mm.max_prefill_tokens,
                    max_queued_requests=mm.max_queued_requests,
                    priority_scheduling=mm.priority_scheduling,
                    low_priority_first=mm.low_priority_first,
                )
            )
            self.runner = BatchRunner(self.model, mm.time_scale, lambda: self.faults.slow)
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
        if self.runner is not None:
            self.runner.start()

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.close()
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

    async def _read_raw(self, request: web.Request) -> bytes:
        if request.content_length is not None and request.content_length > self.cfg.max_body_bytes:
            raise _HttpError(413, f"request body over {self.cfg.max_body_bytes} bytes", "body_too_large")
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise _HttpError(
                413, f"request body over {self.cfg.max_body_bytes} bytes", "body_too_large"
            ) from exc

    def _token_delay_s(self, slow: float) -> float:
        t = self.cfg.timing
        return slow * (t.decode_base_ms + t.decode_per_seq_ms * self.pool.running) / 1000.0

    async def _stall(self) -> None:
        """Hold the request open forever: only its client going away (cancellation) ends it."""
        self.hung += 1
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            self.hung -= 1

    # ---- faults ----------------------------------------------------------------------------

    async def set_faults(self, body: object, *, replace: bool) -> Faults:
        """Validate and apply a fault update (raises :class:`FaultError`); returns the new settings."""
        new = updated(self.faults, body, replace=replace)
        if new.refuse and not self.listening_controllable():
            raise FaultError(
                "'refuse' needs a separate admin listener (--admin-port): with the main port closed "
                "this endpoint would be unreachable"
            )
        keys = set(body) if isinstance(body, dict) else set()
        if replace or keys & {"seed", "error_rate"}:
            # A fresh draw each time the rate or seed is set: the same settings fail the same requests.
            self.error_draw.reset(new.seed)
        self.faults = new
        await self.apply_listener()
        return new

    def listening_controllable(self) -> bool:
        return self.listener_control is not None and self.admin_port != 0

    async def apply_listener(self) -> None:
        want = not self.faults.refuse
        if self.listener_control is not None and want != self.listening:
            await self.listener_control(want)
            self.listening = want
            log.warning("main listener %s", "reopened" if want else "closed (refuse fault)")

    def faults_state(self) -> dict[str, Any]:
        return {
            "faults": self.faults.to_json(),
            "state": {
                "listening": self.listening,
                "hung_requests": self.hung,
                "admin_port": self.admin_port or None,
            },
        }

    # ---- generation endpoints --------------------------------------------------------------

    async def handle(self, request: web.Request, api: Api) -> web.StreamResponse:
        raw: bytes | None = None
        body: object = None
        read_error: _HttpError | None = None
        try:
            raw = await self._read_raw(request)
            body = json.loads(raw)
        except _HttpError as exc:
            read_error = exc
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            read_error = _HttpError(400, f"invalid JSON body: {exc}", "invalid_json")
        entry = self.reqlog.record(request.path, request.headers, body, raw)
        request["pdsim_log"] = entry
        resp = await self._serve(request, api, body, read_error)
        entry["status"] = resp.status
        return resp

    async def _serve(
        self, request: web.Request, api: Api, body: object, read_error: _HttpError | None
    ) -> web.StreamResponse:
        try:
            if read_error is not None:
                raise read_error
            req = parse_request(
                api,
                body,
                self.limits,
                prompt_tokens_of=count_tokens,
                flavor=self.cfg.flavor,
                sample_rooms=self.cfg.sglang_sample_rooms,
            )
            header = request.headers.get(ANSWER_HEADER)
            if header is not None and req.answer_tokens is None:
                # The same as the field, for routers that rebuild the body but pass headers on
                # (sglang-router drops unknown fields).
                if not header.strip().isdigit() or int(header) < 1:
                    raise BadRequest(f"{ANSWER_HEADER} must be an integer >= 1", param=ANSWER_HEADER)
                req = dataclasses.replace(req, answer_tokens=int(header))
            if self.cfg.role == "decode" and req.choices > self.cfg.running_max_req_size:
                what = f"n={req.n}" if req.choices == req.n else f"{req.choices} sequences (prompts x n)"
                raise BadRequest(
                    f"{what} exceeds this server's running_max_req_size {self.cfg.running_max_req_size}",
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
            vllm_unordered = self.cfg.flavor == "vllm" and not (
                self.model is not None and self.model.cfg.priority_scheduling
            )
            if self.model is not None and req.priority and vllm_unordered:
                # As vLLM: a priority needs the priority scheduling policy (SGLang ignores it).
                message = f"Got priority {req.priority} but Priority scheduling is not enabled."
                raise BadRequest(message, param="priority")
            if self.model is not None:
                # A request that could never run alone here would be retracted forever.
                prompt = sum(count_tokens(p) for p in req.all_prompts)
                decode = self.cfg.role == "decode"
                if not self.model.fits(
                    req.n * prompt if decode else prompt, req.choices if decode else 1, req.max_tokens
                ):
                    raise BadRequest(
                        "prompt and max tokens exceed this server's KV pool of "
                        f"{self.cfg.max_total_tokens} tokens",
                        param="max_tokens",
                        code="exceeds_kv_pool",
                    )
        except _HttpError as exc:
            return self.error(exc.status, exc.message, code=exc.code)
        except BadRequest as exc:
            return self.error(400, exc.message, code=exc.code, param=exc.param)
        self.requests_total.inc()
        header_id = request.headers.get("X-Request-Id")
        rid = req.rid or header_id or uuid.uuid4().hex
        faults = self.faults  # read once: a later change affects new requests only
        busy_key: str | None = None
        if self.cfg.flavor == "vllm" and header_id:
            # vLLM names its internal request after X-Request-Id and refuses a second one in flight.
            busy_key = {"generate": "", "completions": "cmpl-", "chat": "chatcmpl-"}[api] + header_id
            if busy_key in self.inflight_ids:
                return await self._duplicate_id(request, req, busy_key)
            self.inflight_ids.add(busy_key)
        try:
            if self.error_draw.fails(faults.error_rate):
                message = "injected fault: the engine failed this request"
                return self.error(faults.error_status, message, code="injected_fault")
            if faults.hang:
                await self._stall()
            if self.runner is not None:
                if self.cfg.role == "prefill":
                    return await self._prefill_model(request, req, rid, faults, self.runner)
                return await self._decode_model(request, req, rid, faults, self.runner)
            if self.cfg.role == "prefill":
                return await self._prefill(request, req, rid, faults)
            return await self._decode(request, req, rid, faults)
        except asyncio.CancelledError:
            self.cancelled_total.inc()
            raise
        except ConnectionResetError:
            # Client went away between two writes (before the handler got cancelled).
            self.cancelled_total.inc()
            raise
        finally:
            if busy_key is not None:
                self.inflight_ids.discard(busy_key)

    async def _duplicate_id(self, request: web.Request, req: GenRequest, key: str) -> web.StreamResponse:
        message = f"Request id {key} already running."
        if not req.stream:
            return self.error(400, message, code=None)
        # vLLM raises this while iterating the stream, after the 200 headers went out: the client
        # gets the error as an SSE event.
        self.bad_requests_total.inc()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        err = error_body(message, err_type="BadRequestError", code=None, param=None)
        err["error"]["code"] = 400
        await resp.write(sse(err))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp

    async def _prefill(
        self, request: web.Request, req: GenRequest, rid: str, faults: Faults
    ) -> web.StreamResponse:
        kv_params = req.kv_transfer_params or {}
        keys: list[str] = []
        if req.bootstrap_rooms:
            keys = [str(r) for r in req.bootstrap_rooms]
        elif kv_params.get("do_remote_decode"):
            if not self.bootstrap_port:
                return self.error(400, "this prefill server has no KV bootstrap listener", code="kv_disabled")
            keys = [f"vllm-{uuid.uuid4().hex}"]
        for key in keys:
            self.kv.begin(key)
        try:
            await self.pool.acquire(1)
            try:
                async with self._prefill_sem:
                    # A batch's prompts are prefilled in one pass.
                    lookups = [self.cache.lookup_and_insert(p) for p in req.all_prompts]
                    prompt_tokens = sum(lk.prompt_tokens for lk in lookups)
                    cached_tokens = sum(lk.cached_tokens for lk in lookups)
                    self.prompt_tokens_total.inc(prompt_tokens)
                    self.cached_tokens_total.inc(cached_tokens)
                    self.prompt_tokens_seen += prompt_tokens
                    self.cached_tokens_seen += cached_tokens
                    t = self.cfg.timing
                    uncached = sum(lk.uncached_tokens for lk in lookups)
                    delay_ms = t.prefill_base_ms + t.prefill_per_token_ms * uncached
                    await asyncio.sleep(faults.slow * delay_ms / 1000.0)
            finally:
                self.pool.release(1)
            for key in keys:
                self.kv.finish(key, prompt_tokens)
        except BaseException:
            for key in keys:
                self.kv.abort(key)
            raise
        return await self._prefill_answer(request, req, rid, keys, lookups, faults)

    async def _prefill_answer(
        self,
        request: web.Request,
        req: GenRequest,
        rid: str,
        keys: list[str],
        lookups: list[CacheLookup],
        faults: Faults,
    ) -> web.StreamResponse:
        """A prefill server's answer (both modes): one token, unpaced, which the PD router discards;
        under vLLM's protocol it carries the ``kv_transfer_params`` the decode pulls with."""
        prompt_tokens = sum(lk.prompt_tokens for lk in lookups)
        cached_tokens = sum(lk.cached_tokens for lk in lookups)
        extra: dict[str, Any] | None = None
        if keys and not req.bootstrap_rooms:
            n_blocks = -(-prompt_tokens // self.cfg.cache_block_tokens)
            extra = {
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": self.engine_id,
                    "remote_block_ids": list(range(n_blocks)),
                    "remote_host": self.cfg.advertise_host,
                    "remote_port": self.bootstrap_port,
                    "remote_request_id": keys[0],
                    "tp_size": 1,
                }
            }
        total = min(1, req.max_tokens)
        self.tokens_total.inc(total)
        per_prompt = tuple((lk.prompt_tokens, lk.cached_tokens) for lk in lookups)
        return await self._respond(
            request, req, rid, prompt_tokens, cached_tokens, total, extra, faults, per_prompt=per_prompt
        )

    async def _pull_kv(self, host: str, port: int, key: str, timeout_s: float, slots: int = 1) -> None:
        """Wait for a KV transfer; meanwhile its ``slots`` count as waiting (SGLang's transfer queue,
        vLLM's requests waiting for remote KVs)."""
        assert self._client is not None
        hostpart = f"[{host}]" if ":" in host else host
        url = f"http://{hostpart}:{port}/kv/{key}"
        self.kv_waiting += slots
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
            self.kv_waiting -= slots
        self.kv_transfers_total.inc()

    async def _decode(
        self, request: web.Request, req: GenRequest, rid: str, faults: Faults
    ) -> web.StreamResponse:
        kv_params = req.kv_transfer_params or {}
        try:
            if req.bootstrap_rooms:
                assert req.bootstrap_host is not None and req.bootstrap_port is not None
                host, bport = req.bootstrap_host, req.bootstrap_port
                # One transfer per room; with a room per sample each sample's KV arrives separately.
                per_room = max(1, req.choices // len(req.bootstrap_rooms))
                pulls = [
                    asyncio.ensure_future(
                        self._pull_kv(host, bport, str(room), self.cfg.kv_wait_timeout_s, per_room)
                    )
                    for room in req.bootstrap_rooms
                ]
                try:
                    await asyncio.gather(*pulls)
                finally:
                    for pull in pulls:  # one failed (or the client left): stop waiting for the rest
                        pull.cancel()
            elif kv_params.get("do_remote_prefill"):
                host_v, port_v, key = (
                    kv_params.get("remote_host"),
                    kv_params.get("remote_port"),
                    kv_params.get("remote_request_id"),
                )
                if not (
                    isinstance(host_v, str)
                    and isinstance(port_v, int)
                    and isinstance(key, str)
                    and port_v > 0
                ):
                    raise BadRequest(
                        "kv_transfer_params needs remote_host, remote_port and remote_request_id",
                        param="kv_transfer_params",
                    )
                # The prefill finished before the router got its response: the room is done or gone.
                await self._pull_kv(host_v, port_v, key, min(0.2, self.cfg.kv_wait_timeout_s), req.choices)
        except BadRequest as exc:
            return self.error(400, exc.message, code=exc.code, param=exc.param)
        except KVTransferError as exc:
            log.warning("%s: %s", rid, exc)
            return self.error(502, str(exc), code="kv_transfer_failed")
        each = [count_tokens(p) for p in req.all_prompts]
        per_prompt = tuple((pt, 0) for pt in each)
        prompt_tokens = sum(each)
        total = req.output_tokens  # max_tokens, or the answer when it ends first
        if total == 0:
            return await self._respond(
                request, req, rid, prompt_tokens, 0, 0, None, faults, per_prompt=per_prompt
            )
        n = req.choices  # every sample of every prompt is a sequence in the batch
        await self.pool.acquire(n)
        generated = 0
        held = req.n * prompt_tokens  # each prompt's KV, once per sample
        self.kv_tokens += held

        def on_token() -> None:
            nonlocal generated
            generated += 1
            self.kv_tokens += n
            self.tokens_total.inc(n)

        released = False

        def release() -> None:
            # Once only: at the last generated token, or on error / cancellation before it.
            nonlocal released
            if not released:
                released = True
                self.kv_tokens -= held + n * generated
                self.pool.release(n)

        try:
            return await self._respond(
                request,
                req,
                rid,
                prompt_tokens,
                0,
                total,
                None,
                faults,
                per_prompt=per_prompt,
                on_token=on_token,
                on_done=release,
            )
        finally:
            # Runs on completion, error and cancellation alike: the slot never leaks.
            release()

    # ---- model mode (--profile) ------------------------------------------------------------

    def _queue_full(self) -> web.Response:
        # SGLang's answer when --max-queued-requests is reached.
        return self.error(503, "The request queue is full.", code="queue_full")

    async def _prefill_model(
        self, request: web.Request, req: GenRequest, rid: str, faults: Faults, runner: BatchRunner
    ) -> web.StreamResponse:
        kv_params = req.kv_transfer_params or {}
        keys: list[str] = []
        if req.bootstrap_rooms:
            keys = [str(r) for r in req.bootstrap_rooms]
        elif kv_params.get("do_remote_decode"):
            if not self.bootstrap_port:
                return self.error(400, "this prefill server has no KV bootstrap listener", code="kv_disabled")
            keys = [f"vllm-{uuid.uuid4().hex}"]
        for key in keys:
            self.kv.begin(key)
        mid = runner.new_id()
        computed = 0
        try:
            # SGLang's bootstrap: nothing is computed before the decode server has attached, which it
            # does once it holds KV for the request; a full decode server stalls this prefill.
            if req.bootstrap_rooms and not await self.kv.wait_attached(keys, self.cfg.kv_wait_timeout_s):
                for key in keys:
                    self.kv.abort(key)
                message = (
                    f"no decode server attached to room(s) {keys} within {self.cfg.kv_wait_timeout_s:g} s"
                )
                log.warning("%s: %s", rid, message)
                return self.error(502, message, code="kv_bootstrap_failed")
            lookups = [self.cache.lookup_and_insert(p) for p in req.all_prompts]
            prompt_tokens = sum(lk.prompt_tokens for lk in lookups)
            cached_tokens = sum(lk.cached_tokens for lk in lookups)
            uncached = sum(lk.uncached_tokens for lk in lookups)
            ticket = runner.submit(
                ModelRequest(
                    rid=mid,
                    seqs=1,
                    prompt_tokens=prompt_tokens,
                    prompt_kv=prompt_tokens,
                    prefill_tokens=uncached,
                    max_new_tokens=1,
                    priority=req.priority,
                )
            )
            self.prompt_tokens_total.inc(prompt_tokens)
            self.cached_tokens_total.inc(cached_tokens)
            self.prompt_tokens_seen += prompt_tokens
            self.cached_tokens_seen += cached_tokens
            await ticket.done
            computed = max(1, uncached)
            for i, key in enumerate(keys):
                # The prefill is computed once: its tokens go with the first room.
                self.kv.finish(key, prompt_tokens, computed if i == 0 else 0)
        except QueueFull:
            for key in keys:
                self.kv.abort(key)
            return self._queue_full()
        except BaseException:
            r = self.model.get(mid) if self.model is not None else None
            spent = r.computed if r is not None else computed
            if keys:
                for i, key in enumerate(keys):
                    self.kv.abort(key, spent if i == 0 else 0)
            else:
                self.prefill_wasted_tokens += spent
            raise
        finally:
            runner.cancel(mid)
        return await self._prefill_answer(request, req, rid, keys, lookups, faults)

    async def _decode_model(
        self, request: web.Request, req: GenRequest, rid: str, faults: Faults, runner: BatchRunner
    ) -> web.StreamResponse:
        if req.max_tokens == 0:
            return await self._decode(request, req, rid, faults)  # nothing to batch
        kv_params = req.kv_transfer_params or {}
        remote: tuple[str, int, str] | None = None
        if not req.bootstrap_rooms and kv_params.get("do_remote_prefill"):
            host_v, port_v, key = (
                kv_params.get("remote_host"),
                kv_params.get("remote_port"),
                kv_params.get("remote_request_id"),
            )
            if not (
                isinstance(host_v, str) and isinstance(port_v, int) and isinstance(key, str) and port_v > 0
            ):
                return self.error(
                    400,
                    "kv_transfer_params needs remote_host, remote_port and remote_request_id",
                    code=None,
                    param="kv_transfer_params",
                )
            remote = (host_v, port_v, key)
        pd = bool(req.bootstrap_rooms) or remote is not None
        each = [count_tokens(p) for p in req.all_prompts]
        prompt_tokens = sum(each)
        mid = runner.new_id()
        try:
            ticket = runner.submit(
                ModelRequest(
                    rid=mid,
                    seqs=req.choices,
                    prompt_tokens=prompt_tokens,
                    prompt_kv=req.n * prompt_tokens,
                    prefill_tokens=0 if pd else prompt_tokens,
                    max_new_tokens=req.max_tokens,
                    pd=pd,
                    priority=req.priority,
                    answer_tokens=req.answer_tokens,
                )
            )
        except QueueFull:
            return self._queue_full()
        try:
            if pd:
                # Preallocation first (SGLang's prealloc queue; vLLM allocates before pulling), then
                # the attach / pull, then the transfer itself.
                await ticket.allocated
                try:
                    await self._pull_model_kv(req, remote)
                except KVTransferError as exc:
                    log.warning("%s: %s", rid, exc)
                    return self.error(502, str(exc), code="kv_transfer_failed")
                assert self.cfg.model_mode is not None
                p, mm = self.cfg.model_mode.profile, self.cfg.model_mode
                seconds = transfer_time_s(
                    prompt_tokens, p.kv_bytes_per_token, mm.kv_bandwidth_gbps, p.bootstrap_s
                )
                await asyncio.sleep(runner.engine_time(seconds))
                runner.transferred(mid)
            per_prompt = tuple((pt, 0) for pt in each)
            return await self._respond_model(request, req, rid, prompt_tokens, per_prompt, ticket, faults)
        finally:
            runner.cancel(mid)  # no-op once finished; otherwise frees the KV and slot at once

    async def _pull_model_kv(self, req: GenRequest, remote: tuple[str, int, str] | None) -> None:
        if remote is not None:
            host, port, key = remote
            # The prefill finished before the router got its response: the room is done or gone.
            await self._pull_kv(host, port, key, min(0.2, self.cfg.kv_wait_timeout_s), req.choices)
            return
        assert req.bootstrap_host is not None and req.bootstrap_port is not None
        per_room = max(1, req.choices // len(req.bootstrap_rooms))
        pulls = [
            asyncio.ensure_future(
                self._pull_kv(
                    req.bootstrap_host, req.bootstrap_port, str(room), self.cfg.kv_wait_timeout_s, per_room
                )
            )
            for room in req.bootstrap_rooms
        ]
        try:
            await asyncio.gather(*pulls)
        finally:
            for pull in pulls:
                pull.cancel()

    def _formatter(
        self,
        req: GenRequest,
        rid: str,
        prompt_tokens: int,
        cached_tokens: int,
        per_prompt: tuple[tuple[int, int], ...],
    ) -> Formatter:
        prefix = {"generate": "", "completions": "cmpl-", "chat": "chatcmpl-"}[req.api]
        return Formatter(
            req=req,
            rid=prefix + rid if req.api != "generate" else rid,
            created=int(time.time()),
            model=req.model or self.cfg.model,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            per_prompt=per_prompt if len(per_prompt) > 1 else (),
        )

    async def _open_stream(
        self, request: web.Request, req: GenRequest, rid: str, fmt: Formatter
    ) -> tuple[web.StreamResponse | None, _Out | None]:
        """For a streamed request: send the SSE headers and the first chunks; (None, None) otherwise."""
        if not req.stream:
            return None, None
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": rid}
        )
        await resp.prepare(request)
        entry = request.get("pdsim_log")
        if entry is not None:
            entry["status"] = resp.status
        out = _Out(request, resp)
        out.send(fmt.start_chunks())
        return resp, out

    async def _respond_model(
        self,
        request: web.Request,
        req: GenRequest,
        rid: str,
        prompt_tokens: int,
        per_prompt: tuple[tuple[int, int], ...],
        ticket: Ticket,
        faults: Faults,
    ) -> web.StreamResponse:
        """As :meth:`_respond`, with the tokens produced by the step loop: each step's tokens are
        written to the transport from the loop itself (no drain), only the end waits for the client."""
        fmt = self._formatter(req, rid, prompt_tokens, 0, per_prompt)
        total, choices = req.output_tokens, req.choices
        stall_after = faults.hang_after_chunks
        limit = total if stall_after is None else min(total, stall_after)
        resp, out = await self._open_stream(request, req, rid, fmt)
        counted = sent = 0

        def on_tokens(k: int) -> None:
            nonlocal counted, sent
            self.tokens_total.inc(choices * (k - counted))
            counted = k
            if out is not None:
                while sent < min(k, limit):
                    sent += 1
                    out.send(fmt.token_chunks(sent, total))

        ticket.on_tokens = on_tokens
        if ticket.generated:
            on_tokens(ticket.generated)  # tokens made while the response was being prepared
        await ticket.done
        if limit < total:
            # hang_after_chunks: the first tokens went out, the rest never will (the engine finished them).
            await self._stall()
        if resp is not None:
            await resp.write_eof(_sse_bytes(fmt.end_chunks(total)) + SSE_DONE)
            return resp
        return web.json_response(fmt.full_response(total, None), headers={"X-Request-Id": rid})

    async def _respond(
        self,
        request: web.Request,
        req: GenRequest,
        rid: str,
        prompt_tokens: int,
        cached_tokens: int,
        total: int,
        extra: dict[str, Any] | None,
        faults: Faults,
        *,
        per_prompt: tuple[tuple[int, int], ...] = (),
        on_token: Callable[[], None] | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """Write the response; with ``on_token`` the tokens are paced by the decode timing model and
        ``on_done`` runs once the last one is generated.

        Like a real engine, generation does not wait for the client: streamed chunks go straight to
        the transport's buffer (no drain), so a client that reads slowly or not at all neither slows
        the tokens down nor holds the decode slots past the last token. Only the final ``write_eof``
        waits for the client. A client that went away still ends the request (the closing transport
        raises ``ConnectionResetError``, and aiohttp's handler cancellation cancels it).
        """
        fmt = self._formatter(req, rid, prompt_tokens, cached_tokens, per_prompt)
        stall_after = faults.hang_after_chunks
        resp, out = await self._open_stream(request, req, rid, fmt)
        if total == 0 and out is not None:
            out.send(fmt.token_chunks(0, 0))
        for k in range(1, total + 1):
            if stall_after is not None and k > stall_after:
                # Mid-stream hang: the first stall_after tokens went out, the rest never will.
                await self._stall()
            if on_token is not None:
                await asyncio.sleep(self._token_delay_s(faults.slow))
                on_token()
            if out is not None:
                out.send(fmt.token_chunks(k, total))
        if on_done is not None:
            on_done()  # generation is over: the slots are free whatever the client still has to read
        if resp is not None:
            # The tail and the end of the stream go through aiohttp, which waits for the client.
            await resp.write_eof(_sse_bytes(fmt.end_chunks(total)) + SSE_DONE)
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
            # SGLang's server arguments of the same names (--enable-priority-scheduling,
            # --schedule-low-priority-values-first)
            "enable_priority_scheduling": self.model is not None and self.model.cfg.priority_scheduling,
            "schedule_low_priority_values_first": self.model is not None
            and self.model.cfg.low_priority_first,
        }

    def _waiting(self) -> int:
        # SGLang counts a decode's requests still waiting for their KV (prealloc/transfer queues)
        # as waiting; pdsim's equivalent is a request polling its room.
        if self.model is not None:
            return self.model.pending_seqs
        return self.pool.waiting_slots + self.kv_waiting

    def _running(self) -> int:
        return self.model.running_seqs if self.model is not None else self.pool.running

    def _kv_used(self) -> int:
        return self.model.kv_used if self.model is not None else self.kv_tokens

    def get_load(self) -> list[dict[str, Any]]:
        """SGLang 0.5.x ``GET /get_load``: one GetLoadReqOutput per DP rank."""
        waiting = self._waiting()
        return [
            {
                "dp_rank": 0,
                "num_reqs": self._running() + waiting,
                "num_waiting_reqs": waiting,
                "num_tokens": self._kv_used(),
            }
        ]

    def get_loads(self, include: set[str]) -> dict[str, Any]:
        """SGLang's ``GET /v1/loads`` (v1_loads.py): per-rank loads plus an aggregate."""
        cfg, m = self.cfg, self.model
        waiting, running, used = self._waiting(), self._running(), self._kv_used()
        usage = min(1.0, used / cfg.max_total_tokens)
        prompt, cached = self.prompt_tokens_seen, self.cached_tokens_seen
        load: dict[str, Any] = {
            "dp_rank": 0,
            "timestamp": time.time(),
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_used_tokens": used,
            "num_total_tokens": used,
            "max_total_num_tokens": cfg.max_total_tokens,
            "token_usage": round(usage, 4),
            "gen_throughput": 0.0,
            "cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            # SGLang reports -1 on a prefill server.
            "utilization": -1.0 if cfg.role == "prefill" else round(running / cfg.running_max_req_size, 4),
            "max_running_requests": cfg.running_max_req_size,
        }
        if include & {"all", "disagg"}:
            load["disaggregation"] = {
                "mode": cfg.role,
                "prefill_prealloc_queue_reqs": 0,
                "prefill_inflight_queue_reqs": len(self.kv) if cfg.role == "prefill" else 0,
                "decode_prealloc_queue_reqs": m.seqs(Phase.PREALLOC) if m is not None else 0,
                "decode_transfer_queue_reqs": (
                    (m.seqs(Phase.TRANSFER) if m is not None else self.kv_waiting)
                    if cfg.role == "decode"
                    else 0
                ),
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            }
        if include & {"all", "queues"}:
            queued = m.waiting_seqs if m is not None else self.pool.waiting_slots
            load["queues"] = {"waiting": queued, "grammar": 0, "paused": 0, "retracted": 0}
        load["num_total_reqs"] = load["num_running_reqs"] + load["num_waiting_reqs"]
        return {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": VERSION,
            "dp_rank_count": 1,
            "loads": [load],
            "aggregate": {
                "total_running_reqs": load["num_running_reqs"],
                "total_waiting_reqs": load["num_waiting_reqs"],
                "total_reqs": load["num_total_reqs"],
                "total_used_tokens": load["num_used_tokens"],
                "total_tokens": load["num_total_tokens"],
                "avg_token_usage": load["token_usage"],
                "avg_throughput": load["gen_throughput"],
                "avg_utilization": load["utilization"],
            },
        }


class _HttpError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _sse_bytes(chunks: Iterator[dict[str, Any]]) -> bytes:
    return b"".join(sse(c) for c in chunks)


class _Out:
    """A prepared streamed response's body, written straight to the transport without waiting for
    the client to drain it (the transport buffers what the client has not read yet)."""

    __slots__ = ("chunked", "transport")

    def __init__(self, request: web.Request, resp: web.StreamResponse) -> None:
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        self.transport = transport
        # aiohttp chose the framing in prepare(): chunked for HTTP/1.1, until-close for HTTP/1.0.
        self.chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"

    def send(self, chunks: Iterator[dict[str, Any]]) -> None:
        transport = self.transport
        if transport.is_closing():
            # The client went away (its handler is being cancelled): stop generating for it.
            raise ConnectionResetError("Cannot write to closing transport")
        data = _sse_bytes(chunks)
        if data:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)


LOADS_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def _admin_error(message: str) -> web.Response:
    body = error_body(message, err_type="invalid_request_error", code="invalid_fault", param=None)
    return web.json_response(body, status=400)


def add_admin_routes(app: web.Application, engine: Engine) -> None:
    """``/admin/faults`` (GET; POST merges, PUT replaces, DELETE clears) and ``/admin/requests``."""

    async def get_faults(_: web.Request) -> web.Response:
        return web.json_response(engine.faults_state())

    async def change_faults(request: web.Request) -> web.Response:
        if request.method == "DELETE":
            body: object = {}
        else:
            try:
                body = await request.json()
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                return _admin_error(f"invalid JSON body: {exc}")
        try:
            await engine.set_faults(body, replace=request.method != "POST")
        except FaultError as exc:
            return _admin_error(str(exc))
        except OSError as exc:  # the port was taken while the listener was closed
            return web.json_response(
                error_body(
                    f"could not reopen the main listener: {exc}",
                    err_type="server_error",
                    code="listener_failed",
                    param=None,
                ),
                status=500,
            )
        return web.json_response(engine.faults_state())

    async def get_requests(request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return _admin_error("'since' must be an integer")
        return web.json_response(engine.reqlog.snapshot(since, request.query.get("path")))

    async def clear_requests(_: web.Request) -> web.Response:
        engine.reqlog.clear()
        return web.json_response({"cleared": True})

    app.router.add_get("/admin/faults", get_faults)
    for method in ("POST", "PUT", "DELETE"):
        app.router.add_route(method, "/admin/faults", change_faults)
    app.router.add_get("/admin/requests", get_requests)
    app.router.add_delete("/admin/requests", clear_requests)


def build_admin_app(engine: Engine) -> web.Application:
    """The optional admin listener: reachable while the main port refuses connections."""
    app = web.Application()
    add_admin_routes(app, engine)
    return app


def build_app(engine: Engine) -> web.Application:
    app = web.Application(client_max_size=engine.cfg.max_body_bytes)
    flavor = engine.cfg.flavor

    async def health(_: web.Request) -> web.Response:
        if engine.shutting_down or engine.faults.health_fail:
            return web.Response(status=503)
        if flavor != "vllm":
            # SGLang's /health runs a one-token generation and answers 200 once the scheduler
            # produces any output, 503 after SGLANG_HEALTH_CHECK_TIMEOUT; vLLM's only checks that
            # the engine process is alive, so a hung vLLM engine still looks healthy.
            deadline = time.monotonic() + engine.cfg.health_timeout_s
            while engine.faults.generation_stalls():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("health check failed: no output within %.3g s", engine.cfg.health_timeout_s)
                    return web.Response(status=503)
                await asyncio.sleep(min(0.05, remaining))
        if flavor == "both":
            return web.json_response({"status": "ok"})
        return web.Response(status=200)

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

    async def get_load(_: web.Request) -> web.Response:
        return web.json_response(engine.get_load())

    async def get_loads(request: web.Request) -> web.Response:
        include_q = request.query.get("include")
        include = {s.strip() for s in include_q.split(",")} if include_q else {"core"}
        bad = include - LOADS_SECTIONS
        if bad:
            return web.json_response(
                {
                    "object": "error",
                    "message": f"Invalid include sections: {sorted(bad)}. "
                    f"Valid options: {sorted(LOADS_SECTIONS)}",
                    "type": "Bad Request",
                    "code": 400,
                },
                status=400,
            )
        out = engine.get_loads(include)
        rank = request.query.get("dp_rank")
        if rank is not None and rank != "0":
            out["loads"], out["dp_rank_count"] = [], 0
        return web.json_response(out)

    async def vllm_load(_: web.Request) -> web.Response:
        # Stock vLLM counts only with --enable-server-load-tracking (off by default): always 0.
        return web.json_response({"server_load": 0})

    async def generate(request: web.Request) -> web.StreamResponse:
        return await engine.handle(request, "generate")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await engine.handle(request, "completions")

    async def chat(request: web.Request) -> web.StreamResponse:
        return await engine.handle(request, "chat")

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    if engine.cfg.metrics:
        app.router.add_get("/metrics", metrics)
    if flavor != "vllm":
        app.router.add_get("/health_generate", health)
        app.router.add_get("/get_server_info", server_info)
        app.router.add_get("/server_info", server_info)
        app.router.add_get("/get_model_info", model_info)
        app.router.add_get("/get_load", get_load)
        app.router.add_get("/v1/loads", get_loads)
        app.router.add_post("/generate", generate)
    if flavor != "sglang":
        app.router.add_get("/load", vllm_load)
    add_admin_routes(app, engine)
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
