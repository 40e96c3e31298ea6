"""``pdmaster``: an active-active PD master (router) with exact decode admission."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence

from pdcoord.config import (
    EnvArgumentParser,
    add_common_flags,
    add_etcd_flags,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    setup_logging,
)
from pdcoord.keepalive import DEFAULT_KEEPALIVE_S, DEFAULT_KEEPALIVE_TIMEOUT_S
from pdcoord.tls import add_grpc_server_tls_flags
from pdmaster.admission_controller import add_admission_flags
from pdmaster.engine_priority import ORDERS


def _api_key(text: str) -> str:
    key = text.strip()
    if not key:
        raise argparse.ArgumentTypeError("an API key must not be empty")
    return key


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="pdmaster", description=__doc__, env_prefix="PDMASTER")
    g = add_etcd_flags(p)
    g.add_argument("--master-id", required=True, help="unique id of this master (e.g. the pod name)")
    g.add_argument(
        "--drain-timeout",
        type=positive_float,
        default=10.0,
        help="seconds to wait for in-flight requests on SIGTERM before revoking the lease",
    )
    g.add_argument(
        "--shutdown-linger",
        type=float,
        default=1.0,
        help="seconds to keep answering 503 'draining' after the lease is revoked, before closing",
    )
    g = p.add_argument_group("listeners")
    g.add_argument("--http-host", default="0.0.0.0", help="HTTP API listen address")
    g.add_argument("--http-port", type=port, default=8000, help="HTTP API port (0 = any free port)")
    g.add_argument("--grpc-host", default="0.0.0.0", help="gRPC NodeCoordination listen address")
    g.add_argument("--grpc-port", type=port, default=50051, help="gRPC port (0 = any free port)")
    g.add_argument(
        "--advertise-host",
        default=None,
        help="address agents and clients use to reach this master, put into its etcd key (default: "
        "--grpc-host / --http-host; for a wildcard one, the address of this host's default-route "
        "interface, else its host name's; a master that finds none refuses to start)",
    )
    g.add_argument(
        "--admin-host",
        default=None,
        help="serve /metrics and /admission on this address instead of the HTTP API port",
    )
    g.add_argument(
        "--admin-port",
        type=port,
        default=None,
        help="admin listener port (/metrics, /admission); when set they leave the public port",
    )
    g.add_argument(
        "--keepalive",
        type=positive_float,
        default=DEFAULT_KEEPALIVE_S,
        help="seconds without a message on an agent's stream before this master pings it: how fast a "
        "silently cut agent is noticed, against CPU (pings are most of an idle master's work). The "
        "master advertises --keepalive + --keepalive-timeout in etcd and its agents let strict handover "
        "wait that long; agents of releases that do not read it allow 1.65 s, so until they are "
        "upgraded run 0.65",
    )
    g.add_argument(
        "--keepalive-timeout",
        type=positive_float,
        default=DEFAULT_KEEPALIVE_TIMEOUT_S,
        help="seconds an agent has to answer a ping before its stream is closed",
    )
    add_grpc_server_tls_flags(p)
    g = p.add_argument_group("HTTP API authentication")
    g.add_argument(
        "--api-key",
        type=_api_key,
        action="append",
        default=[],
        secret=True,
        help="accept 'Authorization: Bearer <key>' with this key (repeatable); no keys = open API. "
        "The environment variable may hold several keys separated by commas",
    )
    g.add_argument(
        "--api-keys-file", default=None, help="file with one API key per line (blank lines and # ignored)"
    )
    g = p.add_argument_group("limits")
    g.add_argument(
        "--max-node-capacity",
        type=positive_int,
        default=4096,
        help="refuse agents whose running_max_req_size is above this",
    )
    g.add_argument("--max-nodes", type=positive_int, default=10_000, help="most nodes this master tracks")
    g.add_argument(
        "--max-reports-per-s",
        type=positive_float,
        default=50.0,
        help="refuse an agent stream that sends more reports per second",
    )
    g.add_argument(
        "--max-body-bytes", type=positive_int, default=4 * 1024 * 1024, help="largest request body"
    )
    g.add_argument(
        "--max-header-bytes",
        type=positive_int,
        default=8190,
        help="longest HTTP request line and header field",
    )
    g.add_argument("--max-headers", type=positive_int, default=128, help="most HTTP request header fields")
    g.add_argument(
        "--max-start-args",
        type=positive_int,
        default=64,
        help="most start_args entries an agent may register",
    )
    g.add_argument(
        "--max-start-arg-bytes",
        type=positive_int,
        default=1024,
        help="longest start_args key or value an agent may register",
    )
    g.add_argument("--max-n", type=positive_int, default=16, help="largest n (choices) per request")
    g.add_argument("--max-tokens", type=positive_int, default=32768, help="largest max_tokens per request")
    g.add_argument(
        "--max-batch", type=positive_int, default=64, help="most prompts in one batch (a list of prompts)"
    )
    g = p.add_argument_group("data plane")
    g.add_argument(
        "--engine-protocol",
        choices=["sglang", "vllm"],
        default="sglang",
        help="PD protocol spoken to the prefill/decode servers",
    )
    g.add_argument(
        "--prefill-selection",
        choices=["earliest-first-token", "cache-aware", "round-robin"],
        default="earliest-first-token",
        help="how the prefill node is chosen: earliest-first-token (default) takes the node with the "
        "fewest prompt tokens to compute before the request's last one (its backlog, this master's and "
        "what its engine reports, plus the prompt's part its cache does not hold); cache-aware, the "
        "longest cached prefix unless that node has many more requests in flight; round-robin is for "
        "comparison",
    )
    g.add_argument(
        "--engine-priority",
        choices=list(ORDERS),
        default=None,
        help="send each request's admission class to the engines as its 'priority' (continuations "
        "first) for engines that schedule by priority: high-first for SGLang's "
        "--enable-priority-scheduling, low-first for vLLM's --scheduling-policy priority (or SGLang "
        "with --schedule-low-priority-values-first); auto: only to engines whose agent says they do "
        "(start argument priority_scheduling); off leaves the client's body as is (default: auto with "
        "--ttft-slo, else off)",
    )
    g.add_argument(
        "--ttft-slo",
        type=non_negative_float,
        default=0.0,
        metavar="SECONDS",
        help="the time-to-first-token SLO the fleet is run for (0: none, the default). Sets what is not "
        "set explicitly: --admission-target-wait at 0.75x / 0.9x / 0.9x of it for continuation / "
        "probable cache hit / cold, counting each request's prefill (--admission-target-includes-"
        "prefill), --engine-priority auto, and --spill-peers 3",
    )
    g.add_argument(
        "--kv-reserve-tokens",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="KV tokens a decode engine keeps free per active sequence on top of its KV, charged to "
        "every lease where the node has a KV pool (default: 512 with --engine-protocol sglang, "
        "SGLang's SGLANG_NUM_RESERVED_DECODE_TOKENS; 0 with vllm)",
    )
    g.add_argument(
        "--chars-per-token",
        type=positive_float,
        default=3.0,
        help="characters per token of text prompts for their KV charge until the engines' own counts "
        "are seen (low is safe: a prompt is charged more than it holds)",
    )
    g.add_argument("--model", default=None, help="model name served; requests naming another get 404")
    g.add_argument(
        "--event-loop",
        choices=["auto", "uvloop", "asyncio"],
        default="auto",
        help="event loop implementation; auto = uvloop when installed (it cuts the proxy's CPU per request)",
    )
    g = p.add_argument_group("engine faults")
    g.add_argument(
        "--breaker-failures",
        type=positive_int,
        default=3,
        help="failed exchanges in a row (refused/reset connection, timeout, 5xx before the first byte) "
        "that open an engine's circuit breaker: its node then takes no new leases",
    )
    g.add_argument(
        "--breaker-backoff",
        type=positive_float,
        default=1.0,
        help="seconds an open breaker waits before one trial request; doubled after each failed trial",
    )
    g.add_argument(
        "--breaker-backoff-max", type=positive_float, default=30.0, help="cap of the breaker's backoff"
    )
    g.add_argument(
        "--max-retries",
        type=non_negative_int,
        default=1,
        help="times a request whose prefill or decode failed before any byte reached the client is "
        "tried again on another pair (response header X-Retries when it was)",
    )
    g.add_argument(
        "--spill-peers",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="a request this master refuses at once for its expected wait (429 expected_wait, nothing "
        "done for it yet) is sent to up to N other masters from etcd in random order, marked so that "
        "none passes it on again; the first that takes it answers the client (default 0: off, 3 with "
        "--ttft-slo; pdmaster/spill.py)",
    )
    g.add_argument(
        "--engine-connect-timeout",
        type=positive_float,
        default=5.0,
        help="seconds to open a connection to an engine",
    )
    g.add_argument(
        "--engine-first-byte-timeout",
        type=positive_float,
        default=300.0,
        help="seconds from sending a request until an engine's first response byte (a long prompt "
        "prefills slowly); then 504",
    )
    g.add_argument(
        "--engine-idle-timeout",
        type=positive_float,
        default=120.0,
        help="longest gap between two chunks of an engine's response; a stalled stream ends with an "
        "SSE error event (504 before the first byte)",
    )
    add_admission_flags(p)
    add_common_flags(p)
    return p


def _loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            print("pdmaster: error: --event-loop uvloop: uvloop is not installed", file=sys.stderr)
            sys.exit(2)
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, f"pdmaster[{args.master_id}]")
    from pdcoord.etcd import EtcdError
    from pdcoord.tls import TLSConfigError
    from pdmaster.config import ConfigError, MasterConfig
    from pdmaster.server import MasterServer, StartupError

    try:
        server = MasterServer(MasterConfig.from_args(args))
        with asyncio.Runner(loop_factory=_loop_factory(args.event_loop)) as runner:
            runner.run(server.serve_forever())
    except (StartupError, ConfigError, TLSConfigError) as exc:
        print(f"pdmaster: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except EtcdError as exc:
        print(f"pdmaster: error: etcd: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
