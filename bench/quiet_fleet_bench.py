"""A master's steady-state cost beside 100 real agent processes: engines idle, and engines all down.

Two ``pdmaster`` processes at their default flags and N ``nodeagent`` processes (one per node, as on a
fleet), each beside an engine: ``idle`` is one stand-in answering every agent's ``/metrics`` (an idle
SGLang engine's counts) and ``/health``; ``down`` is an address where nothing listens, as while every
engine restarts at once (a rollout): the agents' load probes and liveness checks fail, and the masters
mark every node's engine down. Once every node is held and, for ``down``, every engine is known to be
down on both masters, the masters' CPU is taken over a window (CPU-seconds from /proc divided by the
window, so other load on the machine does not inflate it), with the agent messages each master
counted (``pdcoord_agent_messages_total``).

    .venv/bin/python bench/quiet_fleet_bench.py                              # idle, down; 100 agents
    .venv/bin/python bench/quiet_fleet_bench.py --variants idle --keepalive 0.65 --label "earlier default"
    .venv/bin/python bench/quiet_fleet_bench.py --variants down --agents-from /tmp/before --label before

``--agents-from DIR`` runs the agents from another source tree (a ``git archive`` of an earlier
commit) for a before/after; ``--keepalive`` sets the masters' ``--keepalive``. Rows are added to
``--out`` (bench/results/quiet_fleet.json) under ``<variant>`` or ``<variant> (<label>)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from fleet_bench import messages, rss_mb
from fleet_swarm import _engine
from peers import RESULTS, cpu_seconds, cpu_seconds_by_thread, environment

from pdcoord.dev.cluster import LocalCluster
from pdcoord.dev.etcd_server import LocalEtcd
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.dev.netutil import free_port

MASTERS = ("m1", "m2")


def idle_engine() -> str:
    """A thread running the fleet swarm's idle engine stand-in: its base URL."""
    ready: list[int] = []
    started = threading.Event()

    def run() -> None:
        async def serve() -> None:
            _server, port = await _engine()
            ready.append(port)
            started.set()
            await asyncio.Event().wait()

        asyncio.run(serve())

    threading.Thread(target=run, daemon=True, name="engine").start()
    if not started.wait(10):
        raise RuntimeError("the engine stand-in did not start")
    return f"http://127.0.0.1:{ready[0]}"


def _kind(labels: str) -> str:
    """'direction="received",kind="report"' -> 'received report'."""
    values = {k: v.strip('"') for k, v in (part.split("=", 1) for part in labels.split(","))}
    return values.get("direction", "?") + " " + values.get("kind", "?")


def admission(cluster: LocalCluster, master: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(cluster.masters[master].url + "/admission", timeout=10) as r:
        nodes: list[dict[str, Any]] = json.loads(r.read())["nodes"]
    return nodes


def settled(cluster: LocalCluster, caps: dict[str, int], down: bool) -> bool:
    """Every node connected to both masters, its shares summing to its capacity; its engine down on
    both masters for ``down`` and up otherwise."""
    total = dict.fromkeys(caps, 0)
    for m in MASTERS:
        nodes = {n["node_id"]: n for n in admission(cluster, m) if n["connected"]}
        if set(nodes) != set(caps) or any(n["engine_down"] is not down for n in nodes.values()):
            return False
        for nid, n in nodes.items():
            total[nid] += n["share"]
    return total == caps


def run_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    caps = {f"a{i:03d}": 16 + i % 4 * 16 for i in range(args.agents)}
    with tempfile.TemporaryDirectory(prefix="quiet-fleet-") as tmp, ProcessGroup(Path(tmp) / "logs") as group:
        etcd = LocalEtcd(data_dir=f"{tmp}/etcd", log_path=f"{tmp}/etcd.log", log_level="warn").start()
        try:
            cluster = LocalCluster(group, etcd.endpoint, f"quiet-{variant}")
            for m in MASTERS:
                cluster.start_master(m, **({"keepalive": args.keepalive} if args.keepalive else {}))
            engine = idle_engine() if variant == "idle" else ""
            # PYTHONSAFEPATH: the working directory (this tree) does not come before PYTHONPATH
            tree = str(Path(args.agents_from).resolve()) if args.agents_from else ""
            env = {"PYTHONPATH": tree, "PYTHONSAFEPATH": "1"} if tree else None
            t0 = time.monotonic()
            for nid, cap in caps.items():
                # Nothing listens at a down engine's address: refused at once, as a restarting pod.
                endpoint = engine or f"http://127.0.0.1:{free_port()}"
                # The agents' defaults: strict handover, demand shares, load probe and liveness check.
                cluster.start_agent(nid, "decode", endpoint=endpoint, capacity=cap, wait=False, env=env)
            deadline = t0 + args.start_timeout
            while True:
                for nid in caps:
                    if not cluster.agents[nid].proc.alive:
                        # a health port picked as free can be taken before the agent binds it
                        print(f"  agent {nid} exited at start-up; restarting it", flush=True)
                        cluster.restart_agent(nid)
                try:
                    if settled(cluster, caps, variant == "down"):
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{variant}: the fleet did not settle within {args.start_timeout} s")
                time.sleep(1.0)
            started = time.monotonic() - t0
            time.sleep(args.settle)
            pids = {m: cluster.masters[m].proc.pid for m in MASTERS}
            assert etcd.pid is not None
            msgs0 = {m: messages(cluster.masters[m]) for m in MASTERS}
            cpu0 = {m: cpu_seconds(p) for m, p in pids.items()}
            threads0 = {m: cpu_seconds_by_thread(p) for m, p in pids.items()}
            etcd0 = cpu_seconds(etcd.pid)
            agents0 = sum(cpu_seconds(a.proc.pid) for a in cluster.agents.values())
            w0 = time.monotonic()
            time.sleep(args.window)
            dt = time.monotonic() - w0
            cpu = {m: round(100 * (cpu_seconds(p) - cpu0[m]) / dt, 2) for m, p in pids.items()}
            threads = {
                m: {
                    n: round(100 * (t - threads0[m].get(n, 0.0)) / dt, 2)
                    for n, t in sorted(cpu_seconds_by_thread(p).items())
                }
                for m, p in pids.items()
            }
            etcd_cpu = round(100 * (cpu_seconds(etcd.pid) - etcd0) / dt, 2)
            agents_cpu = round(
                100 * (sum(cpu_seconds(a.proc.pid) for a in cluster.agents.values()) - agents0) / dt, 1
            )
            msgs1 = {m: messages(cluster.masters[m]) for m in MASTERS}
            rates = {
                m: {_kind(k): round((v - msgs0[m].get(k, 0.0)) / dt, 2) for k, v in sorted(msgs1[m].items())}
                for m in MASTERS
            }
            still_down = settled(cluster, caps, variant == "down")
            row = {
                "variant": variant,
                "agents": args.agents,
                "masters": len(MASTERS),
                "master_keepalive_s": args.keepalive or "default",
                "agents_from": args.agents_from or "this tree",
                "window_s": round(dt, 1),
                "all_settled_s": round(started, 1),
                "master_cpu_percent": cpu,
                "master_cpu_percent_max": max(cpu.values()),
                "master_cpu_percent_by_thread": threads,
                "agent_messages_per_s_by_master": rates,
                "reports_per_s_per_master_max": max(r.get("received report", 0.0) for r in rates.values()),
                "etcd_cpu_percent": etcd_cpu,
                "agents_cpu_percent_total": agents_cpu,
                "master_rss_mb_max": round(max(rss_mb(p) for p in pids.values()), 1),
                "unchanged_after_window": still_down,
            }
            print(json.dumps(row), flush=True)
            return row
        finally:
            group.stop_all(timeout=20)
            etcd.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=100)
    p.add_argument("--variants", default="idle,down", help="comma-separated: idle, down")
    p.add_argument("--window", type=float, default=30.0, help="measuring window, seconds")
    p.add_argument("--settle", type=float, default=10.0, help="quiet seconds before the window")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--keepalive", type=float, default=0.0, help="the masters' --keepalive (0: their default)")
    p.add_argument("--agents-from", default="", help="run the agents from this source tree")
    p.add_argument("--label", default="", help="stored with the rows (e.g. before, after)")
    p.add_argument("--out", default=str(RESULTS / "quiet_fleet.json"))
    args = p.parse_args()
    out_path = Path(args.out)
    data: dict[str, Any] = json.loads(out_path.read_text()) if out_path.exists() else {}
    data.setdefault("rows", {})
    data["note"] = (
        "CPU is CPU-seconds per process over the window divided by the window (% of one core); "
        "messages per second are what each master counted on its agent streams, by direction and kind."
    )
    for variant in (v.strip() for v in args.variants.split(",") if v.strip()):
        if variant not in ("idle", "down"):
            raise SystemExit(f"--variants: unknown variant {variant!r} (idle, down)")
        row = run_variant(args, variant) | {"label": args.label, "environment": environment()}
        data["rows"][f"{variant} ({args.label})" if args.label else variant] = row
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
