"""Fleet scale: a thousand real node agents against 1, 3 and 8 real masters, on one etcd.

The agents are the real ``nodeagent.agent.NodeAgent`` code, ``--per-swarm`` of them per process
(``bench/fleet_swarm.py``: own etcd client, lease and gRPC streams each; one stand-in engine per
process serves their idle ``/metrics``). Fleet: 1 prefill node in 4, decode capacities 32-256.

Measured, in this order, on one fleet that grows from 1 to 3 to 8 masters:

* ``all_connected_s``: every agent process started at once → every node holds its whole capacity
  on the first master (its ``/admission`` polled);
* per master count: steady-state CPU of each master, of etcd and of the swarm processes over a
  ``--window`` of no changes (CPU-seconds from /proc/<pid>/stat divided by the window, so other
  load on the machine does not inflate it), RSS, and agent messages per second from the masters'
  ``pdcoord_agent_messages_total``;
* ``join_s``: a master process is started → it holds its share on every node;
* ``failover_s``: one master is SIGKILLed → the survivors hold the whole capacity of every node
  (``--trials`` per master count; each killed master is replaced by a new one, which is a join).

``--processes N`` instead runs N real ``nodeagent`` processes (one each; one stand-in serves their idle
engine load) against two masters and measures the masters' steady-state CPU.

Writes bench/results/fleet.json (and fleet.png with --plot).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from fleet_swarm import IDLE_METRICS, node_spec
from peers import RESULTS, cpu_seconds, cpu_seconds_by_thread, environment, pyplot

from nodeagent.slicing import slice_shares
from pdcoord.dev.cluster import LocalCluster, Master
from pdcoord.dev.etcd_server import LocalEtcd
from pdcoord.dev.launcher import ManagedProcess, ProcessGroup

BENCH = Path(__file__).resolve().parent


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def messages(m: Master) -> dict[str, float]:
    with urllib.request.urlopen(m.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdcoord_agent_messages_total{"):
            labels, _, value = line.partition("} ")
            out[labels.split("{", 1)[1]] = float(value)
    return out


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None when there are no samples or it falls on a timeout."""
    if not values:
        return None
    s = sorted(values)
    v = s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
    return round(v, 3) if math.isfinite(v) else None


def samples(values: list[float]) -> list[float | None]:
    return [round(x, 3) if math.isfinite(x) else None for x in values]


# (CPU-seconds by "agents" / "masters" / "etcd", messages counted by (master, kind)): Fleet.counters
Counters = tuple[dict[str, float], dict[tuple[str, str], float]]


class Fleet:
    def __init__(self, args: argparse.Namespace, group: ProcessGroup, etcd: LocalEtcd) -> None:
        self.args = args
        self.group = group
        self.etcd = etcd
        self.cluster = LocalCluster(group, etcd.endpoint, f"fleet-{os.getpid()}")
        self.specs = {nid: cap for nid, _role, cap in (node_spec(i) for i in range(args.nodes))}
        self.decode = {
            nid for nid, role, _cap in (node_spec(i) for i in range(args.nodes)) if role == "decode"
        }
        self.live: list[str] = []
        self.swarms: list[ManagedProcess] = []
        self._next_master = 1
        self.transitions: list[dict[str, Any]] = []
        self.timeouts: list[dict[str, Any]] = []
        self.pool = ThreadPoolExecutor(16)

    # -- checks -------------------------------------------------------------------------------
    def holds(self, master_id: str, members: list[str]) -> bool:
        """``master_id`` holds exactly its share of the split among ``members`` on every node.

        Polled through the O(1) totals (decode capacity, live streams) so that the poller does not
        load the master it measures; the per-node table is read only once the totals match.
        """
        url = self.cluster.masters[master_id].url + "/admission"
        want = sum(
            slice_shares(cap, members, nid)[master_id]
            for nid, cap in self.specs.items()
            if nid in self.decode
        )
        try:
            totals = get_json(url + "?nodes=0")
            if totals["capacity"] != want or totals["streams"] != len(self.specs):
                return False
            nodes = get_json(url)["nodes"]
        except OSError:
            return False
        held = {n["node_id"]: n["effective_share"] for n in nodes if n["connected"]}
        if len(held) != len(self.specs):
            return False
        return all(
            held.get(nid) == slice_shares(cap, members, nid)[master_id] for nid, cap in self.specs.items()
        )

    def off_target(self, master_id: str, members: list[str]) -> list[str]:
        """Nodes on which ``master_id`` does not hold its share of the split (for a timeout's report)."""
        nodes = get_json(self.cluster.masters[master_id].url + "/admission")["nodes"]
        held = {n["node_id"]: n["effective_share"] for n in nodes if n["connected"]}
        return [
            nid
            for nid, cap in self.specs.items()
            if held.get(nid) != slice_shares(cap, members, nid)[master_id]
        ]

    def node_views(self, node_ids: list[str], members: list[str]) -> dict[str, dict[str, Any]]:
        """What each of ``members`` says of each node: connected, share, effective share, epoch, and
        the share it should hold (a timeout's report, to tell a slow node from a stuck one)."""
        out: dict[str, dict[str, Any]] = {nid: {} for nid in node_ids}
        for m in members:
            try:
                nodes = get_json(self.cluster.masters[m].url + "/admission")["nodes"]
            except OSError as exc:
                for nid in node_ids:
                    out[nid][m] = f"unreachable: {exc}"
                continue
            by_id = {n["node_id"]: n for n in nodes}
            for nid in node_ids:
                n = by_id.get(nid, {})
                out[nid][m] = {
                    "connected": n.get("connected"),
                    "share": n.get("share"),
                    "effective_share": n.get("effective_share"),
                    "epoch": n.get("epoch"),
                    "want": slice_shares(self.specs[nid], members, nid)[m],
                }
        return out

    def wait_all_hold(self, masters: list[str], members: list[str], timeout: float) -> float:
        t0 = time.monotonic()
        pending = list(masters)
        while pending:
            if time.monotonic() - t0 > timeout:
                off_nodes = {m: self.off_target(m, members) for m in pending}
                off = {m: len(v) for m, v in off_nodes.items()}
                sample = sorted({nid for v in off_nodes.values() for nid in v})[:5]
                views = self.node_views(sample, members)
                for swarm in self.swarms:
                    swarm.send_signal(signal.SIGHUP)  # each logs its agents' links that are down
                self.timeouts.append(
                    {"masters": members, "timeout_s": timeout, "nodes_off_target": off, "sample": views}
                )
                print(f"  TIMEOUT after {timeout} s: nodes off target {off}; {json.dumps(views)}", flush=True)
                return math.inf
            ok = list(self.pool.map(lambda m: self.holds(m, members), pending))
            pending = [m for m, good in zip(pending, ok, strict=True) if not good]
            if pending:
                time.sleep(0.1)
        return time.monotonic() - t0

    # -- actions ------------------------------------------------------------------------------
    def new_master_id(self) -> str:
        mid = f"m{self._next_master:02d}"
        self._next_master += 1
        return mid

    def counters(self) -> Counters:
        """CPU-seconds so far of the agent processes, the live masters and etcd; and the messages
        each live master has counted so far, by (master, kind)."""
        assert self.etcd.pid is not None
        cpu = {
            "agents": sum(cpu_seconds(s.pid) for s in self.swarms),
            "masters": sum(cpu_seconds(self.cluster.masters[m].proc.pid) for m in self.live),
            "etcd": cpu_seconds(self.etcd.pid),
        }
        msgs: dict[tuple[str, str], float] = {}
        for m in self.live:
            with contextlib.suppress(OSError):
                for kind, n in messages(self.cluster.masters[m]).items():
                    msgs[m, kind] = n
        return cpu, msgs

    def profile(self, sig: signal.Signals) -> None:
        """Bracket a transition with the swarms' profiler (``--profile-dir``)."""
        if self.args.profile_dir:
            for s in self.swarms:
                os.kill(s.pid, sig)

    def note_transition(self, what: str, wall: float, before: Counters) -> None:
        """How busy the agent processes (and the masters, etcd) were during a transition: near the
        machine's core count means the time measured is the harness's CPU throughput, not the
        protocol's latency. A master killed in the transition is not in the masters' figure."""
        (cpu0, msgs0), (cpu1, msgs1) = before, self.counters()
        busy = {k: round((cpu1[k] - cpu0[k]) / wall, 2) if wall > 0 else 0.0 for k in cpu1}
        # Reports, Registers and Acks the live masters handled (a new master counts from its start).
        by_kind: dict[str, float] = {}
        for (m, kind), v in msgs1.items():
            by_kind[kind] = by_kind.get(kind, 0.0) + v - msgs0.get((m, kind), 0.0)
        n = len(self.specs)
        self.transitions.append(
            {
                "what": what,
                "wall_s": round(wall, 3),
                "agent_cores_busy": busy["agents"],
                "masters_cores_busy": busy["masters"],
                "etcd_cores_busy": busy["etcd"],
                "messages_per_node": round(sum(by_kind.values()) / n, 2),
                "messages_per_node_by_kind": {k: round(v / n, 2) for k, v in sorted(by_kind.items())},
            }
        )

    def add_master(self, timeout: float = 60.0) -> float:
        mid = self.new_master_id()
        self.profile(signal.SIGUSR1)
        before = self.counters()
        t0 = time.monotonic()
        self.cluster.start_master(mid, **({"keepalive": self.args.keepalive} if self.args.keepalive else {}))
        self.live.append(mid)
        held = 0.0
        if self.swarms or self.cluster.agents:  # no fleet yet: nothing to hold
            held = self.wait_all_hold([mid], sorted(self.live), timeout)
        took = time.monotonic() - t0
        self.profile(signal.SIGUSR2)
        if self.swarms:
            self.note_transition(f"join {mid}", took, before)
        return took if math.isfinite(held) else math.inf

    def start_swarms(self, wait: bool = True) -> float:
        per = self.args.per_swarm
        t0 = time.monotonic()
        for k, first in enumerate(range(0, self.args.nodes, per)):
            argv = [sys.executable, str(BENCH / "fleet_swarm.py"), "--etcd", self.etcd.endpoint,
                    "--cluster", self.cluster.cluster, "--first", str(first),
                    "--count", str(min(per, self.args.nodes - first)),
                    "--share-policy", self.args.share_policy,
                    *(["--probe-interval", str(self.args.probe_interval)] if self.args.probe_interval
                      else []),
                    *(["--etcd-connection-per-agent"] if self.args.etcd_connection_per_agent else []),
                    *(["--profile-dir", self.args.profile_dir] if self.args.profile_dir else []),
                    "--log-level", self.args.swarm_log_level]  # fmt: skip
            self.swarms.append(self.group.start(f"swarm{k}", argv))
        if wait:
            self.wait_all_hold(list(self.live), sorted(self.live), self.args.start_timeout)
        return time.monotonic() - t0

    def kill_one(self) -> float:
        victim = self.live[len(self.live) // 2]
        self.live.remove(victim)
        proc = self.cluster.masters[victim].proc
        self.profile(signal.SIGUSR1)
        before = self.counters()
        t0 = time.monotonic()
        proc.kill()
        held = self.wait_all_hold(list(self.live), sorted(self.live), 60.0)
        took = time.monotonic() - t0
        self.profile(signal.SIGUSR2)
        self.note_transition(f"SIGKILL {victim}", took, before)
        return took if math.isfinite(held) else math.inf

    def steady(self, window: float) -> dict[str, Any]:
        masters = {m: self.cluster.masters[m] for m in self.live}
        pids = {f"master {m}": mm.proc.pid for m, mm in masters.items()}
        assert self.etcd.pid is not None
        pids["etcd"] = self.etcd.pid
        for s in self.swarms:
            pids[s.name] = s.pid
        time.sleep(self.args.settle)
        msgs0 = {m: messages(mm) for m, mm in masters.items()}
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        threads0 = {m: cpu_seconds_by_thread(mm.proc.pid) for m, mm in masters.items()}
        t0 = time.monotonic()
        time.sleep(window)
        cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
        threads1 = {m: cpu_seconds_by_thread(mm.proc.pid) for m, mm in masters.items()}
        dt = time.monotonic() - t0
        # Where a master's time goes: its interpreter (Python) or gRPC's C-core threads (pings).
        by_thread = {
            m: {n: round(100 * (t - threads0[m].get(n, 0.0)) / dt, 2) for n, t in sorted(threads1[m].items())}
            for m in masters
        }
        msgs1 = {m: messages(mm) for m, mm in masters.items()}
        cpu = {k: round(100 * (cpu1[k] - cpu0[k]) / dt, 2) for k in pids}
        master_cpu = [cpu[f"master {m}"] for m in masters]
        per_master_msgs = {
            m: round(sum(msgs1[m].get(k, 0) - msgs0[m].get(k, 0) for k in msgs1[m]) / dt, 1) for m in masters
        }
        return {
            "masters": len(masters),
            "window_s": round(dt, 1),
            "cpu_percent_of_one_core": cpu,
            "master_cpu_percent_max": max(master_cpu),
            "master_cpu_percent_mean": round(sum(master_cpu) / len(master_cpu), 2),
            "master_cpu_percent_by_thread": by_thread,
            "master_cpu_percent_per_1000_nodes": round(1000 * max(master_cpu) / self.args.nodes, 2),
            "etcd_cpu_percent": cpu["etcd"],
            "swarm_cpu_percent_total": round(sum(v for k, v in cpu.items() if k.startswith("swarm")), 1),
            "master_rss_mb_max": round(max(rss_mb(mm.proc.pid) for mm in masters.values()), 1),
            "etcd_rss_mb": round(rss_mb(self.etcd.pid), 1),
            "messages_per_s_per_master": per_master_msgs,
            "messages_per_s_total": round(sum(per_master_msgs.values()), 1),
        }


def logs_dir(args: argparse.Namespace, tmp: str) -> Path:
    """Where the processes' logs go: kept in ``--log-dir`` when given, else deleted with the run."""
    return Path(args.log_dir) if args.log_dir else Path(tmp) / "logs"


def run_fleet(args: argparse.Namespace) -> dict[str, Any]:
    counts = sorted({int(c) for c in args.masters.split(",")})
    out: dict[str, Any] = {"nodes": args.nodes, "per_swarm": args.per_swarm, "by_masters": {}}
    with (
        tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp,
        ProcessGroup(logs_dir(args, tmp)) as group,
    ):
        etcd = LocalEtcd(data_dir=f"{tmp}/etcd", log_path=f"{tmp}/etcd.log", log_level="warn").start()
        try:
            fleet = Fleet(args, group, etcd)
            for _ in range(counts[0]):
                fleet.add_master()
            out["all_connected_s"] = round(fleet.start_swarms(), 2)
            print(
                f"{args.nodes} agents connected to {counts[0]} master(s) in {out['all_connected_s']} s",
                flush=True,
            )
            joins: list[float] = []
            for count in counts:
                while len(fleet.live) < count:
                    joins.append(fleet.add_master())
                    print(
                        f"  master {len(fleet.live)} holds its share on every node after {joins[-1]:.2f} s",
                        flush=True,
                    )
                row = fleet.steady(args.window)
                print(f"  {count} masters steady: {json.dumps(row)}", flush=True)
                fails: list[float] = []
                rejoins: list[float] = []
                for _ in range(args.trials if count > 1 else 0):
                    fails.append(fleet.kill_one())
                    rejoins.append(fleet.add_master())
                    print(
                        f"  SIGKILL failover {fails[-1]:.2f} s, replacement join {rejoins[-1]:.2f} s",
                        flush=True,
                    )
                row["failover_s"] = {
                    "samples": samples(fails),
                    "p50": pct(fails, 0.5),
                    "p99": pct(fails, 0.99),
                }
                row["join_s"] = {
                    "samples": samples(rejoins),
                    "p50": pct(rejoins, 0.5),
                    "p99": pct(rejoins, 0.99),
                }
                out["by_masters"][str(count)] = row
            out["transitions"] = fleet.transitions
            out["timeouts"] = fleet.timeouts
            out["join_while_growing_s"] = {
                "samples": samples(joins),
                "p50": pct(joins, 0.5),
                "p99": pct(joins, 0.99),
            }
        finally:
            group.stop_all(timeout=20)
            etcd.stop()
    return out


def idle_engine() -> str:
    """A thread serving an idle SGLang engine's load to every agent process: its ``/metrics`` URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = IDLE_METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/metrics"


def run_processes(args: argparse.Namespace) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="fleet-procs-") as tmp,
        ProcessGroup(logs_dir(args, tmp)) as group,
    ):
        etcd = LocalEtcd(data_dir=f"{tmp}/etcd", log_path=f"{tmp}/etcd.log", log_level="warn").start()
        try:
            fleet = Fleet(args, group, etcd)
            fleet.specs = {f"a{i:03d}": 16 + i % 4 * 16 for i in range(args.processes)}
            fleet.decode = set(fleet.specs)
            fleet.add_master()
            fleet.add_master()
            engine = idle_engine()
            t0 = time.monotonic()
            for nid, cap in fleet.specs.items():
                # The agents' defaults (strict handover, the share policy asked for), with an engine
                # load signal as beside a real engine: without one an agent under demand would ask
                # every master for its demand each second. No liveness check: nothing serves it.
                fleet.cluster.start_agent(
                    nid, "decode", capacity=cap, wait=False, share_policy=args.share_policy,
                    handover="strict", no_load_probe=False, metrics_url=engine,
                )  # fmt: skip
            deadline = t0 + args.start_timeout
            while True:
                # A health port picked as free can be taken before the agent binds it (at its
                # start; these agents start without waiting for it): restart those on a new one.
                for nid in fleet.specs:
                    if not fleet.cluster.agents[nid].proc.alive:
                        print(f"  agent {nid} exited at start-up; restarting it", flush=True)
                        fleet.cluster.restart_agent(nid)
                left = deadline - time.monotonic()
                if math.isfinite(fleet.wait_all_hold(list(fleet.live), sorted(fleet.live), min(10.0, left))):
                    break
                if left <= 10.0:
                    break
                fleet.timeouts.clear()
            started = time.monotonic() - t0
            row = fleet.steady(args.window)
            row.pop("swarm_cpu_percent_total")
            row["master_cpu_percent_per_1000_nodes"] = round(
                1000 * row["master_cpu_percent_max"] / args.processes, 2
            )
            row["agents"] = args.processes
            row["all_connected_s"] = round(started, 1)
            agent_cpu = [cpu_seconds(a.proc.pid) for a in fleet.cluster.agents.values()]
            row["agent_cpu_seconds_mean_since_start"] = round(sum(agent_cpu) / len(agent_cpu), 2)
            print(json.dumps(row), flush=True)
            return row
        finally:
            group.stop_all(timeout=20)
            etcd.stop()


def run_etcd_late(args: argparse.Namespace) -> dict[str, Any]:
    """Masters and agents started while nothing listens on the etcd port; etcd comes up later."""
    from pdcoord.dev.netutil import free_port

    with (
        tempfile.TemporaryDirectory(prefix="fleet-late-") as tmp,
        ProcessGroup(logs_dir(args, tmp)) as group,
    ):
        etcd = LocalEtcd(free_port(), free_port(), data_dir=f"{tmp}/etcd", log_path=f"{tmp}/etcd.log")
        try:
            fleet = Fleet(args, group, etcd)
            fleet.add_master()
            fleet.start_swarms(wait=False)
            time.sleep(args.etcd_late)
            exited_before = [p.name for p in group.processes if not p.alive]
            etcd.start()
            took = fleet.wait_all_hold(list(fleet.live), sorted(fleet.live), args.start_timeout)
            row = {
                "nodes": args.nodes,
                "etcd_started_after_s": args.etcd_late,
                "all_connected_after_etcd_s": round(took, 2) if math.isfinite(took) else None,
                "exited_before_etcd": exited_before,
                "exited": [p.name for p in group.processes if not p.alive],
            }
            print(json.dumps(row), flush=True)
            return row
        finally:
            group.stop_all(timeout=20)
            etcd.stop()


def plot(data: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fleet = data["fleet"]
    counts = sorted(fleet["by_masters"], key=int)
    rows = [fleet["by_masters"][c] for c in counts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(counts))
    a.bar([i - 0.2 for i in x], [r["master_cpu_percent_max"] for r in rows], 0.4, label="busiest master")
    a.bar([i + 0.2 for i in x], [r["etcd_cpu_percent"] for r in rows], 0.4, label="etcd")
    a.axhline(10, color="red", ls="--", lw=1, label="budget (10 %)")
    a.set_xticks(list(x), [f"{c} master(s)" for c in counts])
    a.set_ylabel("% of one core, steady state")
    a.set_title(f"Control-plane CPU, {fleet['nodes']} nodes")
    a.legend()
    labels, p50, p99 = [], [], []
    for c, r in zip(counts, rows, strict=True):
        for what in ("failover_s", "join_s"):
            if r[what]["p50"] is not None:
                labels.append(f"{what.split('_')[0]}\n{c} masters")
                p50.append(r[what]["p50"])
                p99.append(r[what]["p99"] if r[what]["p99"] is not None else 60.0)  # a timeout
    xs = range(len(labels))
    b.bar([i - 0.2 for i in xs], p50, 0.4, label="p50")
    b.bar([i + 0.2 for i in xs], p99, 0.4, label="p99")
    b.axhline(2, color="red", ls="--", lw=1, label="failover budget (2 s)")
    b.axhline(3, color="orange", ls="--", lw=1, label="join budget (3 s)")
    b.set_xticks(list(xs), labels)
    b.set_ylabel("seconds")
    b.set_title("SIGKILL failover / new master holds its share")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--masters", default="1,3,8", help="master counts, in growing order")
    p.add_argument("--per-swarm", type=int, default=200, help="agents per swarm process")
    p.add_argument("--window", type=float, default=20.0, help="steady-state measuring window, seconds")
    p.add_argument("--settle", type=float, default=5.0, help="quiet seconds before each window")
    p.add_argument("--trials", type=int, default=3, help="SIGKILL trials per master count")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--share-policy", choices=["demand", "static"], default="demand")
    p.add_argument(
        "--probe-interval", type=float, default=0.0, help="agents' steady engine sample period (0: theirs)"
    )
    p.add_argument(
        "--etcd-connection-per-agent",
        action="store_true",
        help="each agent its own TCP connection to etcd, as on a fleet (default: one per swarm process)",
    )
    p.add_argument("--keepalive", type=float, default=0.0, help="the masters' --keepalive (0: theirs)")
    p.add_argument("--processes", type=int, default=0, help="also: N agent processes against 2 masters")
    p.add_argument("--skip-fleet", action="store_true", help="only --processes / --etcd-late")
    p.add_argument(
        "--etcd-late",
        type=float,
        default=0.0,
        help="also: start a master and --nodes agents with no etcd listening, etcd after this many seconds",
    )
    p.add_argument(
        "--profile-dir",
        default="",
        help="write a cProfile of every swarm process for every transition (join, SIGKILL) here",
    )
    p.add_argument("--log-dir", default="", help="keep every process's log here")
    p.add_argument("--swarm-log-level", default="WARNING", help="INFO: every agent's stream events too")
    p.add_argument("--label", default="", help="stored with the results (e.g. before/after)")
    p.add_argument("--out", default=str(RESULTS / "fleet.json"))
    p.add_argument("--plot", action="store_true")
    args = p.parse_args()
    out_path = Path(args.out)
    data: dict[str, Any] = json.loads(out_path.read_text()) if out_path.exists() else {}
    data["environment"] = environment()
    data["note"] = (
        "CPU is CPU-seconds per process over the window divided by the window (% of one core); the "
        "machine is shared, so wall-clock times (joins, failover) include scheduling delays."
    )
    if not args.skip_fleet:
        data["fleet"] = run_fleet(args) | {"label": args.label}
    if args.etcd_late:
        data["etcd_late"] = run_etcd_late(args) | {"label": args.label}
    if args.processes:
        data["processes"] = run_processes(args) | {"label": args.label}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(data, indent=2) + "\n")
    if args.plot and "fleet" in data:
        plot(data, out_path.with_suffix(".png"))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
