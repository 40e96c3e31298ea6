"""Many real node agents in one asyncio process, for the fleet benchmark.

Each node is a full ``nodeagent.agent.NodeAgent``: its own etcd client, registration and lease,
masters watch, one gRPC channel and stream per master, load probe. Only the process is shared (a
thousand Python processes do not fit on a bench machine). A tiny HTTP responder in the same process
stands in for the engines: ``GET /n/<node_id>/metrics`` answers an idle SGLang engine's load.

Nodes ``--first`` .. ``--first + --count - 1`` of the fleet; the role and capacity of node i come
from :func:`node_spec`, so the benchmark knows them without asking. Prints one JSON line when every
agent has started (``{"started": n, "seconds": s}``), runs until SIGTERM, then stops the agents
gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import hashlib
import json
import logging
import signal
import time
from pathlib import Path

import nodeagent.agent as agent_mod
import pdcoord.etcd as etcd_mod
from nodeagent.agent import AgentConfig, NodeAgent
from nodeagent.slicing import SharePolicy
from pdcoord.config import EtcdSettings
from pdcoord.gctuning import tune_gc

IDLE_METRICS = "sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\nsglang:token_usage 0.0\n"


def node_spec(i: int) -> tuple[str, str, int]:
    """(node_id, role, running_max_req_size) of fleet node i: 1 prefill in 4; decode 32-256 slots."""
    digest = hashlib.sha256(f"node-{i}".encode()).digest()
    if i % 4 == 0:
        return f"p{i:05d}", "prefill", 256
    return f"d{i:05d}", "decode", 32 * (1 + digest[0] % 8)


class _EngineStandIn(asyncio.Protocol):
    """An idle engine for every node of the process: ``GET /n/<node>/metrics`` and ``/health``.

    Plain HTTP/1.1 keep-alive on a bare protocol rather than an aiohttp app: a thousand agents
    sample their engines hundreds of times a second, and on a fleet that work is the engines', not
    the agents' host's. In this one process it competed with the agents it stands beside (an
    aiohttp handler costs several times these few lines), so it inflated the agents' measured work.
    """

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head, self.buf = self.buf[:end], self.buf[end + 4 :]
            parts = head.split(b" ", 2)
            path = parts[1] if len(parts) > 1 else b""
            if path.endswith(b"/metrics"):
                self.transport.write(_METRICS_RESPONSE)
            elif path.endswith(b"/health"):
                # the agents' engine liveness check: without it every node would count as down
                self.transport.write(_HEALTH_RESPONSE)
            else:
                self.transport.write(_NOT_FOUND_RESPONSE)


async def _watch_lag(log: logging.Logger, period: float = 0.1, report: float = 0.5) -> None:
    """Log when this process's event loop falls behind by more than ``report`` seconds: its agents'
    timers (grace, lease renewals) are then late by as much, and the harness, not the protocol, is
    what a transition measures."""
    gc_started = 0.0

    def on_gc(phase: str, info: dict[str, int]) -> None:
        nonlocal gc_started
        if phase == "start":
            gc_started = time.perf_counter()
        elif (took := time.perf_counter() - gc_started) > 0.1:
            log.warning("gc generation %d took %.2f s", info["generation"], took)

    gc.callbacks.append(on_gc)
    while True:
        before = time.monotonic()
        await asyncio.sleep(period)
        if (late := time.monotonic() - before - period) > report:
            log.warning("event loop %.2f s late", late)


def _response(status: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


_METRICS_RESPONSE = _response("200 OK", IDLE_METRICS.encode())
_HEALTH_RESPONSE = _response("200 OK", b"ok")
_NOT_FOUND_RESPONSE = _response("404 Not Found", b"not found")


async def _engine() -> tuple[asyncio.Server, int]:
    server = await asyncio.get_running_loop().create_server(_EngineStandIn, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1])


async def run(args: argparse.Namespace) -> None:
    # One TCP connection per agent and master, as in a real fleet: gRPC would otherwise share one
    # connection among all channels of this process to the same master.
    agent_mod.GRPC_CLIENT_OPTIONS = [*agent_mod.GRPC_CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    if args.etcd_connection_per_agent:
        # The same for etcd, as on a fleet of separate hosts: etcd then serves a connection per node.
        # Off by default: shared, the process's agents use one connection, which costs etcd less
        # and keeps the results comparable with the earlier rounds' (bench/README).
        etcd_mod._CHANNEL_OPTIONS.append(("grpc.use_local_subchannel_pool", 1))
    engine, port = await _engine()
    etcd = EtcdSettings([args.etcd], args.cluster, None, args.lease_ttl)
    agents = []
    for i in range(args.first, args.first + args.count):
        node_id, role, capacity = node_spec(i)
        agents.append(
            NodeAgent(
                AgentConfig(
                    etcd=etcd,
                    node_id=node_id,
                    role=role,
                    endpoint=f"http://127.0.0.1:{port}/n/{node_id}",
                    running_max_req_size=capacity,
                    start_args={"bootstrap_port": str(20000 + i % 10000)} if role == "prefill" else {},
                    load_urls=(f"http://127.0.0.1:{port}/n/{node_id}/metrics",),
                    shares=SharePolicy(policy=args.share_policy, handover=args.handover),
                    health_interval=args.health_interval,
                    **({"report_interval": args.report_interval} if args.report_interval else {}),
                    **({"probe_interval": args.probe_interval} if args.probe_interval else {}),
                )
            )
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.profile_dir:
        _profile_on_signals(loop, Path(args.profile_dir), f"swarm{args.first:05d}")
    loop.add_signal_handler(signal.SIGHUP, _log_down_links, agents)
    t0 = time.monotonic()
    await asyncio.gather(*(a.start() for a in agents))
    # A real agent's heap is its own; here 200 agents share one, which CPython's default collector
    # walks in full every so often: a cost that grows with the agents per process and that no real
    # agent pays. Collect rarely, as the master does.
    tune_gc()
    lag = asyncio.create_task(_watch_lag(logging.getLogger("swarm")))
    print(json.dumps({"started": len(agents), "seconds": round(time.monotonic() - t0, 3)}), flush=True)
    await stop.wait()
    lag.cancel()
    await asyncio.gather(*(a.stop() for a in agents), return_exceptions=True)
    engine.close()
    await engine.wait_closed()


def _log_down_links(agents: list[NodeAgent]) -> None:
    """SIGHUP: log every agent link that is not connected, with where its task waits (the benchmark
    sends it when nodes stay off target, to tell a slow reconnect from a stuck one)."""
    log = logging.getLogger("swarm")
    for a in agents:
        for mid, link in a.links.items():
            if link.connected:
                continue
            task = link.task
            if task is None:
                where = "no task"
            elif task.done():
                exc = None if task.cancelled() else task.exception()
                where = f"task ended: {'cancelled' if task.cancelled() else repr(exc)}"
            else:
                frames = task.get_stack(limit=8)
                where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames))
            log.warning("down link: node %s master %s: %s", a.cfg.node_id, mid, where)


def _profile_on_signals(loop: asyncio.AbstractEventLoop, out: Path, name: str) -> None:
    """SIGUSR1 starts a profile of the event loop's thread, SIGUSR2 writes it (``<name>-<k>.pstats``):
    the benchmark brackets one transition with them, so the profile holds that transition alone."""
    running: list[cProfile.Profile] = []
    written = 0

    def start() -> None:
        running.append(cProfile.Profile())
        running[-1].enable()

    def dump() -> None:
        nonlocal written
        if running:
            prof = running.pop()
            prof.disable()
            prof.dump_stats(out / f"{name}-{written:02d}.pstats")
            written += 1

    out.mkdir(parents=True, exist_ok=True)
    loop.add_signal_handler(signal.SIGUSR1, start)
    loop.add_signal_handler(signal.SIGUSR2, dump)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--etcd", required=True)
    p.add_argument("--cluster", required=True)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--lease-ttl", type=int, default=5)
    p.add_argument("--share-policy", choices=["demand", "static"], default="demand")
    p.add_argument("--handover", default="strict")
    p.add_argument("--report-interval", type=float, default=0.0, help="0: the agent's default")
    # Each agent checks its own engine on its own host in a fleet; here a thousand agents' checks
    # (2 000 requests/s at the agent's 0.5 s) would share two cores with the masters being measured.
    p.add_argument("--health-interval", type=float, default=5.0, help="engine liveness check period")
    # The steady-state load sample (default 2 s): 500 requests/s here for 1 000 agents; a handover
    # that waits for the engine samples every 0.25 s whatever this is.
    p.add_argument("--probe-interval", type=float, default=0.0, help="0: the agent's default")
    p.add_argument("--profile-dir", default="", help="profile from SIGUSR1 to SIGUSR2 into this directory")
    p.add_argument("--etcd-connection-per-agent", action="store_true", help="see fleet_bench.py")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s swarm %(levelname)s %(name)s: %(message)s")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
