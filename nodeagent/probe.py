"""What the agent learns from its engine: its load (Prometheus ``/metrics`` with SGLang or vLLM names,
or what a stock SGLang serves without ``--enable-metrics``), its liveness (``/health``), and at start
the settings no flag gave (``/get_server_info``, ``/v1/models``)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdcoord.load import EngineLoad
from pdcoord.v1 import coordination_pb2 as pb

log = logging.getLogger(__name__)

# metric name -> field, for both engines' naming schemes
_NAMES = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    # a decode server's requests waiting for their KV (PD): held by the engine, not yet running
    "sglang:num_decode_prealloc_queue_reqs": "waiting",
    "sglang:num_decode_transfer_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
}


# Cumulative counts of requests the engine put back to wait because its KV pool ran out: SGLang's
# retractions (the counter ``sglang:num_retracted_requests_total``, python/sglang/srt/metrics/collector.py;
# its gauge ``sglang:num_retracted_reqs`` is the last interval's count, not a total, and is not read) and
# vLLM's preemptions (the counter ``vllm:num_preemptions``, exposed with prometheus_client's ``_total``
# suffix, vllm/v1/metrics/loggers.py). The names without the suffix are what an exposition of another
# client library may show.
_RETRACTIONS = (
    "sglang:num_retracted_requests_total",
    "sglang:num_retracted_requests",
    "vllm:num_preemptions_total",
    "vllm:num_preemptions",
)
# The KV pool in tokens: SGLang's gauge ``sglang:max_total_num_tokens``; vLLM's info gauge
# ``vllm:cache_config_info``, whose labels are its CacheConfig (``num_gpu_blocks`` and ``block_size``).
_POOL_SGLANG = "sglang:max_total_num_tokens"
_POOL_VLLM = "vllm:cache_config_info"
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class EngineSample(EngineLoad):
    """A load sample and what else the engine's metrics told: its cumulative retractions (SGLang) or
    preemptions (vLLM), the prompt tokens queued for prefill, and its KV pool in tokens (None: the
    engine does not say). No engine publishes its queued prefill tokens as a metric today (neither
    SGLang's scheduler metrics nor vLLM's), so that one stays None unless a future name is added."""

    retractions: int | None = None
    prefill_backlog_tokens: int | None = None
    kv_tokens: int | None = None

    def to_pb(self) -> pb.Load:
        msg = EngineLoad.to_pb(self)
        if self.retractions is not None:
            msg.retractions = self.retractions
        if self.prefill_backlog_tokens is not None:
            msg.prefill_backlog_tokens = self.prefill_backlog_tokens
        return msg

    def as_json(self) -> dict[str, object]:
        out = EngineLoad.as_json(self)
        out["retractions"] = self.retractions
        out["prefill_backlog_tokens"] = self.prefill_backlog_tokens
        return out


def _labels(line: str) -> dict[str, str]:
    start, end = line.find("{"), line.rfind("}")
    if start < 0 or end < start:
        return {}
    return {k: v for k, v in _LABEL.findall(line[start + 1 : end])}


def vllm_pool_tokens(labels: dict[str, str]) -> int | None:
    """``num_gpu_blocks`` x ``block_size`` from the labels of vLLM's ``cache_config_info`` (None when
    either is missing or not a positive number, as before the engine profiled its memory)."""
    try:
        blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError):
        return None
    return blocks * size if blocks > 0 and size > 0 else None


def parse_metrics(text: str) -> EngineSample:
    """Sum each known metric over its label sets (one engine may expose several series).

    An engine that exports both naming schemes (pdsim does, for either kind of peer router) would be
    counted twice if the schemes were added up: each field comes from the first scheme that has it,
    SGLang's before vLLM's. Strict handover compares running + waiting (every request the engine
    holds, those waiting for their KV included) with the masters' leases.
    """
    per_metric: dict[str, float] = {}
    retracted: dict[str, float] = {}
    pools: dict[str, int] = {}
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for i, ch in enumerate(line):
            if ch in "{ ":
                name_end = i
                break
        name = line[:name_end]
        field = _NAMES.get(name)
        if field is None and name not in _RETRACTIONS and name not in (_POOL_SGLANG, _POOL_VLLM):
            continue
        try:
            rest = line[line.rindex("}") + 1 :].split() if "}" in line else line.split()[1:]
            value = float(rest[0])
        except (ValueError, IndexError):
            continue
        if field is None:
            if name in _RETRACTIONS:
                retracted[name] = retracted.get(name, 0.0) + value  # one series per engine or rank
            elif name == _POOL_SGLANG and value >= 1:
                pools[name] = max(pools.get(name, 0), int(value))
            elif name == _POOL_VLLM:
                tokens = vllm_pool_tokens(_labels(line))
                if tokens is not None:
                    pools[name] = max(pools.get(name, 0), tokens)
            continue
        seen = True
        if field == "kv_usage":
            per_metric[name] = max(per_metric.get(name, 0.0), value)
        else:
            per_metric[name] = per_metric.get(name, 0.0) + value
    # Each field from one naming scheme, SGLang's first: the sum of that scheme's families for it
    # (SGLang's waiting is three queues), or for the KV usage the largest.
    sums: dict[str, float] = {}
    for scheme in ("sglang:", "vllm:"):
        for field in ("running", "waiting", "kv_usage"):
            values = [v for n, v in per_metric.items() if n.startswith(scheme) and _NAMES[n] == field]
            if values and field not in sums:
                sums[field] = max(values) if field == "kv_usage" else sum(values)
    # Retractions from the first name present (SGLang's before vLLM's, as above: an engine exporting
    # both schemes counts its retractions once). The pool: of one engine (several series are data
    # parallel engines, each with its own pool: the largest stands for the node, which under-counts a
    # node serving several, never over-counts).
    retractions = next((int(retracted[n]) for n in _RETRACTIONS if n in retracted), None)
    pool = pools.get(_POOL_SGLANG) or pools.get(_POOL_VLLM)
    return EngineSample(
        running=int(sums.get("running", 0)),
        waiting=int(sums.get("waiting", 0)),
        kv_usage=sums.get("kv_usage", 0.0),
        probe_ok=seen,
        retractions=retractions,
        kv_tokens=pool,
    )


def parse_get_load(data: Any) -> EngineLoad:
    """SGLang's ``GET /get_load``: one entry per data-parallel rank, ``num_reqs`` counting running and
    waiting requests, ``num_waiting_reqs`` the waiting ones (served without ``--enable-metrics``)."""
    ranks = data if isinstance(data, list) else [data]
    running = waiting = 0
    seen = False
    for r in ranks:
        if isinstance(r, dict) and isinstance(r.get("num_reqs"), int):
            seen = True
            w = r.get("num_waiting_reqs")
            w = w if isinstance(w, int) else 0
            running += max(0, r["num_reqs"] - w)
            waiting += w
    return EngineLoad(running=running, waiting=waiting, probe_ok=seen)


def parse_v1_loads(data: Any) -> EngineLoad:
    """Newer SGLang's ``GET /v1/loads``: the ``aggregate`` totals over its ranks, and the KV pool from
    its ranks' ``max_total_num_tokens`` (one rank's: each has its own, as in :func:`parse_metrics`)."""
    agg = data.get("aggregate") if isinstance(data, dict) else None
    if not isinstance(agg, dict) or not isinstance(agg.get("total_running_reqs"), int):
        return EngineLoad()
    waiting = agg.get("total_waiting_reqs")
    usage = agg.get("avg_token_usage")
    ranks = data.get("loads")
    pools = (
        [_positive_int(r.get("max_total_num_tokens")) for r in ranks if isinstance(r, dict)]
        if isinstance(ranks, list)
        else []
    )
    return EngineSample(
        running=agg["total_running_reqs"],
        waiting=waiting if isinstance(waiting, int) else 0,
        kv_usage=float(usage) if isinstance(usage, int | float) else 0.0,
        probe_ok=True,
        kv_tokens=max((p for p in pools if p is not None), default=None),
    )


def _parser(url: str) -> Callable[[str], EngineLoad]:
    if url.endswith("/get_load"):
        return lambda text: parse_get_load(json.loads(text))
    if url.endswith("/v1/loads"):
        return lambda text: parse_v1_loads(json.loads(text))
    return parse_metrics


def load_signal_urls(endpoint: str) -> tuple[str, ...]:
    """Where an engine may tell how many requests it runs, best first: Prometheus ``/metrics`` (vLLM
    serves it by default, SGLang only with ``--enable-metrics``), then what a stock SGLang serves."""
    base = endpoint.rstrip("/")
    return (base + "/metrics", base + "/v1/loads", base + "/get_load")


class LoadProbe:
    """Samples the engine's load from the first of ``urls`` that answers with one, and stays with it
    while it works. ``signal`` names the source in use ("" before the first sample, "none" when no
    source answered: strict handover then frees a crashed master's slots only after
    ``--orphan-timeout``); ``problems`` says why each source was passed over.

    ``timeout`` is generous on purpose: a sample counts from when it was started, so a slow answer
    (an engine's ``/metrics`` under heavy load) is still a valid sample, while a request cut off by
    its timeout is no sample at all and costs a new connection for the next one."""

    def __init__(
        self, urls: str | Sequence[str], session: aiohttp.ClientSession, timeout: float = 2.0
    ) -> None:
        self.urls = (urls,) if isinstance(urls, str) else tuple(urls)
        if not self.urls:
            raise ValueError("a load probe needs at least one URL")
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.signal = ""
        self.problems: dict[str, str] = {}
        self._current: str | None = None
        self._warned = False

    @property
    def url(self) -> str:
        return self._current or self.urls[0]

    async def _read(self, url: str) -> EngineLoad | str:
        """The sample, or what went wrong."""
        try:
            async with self.session.get(url, timeout=self.timeout) as resp:
                text = await resp.text()
                if resp.status != 200:
                    return f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return str(exc) or type(exc).__name__
        try:
            sample = _parser(url)(text)
        except ValueError as exc:
            return f"unreadable answer: {exc}"
        return sample if sample.probe_ok else "no request counts in the answer"

    async def sample(self) -> EngineLoad:
        order = [self._current] if self._current else []
        order += [u for u in self.urls if u != self._current]
        for url in order:
            got = await self._read(url)
            if isinstance(got, EngineLoad):
                if url != self._current:
                    log.info("load signal: %s", url)
                self._current, self.signal, self._warned = url, url, False
                self.problems.pop(url, None)
                return got
            self.problems[url] = got
            if not got.startswith(("HTTP", "unreadable", "no request")):
                break  # the engine does not answer at all: the other sources would fail the same way
        self._current = None
        self.signal = "none"
        if not self._warned:
            log.warning(
                "no load signal from the engine (%s); a crashed master's slots on this node are freed "
                "only after --orphan-timeout",
                "; ".join(f"{u}: {why}" for u, why in self.problems.items()),
            )
            self._warned = True
        return EngineLoad()

    def as_json(self) -> dict[str, object]:
        return {"signal": self.signal, "sources": list(self.urls), "problems": dict(self.problems)}


class EngineUnreachable(Exception):
    """The engine did not answer at all (it may still be starting): worth waiting for."""


@dataclass(frozen=True)
class EngineInfo:
    """What the agent reads from its engine when no flag says it."""

    flavour: str  # "sglang" (serves /get_server_info), "openai" (only /v1/models, e.g. vLLM)
    max_running_requests: int | None = None
    bootstrap_port: int | None = None
    model: str | None = None
    # The KV pool in tokens: SGLang's max_total_num_tokens, vLLM's num_gpu_blocks x block_size (from
    # its /metrics: vllm:cache_config_info). None: the engine publishes none (capacity is slots only).
    kv_tokens: int | None = None
    # How the engine orders its waiting queue by a request's priority: "high-first", "low-first", or
    # None when it does not (SGLang's --enable-priority-scheduling and
    # --schedule-low-priority-values-first in /get_server_info). Masters with --engine-priority auto
    # send a priority only to engines that say so (start argument priority_scheduling).
    priority_scheduling: str | None = None


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _server_info_pool(info: dict[str, Any]) -> int | None:
    """SGLang's pool: ``max_total_num_tokens`` at the top of /get_server_info, else that of its first
    rank in ``internal_states`` that says (each data-parallel rank has its own: one stands for the
    node, as in :func:`parse_metrics`)."""
    pool = _positive_int(info.get("max_total_num_tokens"))
    for rank in info.get("internal_states") or ():
        if pool is None and isinstance(rank, dict):
            pool = _positive_int(rank.get("max_total_num_tokens"))
    return pool


async def discover_engine(endpoint: str, session: aiohttp.ClientSession, timeout: float = 5.0) -> EngineInfo:
    """SGLang's ``GET /get_server_info`` (``max_running_requests``, at the top or per rank in
    ``internal_states``; ``disaggregation_bootstrap_port``; ``served_model_name``;
    ``max_total_num_tokens``), else the OpenAI ``GET /v1/models`` (the model only: vLLM does not
    publish its ``max_num_seqs``) and for the KV pool vLLM's ``GET /metrics``.
    EngineUnreachable when neither answers."""
    base = endpoint.rstrip("/")
    errors: list[str] = []

    async def get(path: str, text: bool = False) -> Any:
        try:
            async with session.get(base + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                if resp.status != 200:
                    errors.append(f"{path}: HTTP {resp.status}")
                    return None
                return await resp.text() if text else await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            errors.append(f"{path}: {exc or type(exc).__name__}")
            return None

    info = await get("/get_server_info")
    if isinstance(info, dict):
        cap = _positive_int(info.get("max_running_requests"))
        for rank in info.get("internal_states") or ():
            if cap is None and isinstance(rank, dict):
                cap = _positive_int(rank.get("max_running_requests"))
        model = info.get("served_model_name") or info.get("model_path")
        return EngineInfo(
            "sglang",
            max_running_requests=cap,
            bootstrap_port=_positive_int(info.get("disaggregation_bootstrap_port")),
            model=model if isinstance(model, str) else None,
            kv_tokens=_server_info_pool(info),
            priority_scheduling=(
                ("low-first" if info.get("schedule_low_priority_values_first") is True else "high-first")
                if info.get("enable_priority_scheduling") is True
                else None
            ),
        )
    models = await get("/v1/models")
    if isinstance(models, dict) and isinstance(models.get("data"), list):
        first = models["data"][0] if models["data"] else {}
        model = first.get("id") if isinstance(first, dict) else None
        metrics = await get("/metrics", text=True)
        pool = parse_metrics(metrics).kv_tokens if isinstance(metrics, str) else None
        return EngineInfo("openai", model=model if isinstance(model, str) else None, kv_tokens=pool)
    raise EngineUnreachable(f"engine {base} did not answer ({'; '.join(errors)})")


class EngineHealth:
    """The agent's verdict on its engine's liveness (pure): ``failures`` failed checks in a row mark it
    down, ``successes`` passed checks in a row mark it up again. It starts up (not yet disproved)."""

    def __init__(self, failures: int = 3, successes: int = 2) -> None:
        if failures < 1 or successes < 1:
            raise ValueError("health thresholds must be at least 1")
        self.failures = failures
        self.successes = successes
        self.up = True
        self.reason = ""  # the last failed check's error, kept while down
        self.fail_streak = 0
        self.ok_streak = 0
        self.checks = 0

    def observe(self, ok: bool, error: str = "") -> bool:
        """Record one check; True when the verdict flipped."""
        self.checks += 1
        if ok:
            self.ok_streak += 1
            self.fail_streak = 0
            if not self.up and self.ok_streak >= self.successes:
                self.up = True
                self.reason = ""
                return True
            return False
        self.fail_streak += 1
        self.ok_streak = 0
        if self.up and self.fail_streak >= self.failures:
            self.up = False
            self.reason = error
            return True
        if not self.up:
            self.reason = error
        return False

    def as_json(self) -> dict[str, object]:
        return {
            "up": self.up,
            "reason": self.reason,
            "consecutive_failures": self.fail_streak,
            "consecutive_successes": self.ok_streak,
            "checks": self.checks,
        }


async def check_health(url: str, session: aiohttp.ClientSession, timeout: float = 1.0) -> str:
    """One liveness check (``GET url``): "" when the engine answered 200, otherwise what went wrong."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            await resp.read()
            if resp.status != 200:
                return f"GET {url}: HTTP {resp.status}"
    except TimeoutError:
        return f"GET {url}: no answer within {timeout:g} s"
    except aiohttp.ClientError as exc:
        return f"GET {url}: {exc or type(exc).__name__}"
    return ""
