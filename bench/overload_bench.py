"""Overload: what bounded, prioritised admission is worth, end to end, against sglang-router.

The same fleet of model-mode pdsim engines (``--profile llama3-8b-h100``: a continuous-batch step
loop, a KV pool in tokens with SGLang's reserve and retraction, decode preallocation before the KV
transfer; fresh engines for every run) behind each contender:

* ``sgl``: sglang-router 0.3.2 in PD mode as shipped (cache-aware, no limit) — what most users run;
* ``sgl-tuned``: the same with its limiter set from the fleet: ``--max-concurrent-requests`` = the
  decode slots, ``--rate-limit-tokens-per-second`` = the fleet's throughput (requests per second the
  decode slots complete), ``--queue-size`` = one wave of slots, ``--queue-timeout-secs`` = the TTFT SLO;
* ``sgl-tuned-xN-part`` / ``-whole``: N tuned routers side by side, each given a fixed part of the
  capacity (``part``) or the whole of it (``whole``: nothing coordinates them);
* ``pdcoord-N``: pdcoord with N masters (etcd, an agent beside every engine);
* ablations: ``pdcoord-2-nolimit`` (``--disable-decode-capacity-limit``), ``pdcoord-2-w111`` (class
  weights 1:1:1), ``pdcoord-1-notarget`` (no ``--admission-target-wait``), ``pdcoord-1-vllm`` (vLLM's
  protocol on engines and master: where the decode lease idles during the prefill);
* a ``-skew`` suffix sends 70/20/10 of the sessions to the first routers (70/20/5/5 for four).

Several routers sit behind a load balancer sticky by ``X-Session-Id`` (the load generator hashes the
session over the weights). The load is the Mooncake FAST'25 conversation trace
(bench/traces/mooncake-fast25), replayed open-loop: requests arrive at the trace's timestamps scaled
to the offered rate, prompts are built from one text block per hash id (so prefix caches see the
trace's sharing), a request that extends an earlier one's blocks continues its session.

Sweep: offered load 0.5x-3x λ*, where λ* is the highest rate at which sglang-router as shipped keeps
90 % of requests within the SLO (``--calibrate`` measures it; the default is the last measured value),
plus a burst (1x λ* for 20 s → 2.5x for 60 s → 0.7x for 60 s). SLO: TTFT ≤ 2 s and TPOT ≤ 50 ms,
in **engine time**: engines run ``--time-scale`` K times slower than the profile so that the fleet
fits on two cores, the load is offered K times slower, and every time reported is wall time ÷ K.

Reported per run: goodput (requests per second meeting both SLOs), attainment, TTFT/TPOT p50/p99 per
class (first turns, continuations), sessions whose every turn met the SLO, refusals by class and
status, retractions/preemptions and recomputed tokens, prefill tokens wasted (computed, then never
transferred), the engines' peak queue and Σ running vs capacity, for pdcoord the decode slots'
idle share (leased, not yet running in the engine), and for the burst the time back within the SLO.
Writes bench/results/overload.json and three plots:

    .venv/bin/python bench/overload_bench.py                  # the sweep and the burst (~1 h)
    .venv/bin/python bench/overload_bench.py --loads 1.5,2 --contenders sgl,pdcoord-2 --no-burst
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from peers import BENCH, RESULTS, environment, pyplot, write_json
from proxy_bench import SGLANG_ROUTER_VERSION, ensure_sglang_router, start_sglang_router

from pdcoord.dev.cluster import LocalCluster, scrape_metrics
from pdcoord.dev.etcd_server import LocalEtcd
from pdcoord.dev.launcher import ProcessGroup
from pdsim.profiles import PROFILES, engine_default_max_running, vllm_pool_tokens

TRACE = BENCH / "traces" / "mooncake-fast25" / "conversation_trace.jsonl"
PROFILE = "llama3-8b-h100"
PREFILLS = {"p1": 8, "p2": 8}
DECODES = {"d1": 8, "d2": 8}
MAX_INPUT = 32768
MAX_OUTPUT = 2048
# A decode engine's KV pool holds its whole batch at the longest request the replay sends
# (prompt ≤ MAX_INPUT, answer ≤ MAX_OUTPUT), as an operator sizes --max-running-requests for a pool:
# what runs inside the cap can never be retracted.
DECODE_KV_TOKENS: int | None = max(DECODES.values()) * (MAX_INPUT + MAX_OUTPUT)
CONTEXT_LENGTH: int | None = MAX_INPUT + MAX_OUTPUT + 1024
SIZED_SLOTS = 8
# --engines: how each engine is configured.
# * sized: 8 slots per engine and a decode KV pool holding the whole batch at the longest request
#   (the request-count bound always binds: what earlier results measured);
# * default: the llama3-8b-h100 profile as an operator starts the engine: its own KV pool (the GPU's
#   memory less the weights) and the engine's own default max_running_requests (SGLang: 2048 at the
#   model's 128k context; vLLM: max_num_seqs 1024), the model's context;
# * default-70b: the same with llama3-70b-h100-tp4.
ENGINE_CONFIGS = {
    "sized": "llama3-8b-h100",
    "default": "llama3-8b-h100",
    "default-70b": "llama3-70b-h100-tp4",
}
# --workload: what the clients send (the Mooncake conversation trace underneath all but synthetic).
# * conversation: the trace as it is (max_tokens = the trace's output length);
# * long-prompt: only its requests with 10k-30k input tokens (3 649 of 12 031, mean input 17.2k,
#   mean output 354), timestamps as in the trace, the rate of those;
# * overask: clients send max_tokens 4096 while the answers are the trace's (mean 343): each answer
#   ends early (pdsim_answer_tokens, and <pdsim-answer-tokens=N> ending the prompt for routers that
#   drop unknown fields; finish_reason stop), the engines reserve for 4096.
WORKLOADS = ("conversation", "long-prompt", "overask", "synthetic")
LONG_PROMPT_RANGE = (10_000, 30_000)
OVERASK_MAX_TOKENS = 4096
SLO_TTFT_S = 2.0
SLO_TPOT_S = 0.05
DEFAULT_LAMBDA_STAR = 4.83  # engine-time req/s, measured by --calibrate (bench/README.md)
BURST = ((20.0, 1.0), (60.0, 2.5), (60.0, 0.7))  # (engine seconds, x λ*)

SKEW = {2: (0.7, 0.3), 4: (0.7, 0.2, 0.05, 0.05)}
# pdcoord's TTFT target unless a contender says otherwise: (every class, continuations), engine seconds
RECOMMENDED_TTFT_S = (1.8, 1.5)


# ---------------------------------------------------------------------------- contenders


def contender_spec(name: str) -> dict[str, Any]:
    """``sgl``, ``sgl-tuned``, ``sgl-tuned-x2-part[-skew]``, ``pdcoord-2[-skew|-nolimit|-w111|-vllm|…]``;
    ``pdcoord-1-vllm-staged[NN]``: two-stage admission, lookahead NN % (default 25);
    ``-ttft[NN][cMM]``: a time-to-first-token target of NN tenths of a second (default 18), MM for
    continuations; neither: ``RECOMMENDED_TTFT_S``; ``-wait``: a pure wait target (``--target-wait``)."""
    parts = name.split("-")
    spec: dict[str, Any] = {"name": name, "skew": "skew" in parts, "routers": 1}
    # -nu: the balancer passes a request a router refused (429, 503) to the next router at once
    # (nginx's proxy_next_upstream http_429 http_503 non_idempotent, one more try)
    spec["next_upstream"] = "nu" in parts
    if parts[0] == "sgl":
        spec["kind"] = "sgl"
        spec["tuned"] = "tuned" in parts
        for p in parts:
            if p.startswith("x") and p[1:].isdigit():
                spec["routers"] = int(p[1:])
        spec["whole"] = "whole" in parts
    elif parts[0] == "pdcoord":
        spec["kind"] = "pdcoord"
        spec["routers"] = int(parts[1])
        spec["nolimit"] = "nolimit" in parts
        spec["w111"] = "w111" in parts
        spec["target"] = "notarget" not in parts
        spec["vllm"] = "vllm" in parts
        # -staged: two-stage admission, --prefill-lookahead 0.25 (-stagedNN: NN %)
        staged = [p for p in parts if p.startswith("staged")]
        spec["lookahead"] = (int(staged[0][6:]) / 100 if staged[0][6:] else 0.25) if staged else 0.0
        # -overNN: each decode agent advertises NN % more than its engine's batch cap (bounded
        # over-admission: what is preallocated or in transfer holds no batch slot in the engine)
        over = [p for p in parts if p.startswith("over") and p[4:].isdigit()]
        spec["over"] = int(over[0][4:]) / 100 if over else 0.0
        # -ttftNN[cMM]: --admission-target-wait NN/10 s (continuations MM/10 s)
        # --admission-target-includes-prefill (default 1.8 s for every class)
        ttft = [m for p in parts if (m := re.fullmatch(r"ttft(\d*)(?:c(\d+))?", p))]
        spec["ttft"] = (int(ttft[0][1]) / 10 if ttft[0][1] else 1.8) if ttft else 0.0
        spec["ttft_cont"] = int(ttft[0][2]) / 10 if ttft and ttft[0][2] else spec["ttft"]
        # without either: the flags we recommend for a 2 s TTFT SLO (README), as -ttft18c15;
        # -wait: the earlier default, --admission-target-wait --target-wait (a pure wait target)
        if not ttft and spec["target"] and "wait" not in parts:
            spec["ttft"], spec["ttft_cont"] = RECOMMENDED_TTFT_S
        # -quickshares: decode agents re-split by demand every 0.25 s, by up to the whole node at once
        spec["quickshares"] = "quickshares" in parts
        # -spill: a request a master refuses at once for its expected wait tries the other masters
        # (--spill-peers, pdmaster/spill.py)
        spec["spill"] = "spill" in parts
        # -prio: the engines schedule by priority (SGLang --enable-priority-scheduling, vLLM's order)
        # and the masters send the admission class as it (--engine-priority)
        spec["prio"] = "prio" in parts
    else:
        raise SystemExit(f"--contenders: unknown contender {name!r}")
    return spec


def weights_of(spec: dict[str, Any]) -> list[float]:
    n = spec["routers"]
    if spec["skew"] and n in SKEW:
        return list(SKEW[n])
    return [1.0 / n] * n


def configure_engines(args: argparse.Namespace) -> None:
    """Set the fleet (``--fleet``) and each engine's configuration (``--engines``)."""
    global PROFILE, PREFILLS, DECODES, DECODE_KV_TOKENS, CONTEXT_LENGTH
    PROFILE = ENGINE_CONFIGS[args.engines]
    n_pre, n_dec = (int(x) for x in args.fleet.split("x"))
    if args.engines == "sized":
        cap = SIZED_SLOTS
        longest_answer = max(MAX_OUTPUT, OVERASK_MAX_TOKENS if args.workload == "overask" else 0)
        DECODE_KV_TOKENS = cap * (MAX_INPUT + longest_answer)
        CONTEXT_LENGTH = MAX_INPUT + longest_answer + 1024
        pre_cap = dec_cap = cap
    else:
        DECODE_KV_TOKENS = None  # the profile's own pool
        CONTEXT_LENGTH = None  # the model's own context
        pre_cap = dec_cap = engine_cap(vllm=False)
    PREFILLS = {f"p{i + 1}": pre_cap for i in range(n_pre)}
    DECODES = {f"d{i + 1}": dec_cap for i in range(n_dec)}


def engine_cap(vllm: bool) -> int:
    """A default engine's own max_running_requests (pdsim.profiles: as SGLang and vLLM compute it)."""
    p = PROFILES[PROFILE]
    pool = vllm_pool_tokens(p.default_max_total_tokens) if vllm else p.default_max_total_tokens
    return engine_default_max_running("vllm" if vllm else "sglang", p, pool, p.context_length)


def caps_for(vllm: bool) -> dict[str, int]:
    """Every engine's batch cap for a contender (a default vLLM engine has another than SGLang's)."""
    caps = {**PREFILLS, **DECODES}
    if DECODE_KV_TOKENS is None and vllm:
        caps = dict.fromkeys(caps, engine_cap(vllm=True))
    return caps


def workload_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The trace rows the workload replays (the synthetic workload: the trace, for the estimates)."""
    rows = trace_rows(args)
    if args.workload == "long-prompt":
        lo, hi = LONG_PROMPT_RANGE
        rows = [r for r in rows if lo <= r["input_length"] <= hi]
    return rows


def decode_concurrency(args: argparse.Namespace) -> float:
    """Requests the decode engines hold at once: the batch caps, or what their KV pools hold of the
    replayed requests (mean prompt + mean answer) when that is less."""
    if DECODE_KV_TOKENS is not None:
        return float(sum(DECODES.values()))
    rows = workload_rows(args)
    mean_in = statistics.mean(min(r["input_length"], MAX_INPUT) for r in rows) if rows else 12035
    mean_out = statistics.mean(r["output_length"] for r in rows) if rows else 343
    pool = PROFILES[PROFILE].default_max_total_tokens
    per_engine = min(max(DECODES.values()), pool / (mean_in + mean_out))
    return per_engine * len(DECODES)


def fleet_throughput(args: argparse.Namespace) -> float:
    """Requests per engine second the fleet completes, estimated: the decode side (the requests held
    at once ÷ the mean decode time at that batch, the profile's step) or, when less, the prefill side
    (the prefill engines' token rate in full chunks ÷ the mean prompt, a third of it cached)."""
    rows = workload_rows(args)
    p = PROFILES[PROFILE]
    mean_out = statistics.mean(min(r["output_length"], MAX_OUTPUT) for r in rows) if rows else 343
    mean_in = statistics.mean(min(r["input_length"], MAX_INPUT) for r in rows) if rows else 12035
    conc = decode_concurrency(args)
    step_s = p.step_base_s + p.per_decode_seq_s * conc / len(DECODES)
    decode = conc / (mean_out * step_s)
    chunk = args.max_prefill_tokens or 16384
    prefill_tok_s = chunk / (p.step_base_s + p.per_prefill_token_s * chunk) * len(PREFILLS)
    prefill = prefill_tok_s / (mean_in * (2 / 3))
    if DECODE_KV_TOKENS is not None and args.engines == "sized":
        return decode  # the earlier estimate: the decode slots bind
    return min(decode, prefill)


_TRACE_ROWS: list[dict[str, Any]] | None = None


def trace_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    global _TRACE_ROWS
    if _TRACE_ROWS is None:
        with open(args.trace) as f:
            _TRACE_ROWS = [json.loads(line) for line in f if line.strip()]
    return _TRACE_ROWS


# ---------------------------------------------------------------------------- engine sampling


class Sampler(threading.Thread):
    """Polls every engine's /metrics (and pdcoord masters' /admission) twice a second."""

    def __init__(self, engines: dict[str, Any], masters: list[Any], period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.engines = engines
        self.masters = masters
        self.period = period
        self.stop_event = threading.Event()
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.stop_event.wait(self.period):
            row: dict[str, Any] = {"t": time.monotonic() - self.t0, "engines": {}}
            for name, e in self.engines.items():
                try:
                    m = scrape_metrics(e.url, timeout=2.0)
                except OSError:
                    continue
                running = m.get("sglang:num_running_reqs", 0.0)
                held = (
                    running
                    + m.get("sglang:num_queue_reqs", 0.0)
                    + m.get("sglang:num_decode_prealloc_queue_reqs", 0.0)
                    + m.get("sglang:num_decode_transfer_queue_reqs", 0.0)
                )
                # Queued inside the engine = what it holds beyond its batch cap: a request in
                # its prealloc or transfer queue within the cap is the PD hand-off, not a queue.
                row["engines"][name] = {
                    "running": running,
                    "held": held,
                    "queue": max(0.0, held - e.capacity),
                    # KV pool used / pool (both flavours publish SGLang's gauge in pdsim)
                    "kv": m.get("sglang:token_usage", m.get("vllm:kv_cache_usage_perc", 0.0)),
                    "prealloc": m.get("sglang:num_decode_prealloc_queue_reqs", 0.0),
                }
            leased = queued = held = 0.0
            per_master = []
            for master in self.masters:
                try:
                    with urllib.request.urlopen(master.url + "/admission", timeout=2.0) as r:
                        adm = json.loads(r.read())
                    active = float(adm.get("active", 0))
                    # with two-stage admission the gate's queue and the passes not yet leased wait too
                    gate = adm.get("gate") or {}
                    waiting = float(adm.get("queued_requests", 0)) + float(gate.get("queued_requests", 0))
                    cap = float(adm.get("capacity", 0))
                except (OSError, ValueError):
                    continue
                leased += active
                queued += waiting
                held += cap
                per_master.append((cap, active, waiting))
            row["leased"] = leased
            row["queued"] = queued
            row["held"] = held
            row["masters"] = per_master
            self.samples.append(row)

    def stop(self) -> list[dict[str, Any]]:
        self.stop_event.set()
        self.join(5)
        return self.samples


def engine_counters(engines: dict[str, Any]) -> dict[str, dict[str, float]]:
    names = (
        "sglang:num_retracted_requests_total",
        "sglang:num_retracted_input_tokens_total",
        "sglang:num_retracted_output_tokens_total",
        "vllm:num_preemptions_total",
        "pdsim_recomputed_tokens_total",
        "pdsim_queued_total",
        "pdsim_max_running",
        "pdsim_max_waiting",
        "pdsim_capacity",
        "pdsim_prefill_tokens_total",
        "pdsim_prompt_tokens_total",
        "pdsim_cached_tokens_total",
    )
    out: dict[str, dict[str, float]] = {}
    for name, e in engines.items():
        try:
            m = scrape_metrics(e.url, timeout=3.0)
        except OSError:
            continue
        out[name] = {k: m[k] for k in names if k in m}
        # the prefill outcome split is labelled: read it separately
        out[name].update(prefill_outcomes(e.url))
    return out


def prefill_outcomes(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=3.0) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdsim_prefill_tokens_total{"):
            series, _, value = line.rpartition(" ")
            outcome = series.split('outcome="', 1)[-1].split('"', 1)[0]
            out[f"prefill_tokens_{outcome}"] = float(value)
    return out


# ---------------------------------------------------------------------------- one run


def workload_args(args: argparse.Namespace) -> list[str]:
    if args.workload == "synthetic":
        # Multi-turn sessions (the load generator's defaults: 2-6 turns, 10 s think time, a 2k-token
        # system prompt shared by a few sessions, answers of 80-350 tokens, 10 % with n = 4): most
        # requests are continuations, which the trace's short windows hardly hold.
        return ["--synthetic"]
    out = ["--trace", str(args.trace), "--max-input-tokens", str(MAX_INPUT)]
    if args.workload == "long-prompt":
        out += ["--trace-input-range", "{}-{}".format(*LONG_PROMPT_RANGE)]
    elif args.workload == "overask":
        # the answer's length also ends the prompt: sglang-router rebuilds the body and drops the field
        out += ["--ask-max-tokens", str(OVERASK_MAX_TOKENS), "--answer-in-prompt"]
    return out


def engine_args(args: argparse.Namespace, role: str, vllm: bool) -> dict[str, Any]:
    a: dict[str, Any] = {
        "profile": PROFILE,
        "time_scale": args.time_scale,
        "api": "vllm" if vllm else "sglang",
    }
    if CONTEXT_LENGTH is not None:
        a["context_length"] = CONTEXT_LENGTH
    if args.max_prefill_tokens:
        a["max_prefill_tokens"] = args.max_prefill_tokens
    if role == "decode" and DECODE_KV_TOKENS is not None:
        a["max_total_tokens"] = DECODE_KV_TOKENS
    return a


def run_one(
    spec: dict[str, Any],
    args: argparse.Namespace,
    *,
    rate: float,
    schedule: str | None,
    duration_e: float,
    tag: str,
    sgl_py: str | None,
) -> dict[str, Any]:
    """Start a fresh fleet and ``spec``'s routers, replay the trace at ``rate`` (engine req/s)."""
    k = args.time_scale
    log_dir = tempfile.mkdtemp(prefix=f"pdcoord-overload-{spec['name']}-")
    out_file = Path(log_dir) / "records.jsonl"
    vllm = bool(spec.get("vllm"))
    with contextlib.ExitStack() as stack:
        # exits in reverse: the processes first, etcd last
        etcd = None
        if spec["kind"] == "pdcoord":
            etcd = stack.enter_context(LocalEtcd(log_path=f"{log_dir}/etcd.log"))
        group = stack.enter_context(ProcessGroup(log_dir))
        if True:
            c = LocalCluster(group, etcd.endpoint if etcd else "", f"overload-{tag}")
            engines: dict[str, Any] = {}
            capacities = caps_for(vllm)
            for name, cap in capacities.items():
                role = "prefill" if name.startswith("p") else "decode"
                ea = engine_args(args, role, vllm)
                if spec.get("prio"):
                    ea["enable_priority_scheduling"] = True
                    if vllm:
                        ea["schedule_low_priority_values_first"] = True
                if spec["kind"] == "pdcoord" and role == "decode" and spec.get("over"):
                    engines[name] = c.start_engine(name, role, cap, fast=False, **ea)
                    advertised = math.ceil(cap * (1 + spec["over"]))
                    c.start_agent(name, role, endpoint=engines[name].url, capacity=advertised,
                                  bootstrap_port=engines[name].bootstrap_port)  # fmt: skip
                    capacities[name] = advertised
                elif spec["kind"] == "pdcoord":
                    quick = (
                        {"rebalance_interval": 0.25, "rebalance_max_step": 1.0, "rebalance_hysteresis": 1}
                        if spec["quickshares"] and role == "decode"
                        else {}
                    )
                    engines[name] = c.start_node(name, role, cap, fast=False, engine_args=ea, **quick)
                else:
                    engines[name] = c.start_engine(name, role, cap, fast=False, **ea)
            urls: list[str] = []
            masters: list[Any] = []
            weights = weights_of(spec)
            if spec["kind"] == "pdcoord":
                ids = [f"m{i + 1}" for i in range(spec["routers"])]
                extra: dict[str, Any] = {"model": "pdsim-model"}
                if spec["nolimit"]:
                    extra["disable_decode_capacity_limit"] = True
                if spec["w111"]:
                    extra["admission_weights"] = "1:1:1"
                if spec["ttft"]:
                    t_all, t_cont = spec["ttft"] * k, spec["ttft_cont"] * k
                    extra["admission_target_wait"] = f"{t_cont:g}:{t_all:g}:{t_all:g}"
                    extra["admission_target_includes_prefill"] = True
                elif spec["target"] and args.target_wait:
                    extra["admission_target_wait"] = f"{args.target_wait * k:g}"
                if vllm:
                    extra["engine_protocol"] = "vllm"
                if spec["lookahead"]:
                    extra["prefill_lookahead"] = f"{spec['lookahead']:g}"
                if spec["spill"]:
                    extra["spill_peers"] = str(len(ids) - 1)
                if spec["prio"]:
                    extra["engine_priority"] = "low-first" if vllm else "high-first"
                for mid in ids:
                    masters.append(c.start_master(mid, **extra))
                c.wait_for(lambda: c.full_capacity_held(ids, capacities), timeout=90)
                urls = [m.url for m in masters]
            else:
                assert sgl_py is not None
                n = spec["routers"]
                # what the decode engines run at once: their slots, or what their KV holds
                slots = round(decode_concurrency(args))
                thr = fleet_throughput(args) / k  # wall req/s
                for i in range(n):
                    flags: list[str] = []
                    if spec["tuned"]:
                        part = 1.0 if spec["whole"] else weights[i]
                        conc = max(1, round(slots * part))
                        flags = [
                            "--max-concurrent-requests", str(conc),
                            "--rate-limit-tokens-per-second", str(max(1, round(thr * part))),
                            "--queue-size", str(conc),
                            "--queue-timeout-secs", str(max(1, math.ceil(SLO_TTFT_S * k))),
                        ]  # fmt: skip
                    prefills = [engines[name] for name in PREFILLS]
                    decodes = [engines[d] for d in DECODES]
                    url, _pid, err = start_sglang_router(
                        group,
                        sgl_py,
                        prefills[0],
                        decodes[0],
                        decodes[1:],
                        extra_prefill=prefills[1:],
                        args=flags,
                        name=f"sglang-router-{i + 1}",
                    )
                    if err or url is None:
                        raise RuntimeError(f"sglang-router did not start: {err}")
                    urls.append(url)
            sampler = Sampler(engines, masters)
            sampler.start()
            cmd = [
                sys.executable, "-m", "pdcoord.dev.loadgen", "open",
                "--targets", ",".join(urls), "--weights", ",".join(f"{w:g}" for w in weights),
                *workload_args(args),
                "--rate", f"{rate:.4f}", "--duration", f"{duration_e:.1f}",
                "--request-timeout", f"{args.client_timeout:.1f}",
                "--time-scale", f"{k:g}", "--seed", str(args.seed), "--out", str(out_file),
                "--model", "pdsim-model",
            ]  # fmt: skip
            if schedule:
                cmd += ["--schedule", schedule]
            if spec["next_upstream"] and spec["routers"] > 1:
                cmd += ["--next-upstream", "1"]
            started = time.monotonic()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_e * k * 3 + 600)
            wall = time.monotonic() - started
            samples = sampler.stop()
            if proc.returncode != 0:
                raise RuntimeError(f"loadgen failed ({proc.returncode}): {proc.stderr[-3000:]}")
            counters = engine_counters(engines)
    records = [json.loads(line) for line in out_file.read_text().splitlines() if line.strip()]
    return {
        "records": records,
        "samples": samples,
        "counters": counters,
        "wall_s": round(wall, 1),
        "log_dir": log_dir,
    }


# ---------------------------------------------------------------------------- analysis


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    vals = sorted(values)
    idx = min(len(vals) - 1, max(0, math.ceil(q / 100.0 * len(vals)) - 1))
    return round(vals[idx], 3)


def is_ok(r: dict[str, Any]) -> bool:
    return r.get("status") == 200 and not r.get("error_code") and (r.get("output_tokens") or 0) > 0


def met_slo(r: dict[str, Any], k: float) -> bool:
    if not is_ok(r) or r.get("ttft_s") is None:
        return False
    if r["ttft_s"] / k > SLO_TTFT_S:
        return False
    tpot = r.get("tpot_s")
    return tpot is None or tpot / k <= SLO_TPOT_S


def klass(r: dict[str, Any]) -> str:
    return "continuation" if r.get("is_continuation") else "first_turn"


def analyse_records(recs: list[dict[str, Any]], k: float, duration_e: float) -> dict[str, Any]:
    """What the clients saw (the records of the load generator)."""
    measured = [r for r in recs if r.get("t_send", 0.0) / k < duration_e]
    met = [r for r in measured if met_slo(r, k)]
    # A sustained overload: the second half of the window, once the engines' queues had time to
    # build (a cold start flatters an unbounded router: its queue grows for the whole run).
    half = [r for r in measured if r.get("t_send", 0.0) / k >= duration_e / 2]
    by_class: dict[str, Any] = {}
    for c in ("first_turn", "continuation"):
        rs = [r for r in measured if klass(r) == c]
        ok = [r for r in rs if is_ok(r) and r.get("ttft_s") is not None]
        ttft = [r["ttft_s"] / k for r in ok]
        tpot = [r["tpot_s"] / k for r in ok if r.get("tpot_s") is not None]
        refused: dict[str, int] = defaultdict(int)
        for r in rs:
            if not is_ok(r):
                refused[str(r.get("status"))] += 1
        by_class[c] = {
            "requests": len(rs),
            "ok": len(ok),
            "met_slo": sum(1 for r in rs if met_slo(r, k)),
            "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50),
            "tpot_p99_s": pct(tpot, 99),
            "not_ok_by_status": dict(sorted(refused.items())),
        }
    sessions: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in measured:
        if r.get("session_id"):
            sessions[r["session_id"]].append(r)
    multi = {s: rs for s, rs in sessions.items() if len(rs) > 1}
    statuses: dict[str, int] = defaultdict(int)
    for r in measured:
        statuses[str(r.get("status"))] += 1
    return {
        "requests": len(measured),
        "goodput_rps": round(len(met) / duration_e, 3),
        "attainment": round(len(met) / len(measured), 3) if measured else None,
        "goodput_second_half_rps": round(sum(1 for r in half if met_slo(r, k)) / (duration_e / 2), 3),
        "attainment_second_half": round(sum(1 for r in half if met_slo(r, k)) / len(half), 3)
        if half
        else None,
        "throughput_rps": round(sum(1 for r in measured if is_ok(r)) / duration_e, 3),
        "by_class": by_class,
        "statuses": dict(sorted(statuses.items())),
        "sessions_multi_turn": len(multi),
        "sessions_all_turns_met": sum(1 for rs in multi.values() if all(met_slo(r, k) for r in rs)),
    }


def analyse(run: dict[str, Any], k: float, duration_e: float) -> dict[str, Any]:
    counters = run["counters"]

    def total(key: str, names: Any = None) -> float:
        return sum(v.get(key, 0.0) for n, v in counters.items() if names is None or n in names)

    dec, pre = set(DECODES), set(PREFILLS)
    peak_queue = 0.0
    sum_running_max = 0.0
    idle_shares: list[float] = []
    busy: list[float] = []  # Σ running / decode capacity, per sample
    idle_waiting: list[float] = []  # the capacity idle while requests wait in admission queues
    unleased_waiting: list[float] = []
    stranded: list[float] = []
    capacity = sum(DECODES.values())
    kv_use: list[float] = []  # decode KV used / pool, mean over the decode engines, per sample
    prealloc_peak = 0.0
    for s in run["samples"]:
        eng = s["engines"]
        kvs = [eng[n].get("kv", 0.0) for n in eng if n in dec]
        if kvs:
            kv_use.append(statistics.mean(kvs))
        prealloc_peak = max(prealloc_peak, sum(eng[n].get("prealloc", 0.0) for n in eng if n in dec))
        peak_queue = max(peak_queue, sum(eng[n]["queue"] for n in eng if n in dec))
        running = sum(eng[n]["running"] for n in eng if n in dec)
        sum_running_max = max(sum_running_max, running)
        busy.append(min(1.0, running / capacity))
        idle_waiting.append(max(0.0, 1.0 - running / capacity) if s.get("queued", 0) > 0 else 0.0)
        if "masters" in s and s.get("queued", 0) > 0:
            # of that: slots no master leased, and of those the ones held by a master queueing nothing
            # (the multi-master fragmentation) against slots of no share (between epochs)
            unleased_waiting.append(max(0.0, s["held"] - s["leased"]) / capacity)
            stranded.append(sum(max(0.0, c - a) for c, a, q in s["masters"] if q == 0) / capacity)
        if s.get("leased", 0) > 0:
            idle_shares.append(max(0.0, 1.0 - running / s["leased"]))
    return {
        **analyse_records(run["records"], k, duration_e),
        "retractions": total("sglang:num_retracted_requests_total"),
        "preemptions": total("vllm:num_preemptions_total"),
        "recomputed_tokens": total("pdsim_recomputed_tokens_total"),
        "prefill_tokens_wasted": total("prefill_tokens_wasted"),
        "prefill_tokens_transferred": total("prefill_tokens_transferred"),
        # of the prompt tokens the prefill engines saw, the share their prefix caches held: what
        # cache-aware routing saves (a turn sent where its context is not cached prefills all of it)
        "prefill_cache_hit_share": (
            round(total("pdsim_cached_tokens_total", pre) / total("pdsim_prompt_tokens_total", pre), 4)
            if total("pdsim_prompt_tokens_total", pre) > 0
            else None
        ),
        "engine_queued_total": total("pdsim_queued_total", dec),
        # decode KV pool used / pool, averaged over the run's samples (and the decode engines)
        "decode_kv_util_mean": round(statistics.mean(kv_use), 3) if kv_use else None,
        "decode_kv_util_peak": round(max(kv_use), 3) if kv_use else None,
        "engine_prealloc_peak": prealloc_peak,
        "engine_peak_queue": peak_queue,
        "engine_peak_waiting": max(
            (counters[n].get("pdsim_max_waiting", 0.0) for n in dec if n in counters), default=0.0
        ),
        "sum_running_peak": sum_running_max,
        "engine_max_running": {n: counters[n].get("pdsim_max_running") for n in dec if n in counters},
        "decode_capacity": sum(DECODES.values()),
        "decode_idle_share_of_leases": round(statistics.mean(idle_shares), 3) if idle_shares else None,
        "decode_busy_share": round(statistics.mean(busy), 3) if busy else None,
        # of the capacity: idle while some request waited for admission (the rest idled for want of
        # requests: the trace's lulls after the clumps it refused)
        "decode_idle_while_queued_share": round(statistics.mean(idle_waiting), 3) if idle_waiting else None,
        # of the capacity, on average over all samples: held by a master but not leased while some
        # request waited, and of that held by a master whose own queue was empty
        "decode_unleased_while_queued_share": (
            round(sum(unleased_waiting) / len(busy), 3) if busy and "masters" in run["samples"][0] else None
        ),
        "decode_stranded_while_queued_share": (
            round(sum(stranded) / len(busy), 3) if busy and "masters" in run["samples"][0] else None
        ),
        "per_master": per_master(run["samples"]),
        "wall_s": run["wall_s"],
        "records_file": str(Path(run["log_dir"]) / "records.jsonl"),
    }


def per_master(samples: list[dict[str, Any]]) -> list[dict[str, float]] | None:
    """Per pdcoord master (in start order), on average over the samples that saw every master: the
    capacity it held, its leases, its queue, the share of time it queued, and the slots it held idle
    with nothing queued while another master queued. None for one master or a router of another kind."""
    n = max((len(s.get("masters", ())) for s in samples), default=0)
    if n < 2:
        return None
    full = [s["masters"] for s in samples if len(s.get("masters", ())) == n]

    def mean(values: list[float]) -> float:
        return round(sum(values) / len(full), 2)

    out = []
    for i in range(n):
        idle = [
            max(0.0, ms[i][0] - ms[i][1])
            for ms in full
            if ms[i][2] == 0 and any(ms[j][2] > 0 for j in range(n) if j != i)
        ]
        out.append({
            "capacity": mean([ms[i][0] for ms in full]),
            "active": mean([ms[i][1] for ms in full]),
            "queued": mean([ms[i][2] for ms in full]),
            "time_queueing": mean([1.0 if ms[i][2] > 0 else 0.0 for ms in full]),
            "idle_while_another_queues": mean(idle),
        })  # fmt: skip
    return out


def burst_series(run: dict[str, Any], k: float, window_e: float = 5.0) -> dict[str, Any]:
    recs = run["records"]
    end_e = sum(d for d, _ in BURST)
    burst_end = BURST[0][0] + BURST[1][0]
    rows = []
    t = 0.0
    while t < end_e:
        rs = [r for r in recs if t <= r.get("t_send", 0.0) / k < t + window_e]
        met = sum(1 for r in rs if met_slo(r, k))
        refused = sum(1 for r in rs if r.get("status") in (429, 503))
        rows.append(
            {
                "t": t,
                "offered": len(rs),
                "met": met,
                "refused": refused,
                "attainment_of_admitted": round(met / max(1, len(rs) - refused), 3) if rs else None,
                "attainment": round(met / len(rs), 3) if rs else None,
            }
        )
        t += window_e
    # engine queue per sample (engine time)
    queue = [
        {"t": round(s["t"] / k, 2), "queue": sum(e["queue"] for n, e in s["engines"].items() if n in DECODES)}
        for s in run["samples"]
    ]

    def back_after(key: str) -> float | None:
        """Engine seconds from the burst's end to the first of two windows in a row in which 90 %
        of the requests sent meet the SLO (``attainment``: of all offered — the load after the burst
        is below capacity, so everything can be served; ``attainment_of_admitted``: of those not
        refused)."""
        for i, row in enumerate(rows):
            if row["t"] < burst_end:
                continue
            ok_now = row[key] is not None and row[key] >= 0.9
            nxt = rows[i + 1] if i + 1 < len(rows) else None
            if ok_now and (nxt is None or (nxt[key] or 0) >= 0.9):
                return float(row["t"] - burst_end)
        return None

    return {
        "windows": rows,
        "engine_queue": queue,
        "back_within_slo_s": back_after("attainment"),
        "admitted_back_within_slo_s": back_after("attainment_of_admitted"),
    }


# ---------------------------------------------------------------------------- plots and table


def plot(results: dict[str, Any], stem: str = "overload") -> list[str]:
    """The plots, named after the results file (``overload.json`` → ``overload_goodput.png`` …)."""
    plt = pyplot()
    if plt is None:
        return []
    files = []
    sweep = results["sweep"]
    contenders = sorted({r["contender"] for r in sweep}, key=lambda c: (not c.startswith("pdcoord"), c))
    for metric, ylabel, fname, logy in (
        ("goodput_rps", "goodput (req/s within SLO, engine time)", f"{stem}_goodput.png", False),
        (
            "goodput_second_half_rps",
            "goodput in the window's 2nd half (req/s within SLO)",
            f"{stem}_goodput_sustained.png",
            False,
        ),
        ("cont_p99", "continuation turns: p99 TTFT (s, engine time)", f"{stem}_cont_ttft.png", True),
    ):
        fig, ax = plt.subplots(figsize=(8, 5))
        for c in contenders:
            pts = []
            for (cc, x), rows in sorted(points(sweep).items()):
                ys = [y for r in rows if cc == c and (y := value_of(r, metric)) is not None]
                if ys:
                    pts.append((x, statistics.median(ys)))
            if pts:
                style = "-o" if c.startswith("pdcoord") else "--s"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=c)
        ax.set_xlabel("offered load (x λ*)")
        ax.set_ylabel(ylabel)
        if metric == "cont_p99":
            ax.axhline(SLO_TTFT_S, color="grey", lw=0.8, ls=":")
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = RESULTS / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path.relative_to(BENCH.parent)))
    if results.get("burst"):
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
        for c, b in results["burst"].items():
            w = b["series"]["windows"]
            ax1.plot([r["t"] for r in w], [r["attainment"] for r in w], label=c)
            q = b["series"]["engine_queue"]
            ax2.plot([r["t"] for r in q], [r["queue"] for r in q], label=c)
        for ax in (ax1, ax2):
            ax.axvspan(BURST[0][0], BURST[0][0] + BURST[1][0], color="orange", alpha=0.1)
            ax.grid(alpha=0.3)
        ax1.set_ylabel("share of offered requests within SLO")
        ax2.set_ylabel("requests queued inside decode engines")
        ax2.set_xlabel("engine time (s); burst 2.5x λ* shaded")
        ax1.legend(fontsize=8)
        fig.tight_layout()
        path = RESULTS / f"{stem}_burst.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path.relative_to(BENCH.parent)))
    return files


def value_of(row: dict[str, Any], metric: str) -> float | None:
    if metric == "cont_p99":
        v = row["by_class"]["continuation"]["ttft_p99_s"]
        return float(v) if v is not None else None
    v = row.get(metric)
    return float(v) if v is not None else None


def points(sweep: list[dict[str, Any]]) -> dict[tuple[str, float], list[dict[str, Any]]]:
    """The runs of each (contender, load): one, or ``--repeats`` of them."""
    out: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in sweep:
        out.setdefault((r["contender"], r["load"]), []).append(r)
    return out


def median_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median goodput (the lower of the middle two for an even count)."""
    ranked = sorted(rows, key=lambda r: r["goodput_rps"])
    return ranked[(len(ranked) - 1) // 2]


def _order(c: str) -> tuple[int, str]:
    return (0 if c.startswith("sgl") else 1, c)


def table(results: dict[str, Any]) -> str:
    """The README's tables: goodput per contender and load; what happened at 1.5x and 2x; the burst."""
    sweep = results["sweep"]
    loads = sorted({r["load"] for r in sweep})
    runs = points(sweep)
    by = {key: median_run(rows) for key, rows in runs.items()}
    contenders = sorted({r["contender"] for r in sweep}, key=_order)
    out = [
        "Goodput, requests per second within the SLO (engine time): whole window / its second half; "
        "with repeated runs the medians, and the whole window's range over n runs",
        "",
        "| contender | " + " | ".join(f"{x:g} x λ*" for x in loads) + " |",
        "|---|" + "---|" * len(loads),
    ]
    for c in contenders:
        cells = []
        for x in loads:
            rows = runs.get((c, x), [])
            if not rows:
                cells.append("")
                continue
            g = [r["goodput_rps"] for r in rows]
            half = statistics.median(r.get("goodput_second_half_rps", 0.0) for r in rows)
            cell = f"{statistics.median(g):.2f} / {half:.2f}"
            if len(rows) > 1:
                cell += f" ({min(g):.2f} to {max(g):.2f}, n={len(rows)})"
            cells.append(cell)
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    out += [
        "",
        "At 1.5x and 2x (a repeated point: its run of median goodput):",
        "",
        "| contender | load | attainment | TTFT p50 / p99, first turns | TTFT p99, continuations (n) "
        "| sessions all within SLO | not served | engine queue peak / requests queued | retractions "
        "| wasted prefill tokens | leased decode slots idle |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in [v for v in loads if v in (1.5, 2.0)]:
        for c in contenders:
            r = by.get((c, x))
            # the ablations whose story the goodput table and the text tell
            if r is None or any(tag in c for tag in ("nolimit", "w111", "vllm", "x2-whole")):
                continue
            ft, co = r["by_class"]["first_turn"], r["by_class"]["continuation"]
            refused = ", ".join(f"{v} x {s}" for s, v in r["statuses"].items() if s != "200") or "0"
            # without a limit a lease is granted at once: its "idle" share is the engine's queue
            idle = None if "nolimit" in c else r.get("decode_idle_share_of_leases")
            out.append(
                f"| {c} | {x:g} | {r['attainment']} | {ft['ttft_p50_s']} / {ft['ttft_p99_s']} "
                f"| {co['ttft_p99_s']} ({co['requests']}) "
                f"| {r['sessions_all_turns_met']} of {r['sessions_multi_turn']} | {refused} "
                f"| {r['engine_peak_queue']:.0f} / {r['engine_queued_total']:.0f} | {r['retractions']:.0f} "
                f"| {r['prefill_tokens_wasted']:.0f} | {'' if idle is None else f'{idle:.0%}'} |"
            )
    if results.get("burst"):
        out += [
            "",
            "| contender | back within SLO after the burst (offered / admitted), s | not served "
            "| engine queue peak |",
            "|---|---|---|---|",
        ]
        for c, b in sorted(results["burst"].items(), key=lambda kv: _order(kv[0])):
            ser, summ = b["series"], b["summary"]
            refused = sum(v for s, v in summ["statuses"].items() if s != "200")
            peak = max((q["queue"] for q in ser["engine_queue"]), default=0.0)
            back = ser["back_within_slo_s"]
            back_adm = ser["admitted_back_within_slo_s"]
            out.append(
                f"| {c} | {'never' if back is None else back:} / {'never' if back_adm is None else back_adm} "
                f"| {refused} | {peak:.0f} |"
            )
    return "\n".join(out)


def engine_table(results: dict[str, Any]) -> str:
    """What happened inside the engines, per contender and load (a repeated point: each run)."""
    out = [
        "| contender | load | goodput | waited in a decode engine | retractions / preemptions "
        "| decode KV used (mean / peak) | TTFT p99 first turns / continuations |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results["sweep"], key=lambda r: (r["load"], _order(r["contender"]), r.get("repeat", 0))):
        ft, co = r["by_class"]["first_turn"], r["by_class"]["continuation"]
        out.append(
            f"| {r['contender']} | {r['load']:g} | {r['goodput_rps']:.2f} | {r['engine_queued_total']:.0f} "
            f"| {r['retractions']:.0f} / {r['preemptions']:.0f} "
            f"| {r.get('decode_kv_util_mean')} / {r.get('decode_kv_util_peak')} "
            f"| {ft['ttft_p99_s']} / {co['ttft_p99_s']} |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------- reanalysis


def find_records(row: dict[str, Any], contender: str) -> Path | None:
    """A run's records: the file the row names, else (rows of an earlier version) the newest run
    directory of that contender in the temp dir holding as many records as the row counted."""
    named = row.get("records_file")
    if named and Path(named).exists():
        return Path(named)
    pattern = f"pdcoord-overload-{contender}-"
    found: list[tuple[float, Path]] = []
    for d in Path(tempfile.gettempdir()).iterdir():
        rest = d.name[len(pattern) :]
        if not d.name.startswith(pattern) or len(rest) != 8 or "-" in rest:
            continue
        f = d / "records.jsonl"
        if f.exists() and sum(1 for line in f.open() if line.strip()) == row["requests"]:
            found.append((f.stat().st_mtime, f))
    return max(found)[1] if found else None


def drop_redone_failures(results: dict[str, Any]) -> None:
    """Failures of runs that a later --merge run redid are history, not results."""
    done = {f"{r['contender']}@{r['load']}" for r in results["sweep"]}
    done |= {f"burst {name}" for name in results.get("burst", {})}
    notes = results.get("notes", {})
    kept = [f for f in notes.get("failed_runs", []) if f.split(":", 1)[0] not in done]
    if kept:
        notes["failed_runs"] = kept
    else:
        notes.pop("failed_runs", None)


def reanalyse(path: Path) -> dict[str, Any]:
    """Recompute what the clients saw from the kept records (the engines' side stays as measured)."""
    results: dict[str, Any] = json.loads(path.read_text())
    cfg = results.get("config", {})  # a partial file (a sweep still running) has none: the defaults
    k, duration = cfg.get("time_scale", 1.0), cfg.get("duration_engine_s", 60.0)
    for row in results["sweep"]:
        f = find_records(row, row["contender"])
        if f is None:
            print(f"{row['contender']} @ {row['load']}: records not found, kept as is", file=sys.stderr)
            continue
        recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        row.update(analyse_records(recs, k, duration))
        row["records_file"] = str(f)
    total = sum(d for d, _ in BURST)
    for name, b in results.get("burst", {}).items():
        f = find_records(b["summary"], name)
        if f is None:
            continue
        recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        b["summary"].update(analyse_records(recs, k, total))
        b["summary"]["records_file"] = str(f)
        queue = b["series"]["engine_queue"]
        b["series"] = burst_series({"records": recs, "samples": []}, k)
        b["series"]["engine_queue"] = queue
    drop_redone_failures(results)
    return results


# ---------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--contenders",
        default="sgl,sgl-tuned,sgl-tuned-x2-part,pdcoord-1,pdcoord-2",
    )
    p.add_argument(
        "--extra-contenders",
        default="sgl-tuned-x2-whole,pdcoord-4,pdcoord-2-nolimit,pdcoord-2-w111,sgl-tuned-x4-part-skew,"
        "pdcoord-4-skew,pdcoord-1-vllm,pdcoord-1-notarget",
        help="run at --extra-loads only",
    )
    p.add_argument("--loads", default="0.5,1,1.5,2,3", help="offered load, multiples of λ*")
    p.add_argument("--extra-loads", default="1.5,2")
    p.add_argument("--burst-contenders", default="sgl,sgl-tuned,pdcoord-1,pdcoord-2")
    p.add_argument("--no-burst", action="store_true")
    p.add_argument("--lambda-star", type=float, default=None, help="engine req/s (default: last measured)")
    p.add_argument("--calibrate", action="store_true", help="measure λ* on sglang-router as shipped first")
    p.add_argument("--duration", type=float, default=60.0, help="engine seconds of offered load per point")
    p.add_argument("--time-scale", type=float, default=1.0, help="engines run this many times slower")
    p.add_argument("--client-timeout", type=float, default=20.0, help="engine seconds a client waits")
    p.add_argument("--target-wait", type=float, default=1.0,
                   help="-wait contenders: pdcoord --admission-target-wait, engine seconds")  # fmt: skip
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument(
        "--workload",
        choices=[*WORKLOADS, "trace"],
        default="conversation",
        help="conversation (the trace; 'trace' is the same), long-prompt (its 10k-30k-token prompts), "
        "overask (max_tokens 4096, the trace's answers ending early), or the load generator's "
        "synthetic multi-turn sessions",
    )
    p.add_argument(
        "--engines",
        choices=list(ENGINE_CONFIGS),
        default="sized",
        help="sized: 8 slots, a decode pool holding the whole batch; default: the 8B profile's own pool "
        "and the engine's own max_running_requests; default-70b: the same for the 70B TP4 profile",
    )
    p.add_argument("--fleet", default="2x2", help="prefill x decode engines (default 2x2)")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=0,
        help="prefill tokens per engine step (pdsim's default 16384 when 0; SGLang's chunked_prefill_size "
        "and vLLM's max_num_batched_tokens default to 8192 on an H100)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every sweep point (the tables and plots show the medians and the range)",
    )
    p.add_argument("--out", default="overload.json")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the sweep points and bursts of --out that this run does not redo",
    )
    p.add_argument(
        "--reanalyse",
        action="store_true",
        help="recompute --out's client-side figures from the runs' kept records, redraw, rewrite",
    )
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.workload == "trace":
        args.workload = "conversation"
    if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", args.fleet):
        p.error("--fleet: PxD, e.g. 2x2")
    configure_engines(args)
    k = args.time_scale
    if args.reanalyse:
        results = reanalyse(RESULTS / args.out)
        results["plots"] = plot(results, Path(args.out).stem)
        print(table(results))
        print(f"wrote {write_json(args.out, results)}")
        return

    specs = [contender_spec(c) for c in args.contenders.split(",") if c]
    extra = [contender_spec(c) for c in args.extra_contenders.split(",") if c]
    sgl_py: str | None = None
    notes: dict[str, Any] = {}
    bursts = [] if args.no_burst else [contender_spec(c) for c in args.burst_contenders.split(",") if c]
    if args.calibrate or any(s["kind"] == "sgl" for s in specs + extra + bursts):
        sgl_py, err = ensure_sglang_router()
        if sgl_py is None:
            notes["sglang_router_install_error"] = err
            specs = [s for s in specs if s["kind"] != "sgl"]
            extra = [s for s in extra if s["kind"] != "sgl"]

    previous: dict[str, Any] = {}
    prev_path = RESULTS / args.out
    if prev_path.exists():
        previous = json.loads(prev_path.read_text())
    lam = (
        args.lambda_star
        or previous.get("lambda_star")
        or (DEFAULT_LAMBDA_STAR if args.engines == "sized" and args.workload == "conversation" else None)
    )
    if lam is None and not args.calibrate:
        p.error("no λ* for this --engines/--workload: give --lambda-star or --calibrate")
    calibration: list[dict[str, Any]] = []
    if args.calibrate and sgl_py is not None:
        # λ*: the highest rate at which the unbounded router keeps 90 % within the SLO.
        lam_found = None
        thr = fleet_throughput(args)

        def attained(frac: float) -> bool:
            rate = round(thr * frac, 2)
            run = run_one(contender_spec("sgl"), args, rate=rate, schedule=None,
                          duration_e=args.duration, tag=f"cal{frac}", sgl_py=sgl_py)  # fmt: skip
            a = analyse(run, k, args.duration)
            calibration.append({"rate": rate, "attainment": a["attainment"], "goodput_rps": a["goodput_rps"]})
            print(f"calibrate rate={rate} attainment={a['attainment']}", flush=True)
            return a["attainment"] is not None and a["attainment"] >= 0.9

        # up from half the estimate while the SLO holds; if it fails there, down until it holds
        grid = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2)
        if attained(grid[0]):
            lam_found = round(thr * grid[0], 2)
            for frac in grid[1:]:
                if not attained(frac):
                    break
                lam_found = round(thr * frac, 2)
        else:
            for frac in (0.4, 0.3, 0.2, 0.1):
                if attained(frac):
                    lam_found = round(thr * frac, 2)
                    break
        if lam_found is not None:
            lam = lam_found
    if lam is None:
        raise SystemExit("--calibrate found no rate within the SLO: give --lambda-star")
    print(
        f"λ* = {lam} req/s (engine time); fleet throughput ≈ {fleet_throughput(args):.2f} (estimated)",
        flush=True,
    )

    sweep: list[dict[str, Any]] = []
    plan = [(s, x) for x in [float(v) for v in args.loads.split(",") if v] for s in specs]
    plan += [(s, x) for x in [float(v) for v in args.extra_loads.split(",") if v] for s in extra]
    # repeats interleave (every point once, then again) so that a drift of the machine spreads evenly
    for rep, (spec, x) in [(i, pt) for i in range(args.repeats) for pt in plan]:
        t0 = time.monotonic()
        try:
            run = run_one(spec, args, rate=lam * x, schedule=None, duration_e=args.duration,
                          tag=f"{spec['name']}-{x}", sgl_py=sgl_py)  # fmt: skip
        except Exception as exc:  # one broken run must not lose the others
            print(f"{spec['name']} @ {x}: FAILED {exc}", flush=True)
            notes.setdefault("failed_runs", []).append(f"{spec['name']}@{x}: {exc}"[:2000])
            continue
        row = {
            "contender": spec["name"],
            "load": x,
            "repeat": rep,
            "rate_rps": round(lam * x, 3),
            **analyse(run, k, args.duration),
        }
        sweep.append(row)
        print(
            f"{spec['name']:>24} @ {x:>4}x goodput={row['goodput_rps']:.2f} att={row['attainment']} "
            f"cont_p99={row['by_class']['continuation']['ttft_p99_s']} "
            f"queue_peak={row['engine_peak_queue']:.0f} "
            f"waited={row['engine_queued_total']:.0f} kv={row['decode_kv_util_mean']} "
            f"retract={row['retractions']:.0f} preempt={row['preemptions']:.0f} "
            f"first_p99={row['by_class']['first_turn']['ttft_p99_s']} ({time.monotonic() - t0:.0f}s)",
            flush=True,
        )
        write_json(
            args.out.replace(".json", ".partial.json"),
            {"partial": True, "lambda_star": lam, "sweep": sweep, "notes": notes},
        )

    burst: dict[str, Any] = {}
    if not args.no_burst:
        t_acc = 0.0
        pieces = []
        for d, mult in BURST:
            pieces.append(f"{t_acc:g}:{t_acc + d:g}:{mult:g}")
            t_acc += d
        schedule = ",".join(pieces)
        for name in [c for c in args.burst_contenders.split(",") if c]:
            spec = contender_spec(name)
            if spec["kind"] == "sgl" and sgl_py is None:
                continue
            try:
                run = run_one(spec, args, rate=lam, schedule=schedule, duration_e=t_acc,
                              tag=f"burst-{name}", sgl_py=sgl_py)  # fmt: skip
            except Exception as exc:
                notes.setdefault("failed_runs", []).append(f"burst {name}: {exc}"[:2000])
                continue
            series = burst_series(run, k)
            burst[name] = {"summary": analyse(run, k, t_acc), "series": series}
            print(
                f"burst {name}: back within SLO after {series['back_within_slo_s']} s "
                f"(admitted: {series['admitted_back_within_slo_s']} s)",
                flush=True,
            )

    if args.merge and previous:
        redone = {(r["contender"], r["load"]) for r in sweep}
        sweep = [r for r in previous.get("sweep", []) if (r["contender"], r["load"]) not in redone] + sweep
        burst = {**{k: v for k, v in previous.get("burst", {}).items() if k not in burst}, **burst}
        for key, value in previous.get("notes", {}).items():
            notes.setdefault(key, value)
        drop_redone_failures({"sweep": sweep, "burst": burst, "notes": notes})
    results = {
        "benchmark": "overload",
        "environment": environment(),
        "sglang_router_version": SGLANG_ROUTER_VERSION if sgl_py else None,
        "config": {
            "profile": PROFILE,
            "engines": args.engines,
            "time_scale": k,
            "prefill": PREFILLS,
            "decode": DECODES,
            "decode_kv_tokens": DECODE_KV_TOKENS or PROFILES[PROFILE].default_max_total_tokens,
            "context_length": CONTEXT_LENGTH or PROFILES[PROFILE].context_length,
            "max_prefill_tokens": args.max_prefill_tokens or 16384,
            "max_input_tokens": MAX_INPUT,
            "slo_ttft_s": SLO_TTFT_S,
            "slo_tpot_s": SLO_TPOT_S,
            "duration_engine_s": args.duration,
            "repeats": args.repeats,
            "client_timeout_engine_s": args.client_timeout,
            "target_wait_engine_s": args.target_wait,
            "burst": BURST,
            "workload": args.workload,
            "trace": str(args.trace.relative_to(BENCH.parent))
            if args.trace.is_relative_to(BENCH.parent)
            else str(args.trace),
            "fleet_decode_throughput_rps": round(fleet_throughput(args), 3),
            "times": "engine time (wall ÷ time_scale)",
        },
        "lambda_star": lam,
        "calibration": calibration or previous.get("calibration", []),
        "sweep": sweep,
        "burst": burst,
        "notes": notes,
    }
    results["plots"] = plot(results, Path(args.out).stem)
    path = write_json(args.out, results)
    print(table(results))
    print()
    print(engine_table(results))
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
