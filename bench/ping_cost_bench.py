"""What gRPC keep-alive pings cost a master: one server process, N idle streams, CPU over a window.

The master's steady state with 100 agents is mostly keep-alive pings (bench/README, "100 agent
processes"). This isolates them: a gRPC aio server with the master's channel options and one client
process with N channels (one TCP connection each, the agents' options), every stream opened and then
idle, and the server's CPU-seconds over the window for several master ping periods. Nothing but
pings crosses the connections after the first message. The same with real masters and 100 agent
processes: bench/quiet_fleet_bench.py.

    .venv/bin/python bench/ping_cost_bench.py                 # 100 streams, 20 s per variant
    .venv/bin/python bench/ping_cost_bench.py --streams 200 --window 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from peers import RESULTS, cpu_seconds, environment

from nodeagent.agent import GRPC_CLIENT_OPTIONS, master_channel_options
from pdcoord.keepalive import UNADVERTISED_KEEPALIVE_S
from pdmaster.server import GRPC_SERVER_OPTIONS

NO_PING_MS = 3_600_000


def _with(options: list[tuple[str, Any]], name: str, value: int) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in options if k != name] + [(name, value)]


async def _serve(port_file: str, ping_ms: int) -> None:
    async def connect(requests: Any, _ctx: Any) -> Any:
        async for _ in requests:
            yield b"ack"

    handler = grpc.method_handlers_generic_handler(
        "bench.Ping", {"Connect": grpc.stream_stream_rpc_method_handler(connect)}
    )
    server = grpc.aio.server(options=_with(list(GRPC_SERVER_OPTIONS), "grpc.keepalive_time_ms", ping_ms))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await asyncio.to_thread(Path(port_file).write_text, str(port))
    await server.wait_for_termination()


async def _clients(port: int, streams: int, ping_ms: int) -> None:
    options = [*_with(list(GRPC_CLIENT_OPTIONS), "grpc.keepalive_time_ms", ping_ms)]
    options.append(("grpc.use_local_subchannel_pool", 1))  # one connection per channel, as per agent
    held = []
    for _ in range(streams):
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
        call = channel.stream_stream("/bench.Ping/Connect")()
        await call.write(b"register")
        await call.read()
        held.append((channel, call))
    print("ready", flush=True)
    await asyncio.sleep(3600)


def measure(streams: int, window: float, master_ping_ms: int, agent_ping_ms: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ping-cost-") as tmp:
        port_file = f"{tmp}/port"
        me = [sys.executable, __file__]
        server = subprocess.Popen([*me, "--serve", port_file, "--ping-ms", str(master_ping_ms)])
        clients = None
        try:
            deadline = time.monotonic() + 30
            while not (os.path.exists(port_file) and Path(port_file).read_text()):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the server did not start")
                time.sleep(0.05)
            argv = [*me, "--clients", Path(port_file).read_text(), "--streams", str(streams)]
            clients = subprocess.Popen(
                [*argv, "--ping-ms", str(agent_ping_ms)], stdout=subprocess.PIPE, text=True
            )
            assert clients.stdout is not None
            if clients.stdout.readline().strip() != "ready":
                raise RuntimeError("the clients did not connect")
            time.sleep(3)  # past the connections' first pings
            s0, c0 = cpu_seconds(server.pid), cpu_seconds(clients.pid)
            time.sleep(window)
            s1, c1 = cpu_seconds(server.pid), cpu_seconds(clients.pid)
        finally:
            for p in (clients, server):
                if p is not None:
                    p.kill()
                    p.wait()
    return {
        "streams": streams,
        "master_ping_s": master_ping_ms / 1000 if master_ping_ms < NO_PING_MS else None,
        "agent_ping_s": agent_ping_ms / 1000 if agent_ping_ms < NO_PING_MS else None,
        "server_cpu_percent": round(100 * (s1 - s0) / window, 2),
        "clients_cpu_percent": round(100 * (c1 - c0) / window, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--window", type=float, default=20.0)
    p.add_argument("--out", default=str(RESULTS / "ping_cost.json"))
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--clients", help=argparse.SUPPRESS)
    p.add_argument("--ping-ms", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument(
        "--keepalive",
        default="5",
        help="also: masters with these --keepalive values (seconds, comma-separated), the agents' "
        "pings following as they do against such a master",
    )
    args = p.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve, args.ping_ms))
        return
    if args.clients:
        asyncio.run(_clients(int(args.clients), args.streams, args.ping_ms))
        return
    master_ms = dict(GRPC_SERVER_OPTIONS)["grpc.keepalive_time_ms"]
    # the agents ping a master a little later than it pings them (master_channel_options)
    follow_ms = dict(master_channel_options(master_ms / 1000))["grpc.keepalive_time_ms"]
    agent_ms = dict(GRPC_CLIENT_OPTIONS)["grpc.keepalive_time_ms"]  # their own floor, 1 s
    earlier_ms = round(UNADVERTISED_KEEPALIVE_S * 1000)
    variants = [
        ("no keep-alive pings", NO_PING_MS, NO_PING_MS),
        (f"the defaults (master {master_ms} ms, agents {follow_ms} ms)", master_ms, follow_ms),
        (f"the earlier defaults (master {earlier_ms} ms, agents {agent_ms} ms)", earlier_ms, agent_ms),
        ("master 1 000 ms (agents' own 1 s timer races it)", 1000, agent_ms),
        ("agents only (1 s), master none", NO_PING_MS, agent_ms),
    ]
    for k in (float(x) for x in args.keepalive.split(",") if x.strip()):
        follow_ms = dict(master_channel_options(k))["grpc.keepalive_time_ms"]
        label = f"master --keepalive {k:g} (agents after {follow_ms} ms)"
        variants.append((label, round(k * 1000), follow_ms))
    rows = []
    for label, m, a in variants:
        row = {"variant": label, **measure(args.streams, args.window, m, a)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = {"environment": environment(), "window_s": args.window, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
