"""``nodeagent``: runs beside one prefill/decode server and hands its capacity to the live masters."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import aiohttp

from pdcoord.config import (
    EnvArgumentParser,
    EtcdSettings,
    add_common_flags,
    add_etcd_flags,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    setup_logging,
)
from pdcoord.tls import TLSConfigError, add_grpc_client_tls_flags, client_tls_from_args

if TYPE_CHECKING:
    from nodeagent.probe import EngineInfo


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="nodeagent", description=__doc__, env_prefix="NODEAGENT")
    g = add_etcd_flags(p)
    g.add_argument("--node-id", required=True, help="unique id of this node (e.g. the pod name)")
    g.add_argument(
        "--register-wait",
        type=positive_float,
        default=15.0,
        help="how long to retry while another live agent holds this node id, before giving up",
    )
    g = p.add_argument_group("engine")
    g.add_argument("--role", required=True, choices=["prefill", "decode"], help="role of the engine")
    g.add_argument("--endpoint", required=True, help="engine data-plane base URL, e.g. http://10.0.0.7:30000")
    g.add_argument(
        "--running-max-req-size",
        type=positive_int,
        default=None,
        help="engine concurrent request limit (default: max_running_requests from GET /get_server_info)",
    )
    g.add_argument(
        "--kv-tokens",
        type=non_negative_int,
        default=0,
        help="the decode engine's KV pool in tokens, the node's second capacity next to its slots "
        "(default 0: read it from the engine: SGLang's max_total_num_tokens, vLLM's num_gpu_blocks x "
        "block_size; an engine that publishes none runs on slots alone); set below what runs, the "
        "masters' token shares shrink at once and grow back only as their leases end",
    )
    g.add_argument("--bootstrap-port", type=port, default=None, help="SGLang disaggregation bootstrap port")
    g.add_argument("--model", default=None, help="model name the engine serves")
    g.add_argument(
        "--start-arg",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra engine start argument passed to masters (repeatable)",
    )
    g.add_argument(
        "--metrics-url",
        default=None,
        help="where to read the engine's load "
        "(default: <endpoint>/metrics, then SGLang's /v1/loads, /get_load)",
    )
    g.add_argument("--no-load-probe", action="store_true", help="do not read the engine's load")
    g.add_argument(
        "--health-interval",
        type=positive_float,
        default=0.5,
        help="seconds between liveness checks of the engine (GET <endpoint>/health)",
    )
    g.add_argument(
        "--health-timeout",
        type=positive_float,
        default=3.0,
        help="seconds a liveness check may take: SGLang's /health runs a one-token generation and "
        "answers after at least 1 s (20 s before a 503 when its scheduler hangs); a refused "
        "connection fails at once",
    )
    g.add_argument(
        "--health-failures",
        type=positive_int,
        default=3,
        help="failed liveness checks in a row that mark the engine down (no new leases on this node)",
    )
    g.add_argument(
        "--health-successes",
        type=positive_int,
        default=2,
        help="passed liveness checks in a row that mark a down engine up again",
    )
    g.add_argument(
        "--no-health-check",
        action="store_true",
        help="do not check the engine's liveness (it then always counts as up)",
    )
    g = p.add_argument_group("protocol")
    g.add_argument(
        "--report-interval",
        type=positive_float,
        default=30.0,
        help="heartbeat: seconds between reports when nothing changes (a grant change is reported at "
        "once; a dead stream is noticed by gRPC keep-alive)",
    )
    g.add_argument(
        "--load-report-interval",
        type=positive_float,
        default=2.0,
        help="a change of the engine's load is reported at most this often",
    )
    g.add_argument(
        "--probe-interval",
        type=positive_float,
        default=2.0,
        help="seconds between engine load probes (0.25 s while a handover waits for the engine)",
    )
    g.add_argument(
        "--grace",
        type=positive_float,
        default=1.0,
        help="seconds a master's stream may be down before its share moves to the others (a master "
        "whose address refuses connections leaves at once)",
    )
    g.add_argument(
        "--no-gone-on-refusal",
        action="store_true",
        help="do not take a master whose address refuses connections for a dead process: for networks "
        "whose firewalls reject (not drop) traffic between agents and live masters, where a live master "
        "could still place work on slots handed on; a refusal then counts only once the master's etcd "
        "key has expired too, so a killed master's share moves after the lease TTL, not at once",
    )
    g = p.add_argument_group("shares")
    g.add_argument(
        "--handover",
        choices=["strict", "fast"],
        default="strict",
        help="strict: a master's share grows only by slots the others acknowledged as free, so the "
        "masters never oversubscribe the engine while shares move; fast: shares move at once and old "
        "leases overlap new shares until they drain",
    )
    g.add_argument(
        "--share-policy",
        choices=["static", "demand"],
        default="demand",
        help="demand (default): follow what masters run and queue (active + wanted slots), max-min fair "
        "with a floor, hysteresis and a bounded step; an idle node splits evenly and a master that joins "
        "counts as wanting its even share for 5 s; static: always an even split among live masters",
    )
    g.add_argument(
        "--share-floor",
        type=non_negative_int,
        default=1,
        help="demand policy: slots a live master keeps whatever its demand, for masters that do not "
        "say (earlier releases); a master of this release asks for one slot on one decode node (its "
        "anchor) and none elsewhere",
    )
    g.add_argument(
        "--rebalance-interval",
        type=positive_float,
        default=1.0,
        help="demand policy: seconds between re-evaluations of the split",
    )
    g.add_argument(
        "--rebalance-hysteresis",
        type=positive_int,
        default=2,
        help="demand policy: ignore changes smaller than this many slots for every master",
    )
    g.add_argument(
        "--rebalance-max-step",
        type=_fraction,
        default=0.25,
        help="demand policy: largest move per re-evaluation, as a fraction of the node's capacity",
    )
    g.add_argument(
        "--orphan-timeout",
        type=positive_float,
        default=30.0,
        help="strict handover: seconds after which a departed master's slots are freed even when "
        "the engine probe cannot confirm its leases ended",
    )
    g = p.add_argument_group("compatibility")
    g.add_argument(
        "--no-grant",
        action="store_true",
        help="behave like an older agent that sends no grant (compatibility testing)",
    )
    g.add_argument("--health-host", default="0.0.0.0", help="agent health listener address")
    g.add_argument(
        "--health-port",
        type=non_negative_int,
        default=0,
        help="serve GET /health and /status on this port (0 = off)",
    )
    add_grpc_client_tls_flags(p)
    add_common_flags(p)
    return p


async def _discover(endpoint: str) -> EngineInfo:
    """The engine's settings; waits (capped, jittered backoff) while it does not answer: in a pod the
    agent usually starts long before its engine has loaded the model."""
    from nodeagent.probe import EngineUnreachable, discover_engine
    from pdcoord.retry import Backoff

    backoff, said = Backoff(initial=0.5), False
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                return await discover_engine(endpoint, session)
            except EngineUnreachable as exc:
                if not said:
                    print(f"nodeagent: waiting for the engine: {exc}", file=sys.stderr, flush=True)
                    said = True
            await asyncio.sleep(backoff.next())


async def _run(args: argparse.Namespace) -> int:
    from nodeagent.agent import AgentConfig, NodeAgent, StartupError
    from nodeagent.probe import load_signal_urls
    from nodeagent.slicing import SharePolicy
    from pdcoord.etcd import EtcdError
    from pdcoord.registration import AlreadyRegistered

    try:
        grpc_tls = client_tls_from_args(args)
        etcd = EtcdSettings.from_args(args)
    except TLSConfigError as exc:
        print(f"nodeagent: error: {exc}", file=sys.stderr)
        return 2
    capacity, bootstrap_port, model = args.running_max_req_size, args.bootstrap_port, args.model
    kv_tokens: int | None = args.kv_tokens or None
    priority: str | None = None  # the engine's priority order, when it is asked
    # The model is only informative: the engine is asked for it when it is asked anyway.
    if capacity is None or (args.role == "prefill" and bootstrap_port is None):
        try:
            info = await _discover(args.endpoint)
        except asyncio.CancelledError:
            return 0
        if capacity is None:
            capacity = info.max_running_requests
            if capacity is None:
                print(
                    f"nodeagent: error: --running-max-req-size not given and the engine at {args.endpoint} "
                    "does not publish max_running_requests (vLLM does not); pass --running-max-req-size",
                    file=sys.stderr,
                )
                return 2
        if bootstrap_port is None and args.role == "prefill" and info.flavour == "sglang":
            bootstrap_port = info.bootstrap_port
            if bootstrap_port is None:
                # Without it every request would fail at the masters: refuse to start instead.
                print(
                    f"nodeagent: error: --bootstrap-port not given and the SGLang prefill engine at "
                    f"{args.endpoint} reports no disaggregation_bootstrap_port (is it running with "
                    "--disaggregation-mode prefill?); pass --bootstrap-port",
                    file=sys.stderr,
                )
                return 2
        model = model or info.model
        kv_tokens = kv_tokens or info.kv_tokens
        priority = info.priority_scheduling
    start_args = dict(args.start_arg)
    if priority is not None:
        # masters with --engine-priority auto send this engine a priority (a --start-arg wins)
        start_args.setdefault("priority_scheduling", priority)
    if bootstrap_port is not None:
        start_args["bootstrap_port"] = str(bootstrap_port)
    if model:
        start_args["model"] = model
    cfg = AgentConfig(
        etcd=etcd,
        node_id=args.node_id,
        role=args.role,
        endpoint=args.endpoint.rstrip("/"),
        running_max_req_size=capacity,
        kv_tokens=kv_tokens,
        # --kv-tokens wins over what the engine says; without it the engine is asked (again, if it
        # published none at start) and a pool it publishes later or changes is followed
        discover_kv_tokens=not args.kv_tokens,
        start_args=start_args,
        report_interval=args.report_interval,
        load_report_interval=args.load_report_interval,
        probe_interval=args.probe_interval,
        register_wait=args.register_wait,
        load_urls=()
        if args.no_load_probe
        else ((args.metrics_url,) if args.metrics_url else load_signal_urls(args.endpoint)),
        health_check=not args.no_health_check,
        gone_on_refusal=not args.no_gone_on_refusal,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        health_failures=args.health_failures,
        health_successes=args.health_successes,
        health_host=args.health_host,
        health_port=args.health_port or None,
        send_grant=not args.no_grant,
        shares=SharePolicy(
            policy=args.share_policy,
            handover=args.handover,
            grace=args.grace,
            floor=args.share_floor,
            rebalance_interval=args.rebalance_interval,
            rebalance_hysteresis=args.rebalance_hysteresis,
            rebalance_max_step=args.rebalance_max_step,
            orphan_timeout=args.orphan_timeout,
        ),
        grpc_tls=grpc_tls,
    )
    agent = NodeAgent(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # etcd may be unreachable for a long time at start-up (the agent retries): a stop request
    # must still end the process promptly.
    starting = asyncio.create_task(agent.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        stopping.cancel()
        await agent.stop()
        return 0
    stopping.cancel()
    try:
        starting.result()
    except AlreadyRegistered as exc:
        print(
            f"nodeagent: error: --node-id {args.node_id!r} is held by another live agent "
            f"and its lease did not expire within --register-wait {args.register_wait:g}s ({exc})",
            file=sys.stderr,
        )
        await agent.stop()
        return 2
    except StartupError as exc:
        print(f"nodeagent: error: {exc}", file=sys.stderr)
        await agent.stop()
        return 2
    except EtcdError as exc:  # only configuration errors (TLS, credentials) get here: retrying cannot help
        print(f"nodeagent: error: etcd: {exc}", file=sys.stderr)
        await agent.stop()
        return 2
    await stop.wait()
    await agent.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, f"nodeagent[{args.node_id}]")
    try:
        sys.exit(asyncio.run(_run(args)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
