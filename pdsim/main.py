"""``pdsim``: run one simulated prefill or decode server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from pdcoord.config import (
    EnvArgumentParser,
    add_common_flags,
    non_negative_int,
    parse,
    port,
    positive_float,
    positive_int,
    setup_logging,
)
from pdsim.faults import Faults
from pdsim.profiles import PROFILES, engine_default_max_running, vllm_pool_tokens
from pdsim.server import Config, Engine, ModelMode, Timing, build_admin_app, build_app, build_bootstrap_app

log = logging.getLogger("pdsim")

# (realistic-but-small default, --fast value) per timing flag.
TIMING_PRESETS: dict[str, tuple[float, float]] = {
    "prefill_base_ms": (20.0, 1.0),
    "prefill_per_token_ms": (0.05, 0.01),
    "decode_base_ms": (15.0, 2.0),
    "decode_per_seq_ms": (0.25, 0.01),
}


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def status_5xx(text: str) -> int:
    value = int(text)
    if not 500 <= value <= 599:
        raise argparse.ArgumentTypeError(f"must be a 5xx status, got {text}")
    return value


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="pdsim", env_prefix="PDSIM", description=__doc__)
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--host", default="127.0.0.1", help="listen address")
    p.add_argument("--port", type=port, default=30000, help="HTTP port (0 = pick a free one)")
    p.add_argument(
        "--bootstrap-port",
        type=port,
        default=None,
        help="KV bootstrap listener port; default port+1000 on prefill (free port if --port 0), "
        "off on decode; 0 disables it",
    )
    p.add_argument("--advertise-host", default=None, help="host put into kv_transfer_params (default --host)")
    p.add_argument(
        "--running-max-req-size",
        type=non_negative_int,
        default=None,
        help="decode batch size in slots (SGLang --max-running-requests, vLLM --max-num-seqs); with "
        "--profile, 0 or absent = the engine's own default for the profile's pool",
    )
    p.add_argument("--model", default="pdsim-model", help="served model name")
    p.add_argument(
        "--context-length",
        type=positive_int,
        default=None,
        help="longest prompt + max tokens (default 32768; with --profile, the model's own)",
    )
    p.add_argument("--max-n", type=positive_int, default=64, help="largest n accepted")
    p.add_argument("--default-max-tokens", type=non_negative_int, default=16)
    p.add_argument(
        "--max-total-tokens",
        type=positive_int,
        default=None,
        help="KV pool size in tokens (default N x the context length; with --profile, the profile's pool; "
        "--api vllm rounds it down to whole blocks of 16)",
    )
    p.add_argument(
        "--cache-blocks", type=non_negative_int, default=8192, help="prefix cache capacity in blocks"
    )
    p.add_argument("--cache-block-tokens", type=positive_int, default=16, help="prefix cache block size")
    p.add_argument("--prefill-parallel", type=positive_int, default=1, help="prefills computed at once")
    p.add_argument(
        "--kv-wait-timeout", type=positive_float, default=30.0, help="decode waits this long for KV (s)"
    )
    p.add_argument(
        "--kv-ttl", type=positive_float, default=60.0, help="unclaimed KV rooms are dropped after (s)"
    )
    p.add_argument("--max-body-bytes", type=positive_int, default=16 * 1024 * 1024)
    for name, (default, fast) in TIMING_PRESETS.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=non_negative_float, default=None, help=f"default {default}, --fast {fast}")
    p.add_argument(
        "--fast", action="store_true", help="tiny timings for tests (explicit timing flags still win)"
    )
    p.add_argument(
        "--api",
        choices=["both", "sglang", "vllm"],
        default="both",
        help="which engine's HTTP API and request checks to mirror (both = lenient, either shape)",
    )
    p.add_argument(
        "--sglang-sample-rooms",
        choices=["accept", "reject"],
        default="accept",
        help="--api sglang, n > 1 with bootstrap rooms: serve a list of one room per sample, or "
        "refuse it as real SGLang cannot serve it (it reuses the prompt's first room for every sample)",
    )
    p.add_argument(
        "--admin-port",
        type=port,
        default=None,
        help="separate listener for /admin/* (0 = a free port); needed for the refuse fault at run time",
    )
    p.add_argument(
        "--disable-metrics", action="store_true", help="no /metrics (like SGLang without --enable-metrics)"
    )
    p.add_argument(
        "--health-timeout",
        type=positive_float,
        default=20.0,
        help="seconds /health waits for a generation before 503 (SGLang's SGLANG_HEALTH_CHECK_TIMEOUT)",
    )
    p.add_argument(
        "--request-log-size", type=non_negative_int, default=1000, help="requests kept for /admin/requests"
    )
    m = p.add_argument_group("model mode (a continuous-batch engine model; see README)")
    m.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=None,
        help="engine profile: step times, KV size and pool of a model on given GPUs; turns model mode on",
    )
    m.add_argument(
        "--time-scale",
        type=positive_float,
        default=None,
        help="wall seconds per engine second (default 1); results are in engine time = wall / K",
    )
    m.add_argument(
        "--max-prefill-tokens",
        type=positive_int,
        default=None,
        help="prefill tokens per step (default 16384)",
    )
    m.add_argument(
        "--max-queued-requests",
        type=positive_int,
        default=None,
        help="waiting requests beyond which arrivals get 503 (default unbounded)",
    )
    m.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        default=None,
        help="serve waiting requests by their 'priority' field, then arrival (SGLang's flag; under "
        "--api vllm its --scheduling-policy priority, with --schedule-low-priority-values-first)",
    )
    m.add_argument(
        "--schedule-low-priority-values-first",
        action="store_true",
        default=None,
        help="with --enable-priority-scheduling: lower values first (vLLM's order; SGLang's default "
        "is higher first)",
    )
    m.add_argument(
        "--kv-bandwidth-gbps",
        type=positive_float,
        default=None,
        help="PD KV transfer bandwidth in GB/s (default the profile's, 25)",
    )
    f = p.add_argument_group("faults (also settable at run time through /admin/faults)")
    f.add_argument("--fault-refuse", action="store_true", help="the main port accepts no connections")
    f.add_argument(
        "--fault-error-rate", type=fraction, default=0.0, help="fraction of generation requests failed"
    )
    f.add_argument("--fault-error-status", type=status_5xx, default=503, help="status of a failed request")
    f.add_argument("--fault-seed", type=int, default=0, help="seed of the error draw (reproducible)")
    f.add_argument("--fault-hang", action="store_true", help="accept generation requests, never answer")
    f.add_argument(
        "--fault-hang-after-chunks",
        type=non_negative_int,
        default=None,
        help="stop a response after this many tokens, keeping the connection open",
    )
    f.add_argument("--fault-slow", type=positive_float, default=1.0, help="multiplier on the timing model")
    f.add_argument("--fault-health-fail", action="store_true", help="/health answers 503")
    add_common_flags(p)
    return p


MODEL_FLAGS = (
    "time_scale",
    "max_prefill_tokens",
    "max_queued_requests",
    "kv_bandwidth_gbps",
    "enable_priority_scheduling",
    "schedule_low_priority_values_first",
)


def model_mode_from_args(args: argparse.Namespace) -> ModelMode | None:
    """Model mode's settings, or None without ``--profile`` (raises ValueError for a model-only flag)."""
    if args.profile is None:
        given = [f"--{n.replace('_', '-')}" for n in MODEL_FLAGS if getattr(args, n) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: model-mode flag(s), need --profile")
        return None
    if args.schedule_low_priority_values_first and not args.enable_priority_scheduling:
        raise ValueError("--schedule-low-priority-values-first needs --enable-priority-scheduling")
    profile = PROFILES[args.profile]
    return ModelMode(
        profile=profile,
        time_scale=args.time_scale if args.time_scale is not None else 1.0,
        max_prefill_tokens=args.max_prefill_tokens or 16384,
        max_queued_requests=args.max_queued_requests,
        kv_bandwidth_gbps=args.kv_bandwidth_gbps or profile.kv_bandwidth_gbps,
        priority_scheduling=bool(args.enable_priority_scheduling),
        low_priority_first=bool(args.schedule_low_priority_values_first),
    )


@dataclass(frozen=True, slots=True)
class Sizes:
    running_max_req_size: int
    max_total_tokens: int
    context_length: int


def sizes_from_args(args: argparse.Namespace, model_mode: ModelMode | None) -> Sizes:
    """The batch cap, the KV pool and the context: as given, else as the engine sizes them (model
    mode: the profile's pool, the engine's own max_running_requests; raises ValueError without a
    profile and without a batch cap)."""
    if model_mode is None:
        if not args.running_max_req_size:
            raise ValueError("--running-max-req-size is required (>= 1) without --profile")
        cap = args.running_max_req_size
        context = args.context_length or 32768
        # Timer mode models no KV pool of its own: by default it publishes one that holds every slot
        # at the full context, so that a master's token charges never bind there unless a test asks.
        return Sizes(cap, args.max_total_tokens or cap * context, context)
    profile = model_mode.profile
    pool = args.max_total_tokens or profile.default_max_total_tokens
    if args.api == "vllm":
        pool = vllm_pool_tokens(pool)  # num_gpu_blocks x block_size
    if pool <= 0:
        raise ValueError("--max-total-tokens: the pool holds no whole block")
    context = args.context_length or profile.context_length
    policy = "vllm" if args.api == "vllm" else "sglang"
    cap = args.running_max_req_size or engine_default_max_running(policy, profile, pool, context)
    return Sizes(cap, pool, context)


def timing_from_args(args: argparse.Namespace) -> Timing:
    values = {}
    for name, (default, fast) in TIMING_PRESETS.items():
        given = getattr(args, name)
        values[name] = given if given is not None else (fast if args.fast else default)
    return Timing(**values)


async def serve(args: argparse.Namespace) -> None:
    host = args.host
    model_mode = model_mode_from_args(args)
    sizes = sizes_from_args(args, model_mode)
    cfg = Config(
        role=args.role,
        host=host,
        advertise_host=args.advertise_host or ("127.0.0.1" if host in ("0.0.0.0", "", "::") else host),
        model=args.model,
        running_max_req_size=sizes.running_max_req_size,
        max_n=args.max_n,
        context_length=sizes.context_length,
        default_max_tokens=args.default_max_tokens,
        max_total_tokens=sizes.max_total_tokens,
        cache_blocks=args.cache_blocks,
        cache_block_tokens=args.cache_block_tokens,
        prefill_parallel=args.prefill_parallel,
        kv_wait_timeout_s=args.kv_wait_timeout,
        kv_ttl_s=args.kv_ttl,
        max_body_bytes=args.max_body_bytes,
        timing=timing_from_args(args),
        flavor=args.api,
        metrics=not args.disable_metrics,
        health_timeout_s=args.health_timeout,
        request_log_size=args.request_log_size,
        sglang_sample_rooms=args.sglang_sample_rooms == "accept",
        faults=faults_from_args(args),
        model_mode=model_mode,
    )
    engine = Engine(cfg)
    await engine.start()
    runners: list[web.AppRunner] = []
    try:
        bport = resolve_bootstrap_port(args.role, args.port, args.bootstrap_port)
        if bport is not None:
            brunner = web.AppRunner(
                build_bootstrap_app(engine), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
            )
            await brunner.setup()
            bsite = web.TCPSite(brunner, host, bport)
            await bsite.start()
            runners.append(brunner)
            engine.bootstrap_port = _bound_port(brunner)
        # handler_cancellation: a client that disconnects cancels its handler at once, which
        # frees its decode slot (aiohttp >= 3.9 no longer does this by default).
        # A short shutdown_timeout: in-flight streams are cut after a second on SIGTERM.
        runner = web.AppRunner(
            build_app(engine), handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await runner.setup()
        runners.append(runner)
        main_site = MainSite(runner, host)
        bound = await main_site.open(args.port)
        engine.listener_control = main_site.set_open
        if args.admin_port is not None:
            arunner = web.AppRunner(build_admin_app(engine), access_log=None, shutdown_timeout=1.0)
            await arunner.setup()
            runners.append(arunner)
            await web.TCPSite(arunner, host, args.admin_port).start()
            engine.admin_port = _bound_port(arunner)
        await engine.apply_listener()  # --fault-refuse: close the main port right away
        t = cfg.timing
        if model_mode is not None:
            pr = model_mode.profile
            log.info(
                "role=%s capacity=%d model mode: profile %s, step %.4g ms + %.4g us/prefill token + "
                "%.4g us/decode seq, KV pool %d tokens, time scale %g",
                cfg.role,
                cfg.running_max_req_size,
                pr.name,
                pr.step_base_s * 1e3,
                pr.per_prefill_token_s * 1e6,
                pr.per_decode_seq_s * 1e6,
                cfg.max_total_tokens,
                model_mode.time_scale,
            )
        else:
            log.info(
                "role=%s capacity=%d prefill %.3g ms + %.3g ms/token, decode %.3g ms + %.3g ms/seq per token",
                cfg.role,
                cfg.running_max_req_size,
                t.prefill_base_ms,
                t.prefill_per_token_ms,
                t.decode_base_ms,
                t.decode_per_seq_ms,
            )
        print(
            f"pdsim ready role={cfg.role} port={bound} bootstrap_port={engine.bootstrap_port} "
            f"admin_port={engine.admin_port}",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down")
        # As SGLang does once it is asked to exit: /health answers 503 while streams drain.
        engine.shutting_down = True
    finally:
        for r in reversed(runners):
            await r.cleanup()
        await engine.close()


def faults_from_args(args: argparse.Namespace) -> Faults:
    return Faults(
        refuse=args.fault_refuse,
        error_rate=args.fault_error_rate,
        error_status=args.fault_error_status,
        seed=args.fault_seed,
        hang=args.fault_hang,
        hang_after_chunks=args.fault_hang_after_chunks,
        slow=args.fault_slow,
        health_fail=args.fault_health_fail,
    )


class MainSite:
    """The main HTTP listener, which the refuse fault closes and reopens on the same port.

    Closing stops accepting and closes idle keep-alive connections (a client's pool would otherwise
    keep reaching the "dead" engine); a request in flight finishes, then its connection closes.
    """

    def __init__(self, runner: web.AppRunner, host: str) -> None:
        self.runner, self.host = runner, host
        self.port = 0
        self.site: web.TCPSite | None = None

    async def open(self, port: int) -> int:
        site = web.TCPSite(self.runner, self.host, port)
        await site.start()
        self.site = site
        if not self.port:
            self.port = _bound_port(self.runner)  # the only site of its runner
        return self.port

    async def set_open(self, want: bool) -> None:
        if want and self.site is None:
            await self.open(self.port)
        elif not want and self.site is not None:
            await self.site.stop()
            self.site = None
            server = self.runner.server
            for handler in server.connections if server is not None else []:
                handler.close()


def resolve_bootstrap_port(role: str, main_port: int, given: int | None) -> int | None:
    """The port to bind the KV bootstrap listener on (0 = any free port), or None for no listener."""
    if given is not None:
        return given or None  # an explicit 0 disables it
    if role != "prefill":
        return None
    if main_port == 0 or main_port + 1000 > 65535:
        return 0
    return main_port + 1000


def _bound_port(runner: web.AppRunner) -> int:
    addrs = runner.addresses
    return int(addrs[0][1]) if addrs else 0


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parse(parser, argv)
    try:
        sizes_from_args(args, model_mode_from_args(args))
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(args.log_level, "pdsim")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args))


if __name__ == "__main__":
    main()
