"""Multi-master scaling: 1, 2 and 3 masters in front of the same fleet under saturating load.

Fleet: 1 prefill (128 slots) + 2 decode (24 slots each, 48 in all) pdsim engines with their agents.
Per run the load generator (its own process) keeps ``--concurrency`` streams open (2x the decode
capacity by default), round robin over the live masters. While it runs, a sampler reads every
master's ``GET /admission`` every 20 ms and sums ``active`` (leases held): that sum must never
exceed the fleet's decode capacity. Throughput: completed streams per second in the load
generator's window, and per master from each master's ``pdcoord_requests_total{status="200"}``.
The master counts are interleaved in a rotating order inside every repetition; masters are added
with a fresh id and removed with SIGTERM (graceful drain).

Writes bench/results/scale.json and bench/results/scale.png.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import urllib.request
from typing import Any

from peers import RESULTS, environment, median, pyplot, run_loadgen, write_json

from pdcoord.dev.cluster import LocalCluster, Master
from pdcoord.dev.etcd_server import LocalEtcd
from pdcoord.dev.launcher import ProcessGroup

FLEET = {"p1": ("prefill", 128), "d1": ("decode", 24), "d2": ("decode", 24)}
DECODE_CAPACITY = sum(cap for role, cap in FLEET.values() if role == "decode")


def ok_requests(m: Master) -> float:
    with urllib.request.urlopen(m.url + "/metrics", timeout=3) as r:
        text = r.read().decode()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("pdcoord_requests_total{") and 'status="200"' in line
    )


class Sampler(threading.Thread):
    """Σ active leases over the live masters, sampled until stopped."""

    def __init__(self, masters: list[Master], interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.masters = masters
        self.interval = interval
        self.stop = threading.Event()
        self.sums: list[int] = []
        self.times: list[float] = []

    def run(self) -> None:
        while not self.stop.is_set():
            total = 0
            try:
                for m in self.masters:
                    with urllib.request.urlopen(m.url + "/admission", timeout=2) as r:
                        total += int(json.loads(r.read())["active"])
            except OSError:
                continue
            self.sums.append(total)
            self.times.append(time.monotonic())
            self.stop.wait(self.interval)


def steady_mean(sampler: Sampler, t0: float, t1: float) -> float | None:
    """Mean Σ active over [t0, t1]: past the load generator's start-up and warm-up, before its tail."""
    vals = [v for t, v in zip(sampler.times, sampler.sums, strict=True) if t0 <= t <= t1]
    return round(sum(vals) / len(vals), 2) if vals else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--masters", default="1,2,3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=2 * DECODE_CAPACITY)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--log-dir", default=None)
    args = p.parse_args()
    counts = [int(x) for x in args.masters.split(",")]
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdcoord-scale-")
    env = environment()
    caps = {n: cap for n, (_, cap) in FLEET.items()}
    runs: list[dict[str, Any]] = []
    with LocalEtcd(log_path=f"{log_dir}/etcd.log") as etcd, ProcessGroup(log_dir) as group:
        c = LocalCluster(group, etcd.endpoint, "scale")
        for name, (role, cap) in FLEET.items():
            c.start_node(name, role, cap)
        live: list[str] = []
        next_id = 0
        for rep in range(args.repeats):
            for i in range(len(counts)):
                k = counts[(rep + i) % len(counts)]
                while len(live) < k:
                    mid = f"m{next_id}"
                    next_id += 1
                    c.start_master(mid)
                    live.append(mid)
                while len(live) > k:
                    c.masters[live.pop()].proc.terminate(timeout=15)
                c.wait_for(lambda lv=list(live): c.full_capacity_held(lv, caps), timeout=30)
                masters = [c.masters[m] for m in live]
                before = {m.master_id: ok_requests(m) for m in masters}
                sampler = Sampler(masters)
                sampler.start()
                started = time.monotonic()
                res = run_loadgen(
                    [
                        "--url",
                        ",".join(m.url for m in masters),
                        "--concurrency",
                        str(args.concurrency),
                        "--duration",
                        str(args.duration),
                        "--warmup",
                        str(args.warmup),
                        "--seed",
                        str(rep),
                    ],
                    {m.master_id: m.proc.pid for m in masters},
                )
                sampler.stop.set()
                sampler.join()
                wall = res["wall_s"]
                per_master = {m.master_id: (ok_requests(m) - before[m.master_id]) / wall for m in masters}
                run = {
                    "masters": k, "repeat": rep, "rps": res["rps"], "errors": res["errors"],
                    "error_samples": res["error_samples"],
                    "per_master_rps": {m: round(v, 1) for m, v in per_master.items()},
                    "max_sum_active": max(sampler.sums) if sampler.sums else None,
                    "mean_sum_active": steady_mean(sampler, started + 3.0, time.monotonic() - 1.0),
                    "samples": len(sampler.sums),
                    "ttft_ms": res["ttft_ms"], "e2e_ms": res["e2e_ms"], "window_s": res["wall_s"],
                    "master_cpu_s": res["cpu_s"], "loadgen_cpu_s": res["loadgen_cpu_s"],
                }  # fmt: skip
                runs.append(run)
                print(
                    f"rep {rep} masters={k} rps {res['rps']:7.1f} per-master {run['per_master_rps']} "
                    f"Σactive max {run['max_sum_active']} mean {run['mean_sum_active']}/{DECODE_CAPACITY} "
                    f"({run['samples']} samples) "
                    f"errors {res['errors']}",
                    flush=True,
                )
    summary: dict[str, Any] = {}
    for k in counts:
        rs = [r for r in runs if r["masters"] == k]
        summary[str(k)] = {
            "rps": median([r["rps"] for r in rs]),
            "per_master_rps": median([r["rps"] / k for r in rs]),
            "max_sum_active": max(r["max_sum_active"] or 0 for r in rs),
            "mean_sum_active": median([r["mean_sum_active"] for r in rs]),
            "rejected_per_s": median([r["errors"] / r["window_s"] for r in rs]),
            "samples": sum(r["samples"] for r in rs),
            "ttft_p50_ms": median([r["ttft_ms"]["p50"] for r in rs]),
            "e2e_p50_ms": median([r["e2e_ms"]["p50"] for r in rs]),
            "master_cpu_s_total": median([sum(r["master_cpu_s"].values()) for r in rs]),
            "errors": sum(r["errors"] for r in rs),
        }
    max_seen = max(s["max_sum_active"] for s in summary.values())
    data = {
        "benchmark": "scale",
        "environment": env,
        "config": {
            "fleet": {n: {"role": r, "capacity": cap} for n, (r, cap) in FLEET.items()},
            "decode_capacity": DECODE_CAPACITY,
            "concurrency": args.concurrency,
            "repeats": args.repeats,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "sample_interval_s": 0.02,
        },
        "max_sum_active_seen": max_seen,
        "never_above_capacity": max_seen <= DECODE_CAPACITY,
        "summary": summary,
        "runs": runs,
    }
    path = write_json("scale.json", data)
    print(f"wrote {path}")
    print(f"max Σ active leases seen: {max_seen} (fleet decode capacity {DECODE_CAPACITY})")
    print(
        "| masters | req/s | per master req/s | Σ active max / mean | samples | 429/s "
        "| TTFT p50 ms | e2e p50 ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for k, s in summary.items():
        print(
            f"| {k} | {s['rps']:.1f} | {s['per_master_rps']:.1f} | {s['max_sum_active']} / "
            f"{s['mean_sum_active'] or 0:.1f} | {s['samples']} | {s['rejected_per_s']:.1f} | "
            f"{s['ttft_p50_ms']:.1f} | {s['e2e_p50_ms']:.1f} |"
        )
    plot(summary)


def plot(summary: dict[str, Any]) -> None:
    plt = pyplot()
    if plt is None:
        return
    ks = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(8, 2.8), dpi=80)
    axes[0].bar(ks, [summary[k]["rps"] for k in ks], label="aggregate")
    axes[0].plot(ks, [summary[k]["per_master_rps"] for k in ks], "o-", color="C1", label="per master")
    axes[0].set_xlabel("masters")
    axes[0].set_title("completed streams/s", fontsize=10)
    axes[0].legend(fontsize=8)
    axes[1].bar(ks, [summary[k]["max_sum_active"] for k in ks], color="C2")
    axes[1].axhline(DECODE_CAPACITY, color="red", linestyle="--", label="fleet decode capacity")
    axes[1].set_xlabel("masters")
    axes[1].set_title("max Σ active leases sampled", fontsize=10)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / "scale.png")
    print(f"wrote {RESULTS / 'scale.png'}")


if __name__ == "__main__":
    main()
