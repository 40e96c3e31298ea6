"""Demand-following shares against the even split with 3 and 8 masters, skewed traffic and churn.

    .venv/bin/python bench/demand_bench.py     # writes bench/results/demand.json (+ .png)

Virtual time: the protocol model of ``pdcoord/dev/protocol_model.py`` runs the real agent core
(nodeagent.slicing with strict handover) on every decode node and the real master cores (registry and
admission) with a simulated network. A fleet of 20 decode nodes with capacities 32-256 (five of each size,
2 400 slots). Requests arrive as Poisson streams, skewed over the masters: 70/20/10 with 3 masters,
geometric (each master half the previous one's traffic) with 8; each lease is held for an
exponential time (mean 2 s); 5 % need 2 slots. Set-ups at the same offered load:

* ``static`` / ``demand``: N masters, ``--share-policy`` static (even split) or demand (defaults:
  floor 1, hysteresis 2, step 25 %/s, re-evaluated every 1 s);
* scenario ``steady``: all masters up for the whole run;
* scenario ``churn``: a master joins 10 s into the measured window (it takes the weight of a mid-sized
  master), the second busiest drains at 25 s, the busiest is SIGKILLed at 40 s; the load balancer
  moves each master's traffic to the masters that take requests (total offered load unchanged);
* ``one_master``: all traffic on one master, which holds the whole fleet (the reference).

Measured over 60 s after 10 s of warm-up: decode utilisation (mean slots in use / capacity), served
(granted / (granted + refused by the admission timeout or a full queue)), p99 admission wait,
invariant violations (Σ over masters of max(share, leases) above a node's capacity, checked after
every protocol event; with none, no engine ever queues), and per churn event the time until the
fleet converged (every node splits among exactly the masters that take requests, nothing reserved
for one that left, every master holds what the agent grants, no handover pending). Three seeds per
point, medians. A coordination experiment, not a GPU measurement; the real-process check of the
same guarantee is ``tests/cluster/test_handover_cluster.py::test_demand_churn_three_masters``.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pdcoord.config import EnvArgumentParser, positive_int
from pdcoord.dev.protocol_model import ProtocolSim, SimConfig

N_NODES = 20
HOLD_S = 2.0
GANG = 0.05
WARMUP_S = 10.0


def fleet(seed: int = 7) -> dict[str, int]:
    rng = random.Random(seed)
    caps = [32, 64, 128, 256]
    nodes = {f"d{i:03d}": caps[i % 4] for i in range(N_NODES)}  # 5 of each size
    order = list(nodes)
    rng.shuffle(order)
    return {n: nodes[n] for n in sorted(order)}


NODES = fleet()
CAPACITY = sum(NODES.values())


def weights(n: int) -> dict[str, float]:
    if n == 3:
        return {"m1": 0.7, "m2": 0.2, "m3": 0.1}
    raw = {f"m{i + 1}": 0.5**i for i in range(n)}
    total = sum(raw.values())
    return {k: v / total for k, v in raw.items()}


def run_point(
    setup: str, n_masters: int, scenario: str, load: float, seed: int, measure_s: float
) -> dict[str, Any]:
    rate = load * CAPACITY / HOLD_S / (1 + GANG)
    churn: tuple[tuple[float, str, str], ...] = ()
    if setup == "one_master":
        w = {"m1": 1.0}
        masters: tuple[str, ...] = ("m1",)
        start = masters
    else:
        w = weights(n_masters)
        masters = tuple(w)
        start = masters
        if scenario == "churn":
            # The joiner takes the weight of the middle master; busiest m1, second busiest m2.
            w["mj"] = w[f"m{(n_masters + 1) // 2}"]
            masters = (*masters, "mj")
            t0 = WARMUP_S
            churn = ((t0 + 10, "join", "mj"), (t0 + 25, "drain", "m2"), (t0 + 40, "die", "m1"))
    cfg = SimConfig(
        nodes=dict(NODES),
        masters=masters,
        start_masters=start,
        handover="strict",
        policy="demand" if setup == "demand" else "static",
        chaos_s=WARMUP_S,
        settle_s=measure_s,
        fault_every_s=0.0,
        quiet_s=0.0,
        rates={m: w[m] * rate for m in w},
        hold_mean_s=HOLD_S,
        gang_fraction=GANG,
        churn=churn,
        restart_left=False,
        check_traffic_events=False,
    )
    sim = ProtocolSim(cfg, seed)
    st = sim.run()
    return {
        **sim.traffic(),
        "convergence": [
            {"t": round(t - WARMUP_S, 2), "event": k, "master": m, "s": None if c is None else round(c, 3)}
            for t, k, m, c in st.convergence
        ],
        # A drain lasts until the master's last lease ends (or its drain timeout): time from its exit.
        "drain_after_exit_s": [
            round(t + c - st.left[m], 3)
            for t, k, m, c in st.convergence
            if k == "drain" and c is not None and m in st.left
        ],
    }


def _point(args: tuple[str, int, str, float, int, float]) -> dict[str, Any]:
    return run_point(*args)


def main() -> None:
    p = EnvArgumentParser(prog="demand_bench", description=__doc__, env_prefix="BENCH")
    p.add_argument("--seeds", type=positive_int, default=3)
    p.add_argument("--measure-s", type=positive_int, default=60)
    p.add_argument("--loads", default="1.0")
    p.add_argument("--jobs", type=positive_int, default=2)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "demand.json"))
    args = p.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    points: list[tuple[str, int, str, float]] = []
    for load in loads:
        points.append(("one_master", 1, "steady", load))
        for n in (3, 8):
            for scenario in ("steady", "churn"):
                for setup in ("static", "demand"):
                    points.append((setup, n, scenario, load))
    jobs = [(*pt, seed, float(args.measure_s)) for pt in points for seed in range(args.seeds)]
    t0 = time.time()
    with ProcessPoolExecutor(args.jobs) as ex:
        results = list(ex.map(_point, jobs))
    rows: list[dict[str, Any]] = []
    for i, (setup, n, scenario, load) in enumerate(points):
        runs = results[i * args.seeds : (i + 1) * args.seeds]
        row: dict[str, Any] = {"load": load, "setup": setup, "masters": n, "scenario": scenario}
        for key in ("utilisation", "served", "wait_p50_ms", "wait_p99_ms"):
            row[key] = statistics.median(r[key] for r in runs)
        row["violations"] = sum(r["violations"] for r in runs)
        conv: dict[str, list[float | None]] = {}
        for r in runs:
            for c in r["convergence"]:
                conv.setdefault(c["event"], []).append(c["s"])
        row["convergence_s"] = {
            k: (None if any(v is None for v in vs) else statistics.median(v for v in vs if v is not None))
            for k, vs in conv.items()
        }
        row["convergence_max_s"] = {
            k: (None if any(v is None for v in vs) else max(v for v in vs if v is not None))
            for k, vs in conv.items()
        }
        after = [x for r in runs for x in r["drain_after_exit_s"]]
        if after:
            row["convergence_s"]["drain_after_exit"] = statistics.median(after)
            row["convergence_max_s"]["drain_after_exit"] = max(after)
        row["runs"] = runs
        rows.append(row)
    for row in rows:
        one = next(r for r in rows if r["load"] == row["load"] and r["setup"] == "one_master")["utilisation"]
        row["util_vs_one_master"] = row["utilisation"] / one if one else 0.0
        print(
            f"load {row['load']:.1f}x {row['setup']:>10} M={row['masters']} {row['scenario']:>6}: "
            f"util {row['utilisation']:.3f} ({row['util_vs_one_master']:.3f} of one master) "
            f"served {row['served']:.3f} p99 wait {row['wait_p99_ms']:.0f} ms "
            f"violations {row['violations']} convergence {row['convergence_s']}",
            flush=True,
        )
    out = {
        "description": __doc__,
        "nodes": len(NODES),
        "capacity": CAPACITY,
        "capacities": sorted(set(NODES.values())),
        "hold_mean_s": HOLD_S,
        "seeds": args.seeds,
        "measure_s": args.measure_s,
        "rows": rows,
        "elapsed_s": round(time.time() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} in {out['elapsed_s']} s")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install '.[bench]'): no plot")
        return
    fig, ax = plt.subplots(figsize=(9, 3.6))
    labels, vals, colors = [], [], []
    for row in rows:
        if row["setup"] == "one_master":
            continue
        labels.append(f"{row['load']:.1f}x M{row['masters']}\n{row['scenario']}")
        vals.append(row["util_vs_one_master"])
        colors.append("tab:orange" if row["setup"] == "demand" else "tab:blue")
    ax.bar(range(len(vals)), vals, color=colors)
    ax.axhline(0.95, color="k", ls="--", lw=1)
    ax.set_xticks(range(len(vals)), labels, fontsize=6)
    ax.set(ylabel="utilisation / one master", title="static (blue) vs demand (orange); dashed: 95 %")
    ax.set_ylim(0, 1.1)
    fig.tight_layout()
    png = Path(args.out).with_suffix(".png")
    fig.savefig(png, dpi=80)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
