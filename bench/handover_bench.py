"""Shares that follow demand: two masters with a 90/10 traffic split, in virtual time.

    .venv/bin/python bench/handover_bench.py     # writes bench/results/handover.json (+ .png)

The protocol model of ``pdcoord/dev/protocol_model.py`` runs the real agent core (nodeagent.slicing with
strict handover), the real master cores (registry and admission) and a simulated network with no
faults. Requests arrive as Poisson streams, 90 % at one master and 10 % at the other; each lease is
held for an exponential time (mean 0.3 s); 5 % need 2 slots. Two decode nodes of 32 slots. Three
set-ups see the same offered load:

* ``static``: two masters, even split of every node (``--share-policy static``);
* ``demand``: two masters, ``--share-policy demand`` (floor 1, hysteresis 2, step 25 %/s);
* ``one_master``: all traffic on one master, which holds the whole fleet.

Decode utilisation = mean slots in use / capacity over the measured window (60 s after 10 s of
warm-up); wait = admission queue wait of granted requests; served = granted / (granted + refused).
Three seeds per point, medians. This is a coordination experiment, not a GPU measurement.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from pdcoord.config import EnvArgumentParser, positive_int
from pdcoord.dev.protocol_model import ProtocolSim, SimConfig

NODES = {"d1": 32, "d2": 32}
CAPACITY = sum(NODES.values())
HOLD_S = 0.3
GANG = 0.05
SETUPS = ("static", "demand", "one_master")


def run_point(setup: str, load: float, seed: int, measure_s: float) -> dict[str, float]:
    rate = load * CAPACITY / HOLD_S / (1 + GANG)
    masters: tuple[str, ...] = ("busy",) if setup == "one_master" else ("busy", "idle")
    rates = {"busy": rate} if setup == "one_master" else {"busy": 0.9 * rate, "idle": 0.1 * rate}
    cfg = SimConfig(
        nodes=dict(NODES),
        masters=masters,
        handover="strict",
        policy="demand" if setup == "demand" else "static",
        chaos_s=10.0,
        settle_s=measure_s,
        fault_every_s=0.0,
        quiet_s=0.0,
        rates=rates,
        hold_mean_s=HOLD_S,
        gang_fraction=GANG,
    )
    sim = ProtocolSim(cfg, seed)
    sim.run()
    return sim.traffic()


def main() -> None:
    p = EnvArgumentParser(prog="handover_bench", description=__doc__, env_prefix="BENCH")
    p.add_argument("--seeds", type=positive_int, default=3)
    p.add_argument("--measure-s", type=positive_int, default=60)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "handover.json"))
    args = p.parse_args()
    loads = (0.6, 0.8, 1.0, 1.2)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for load in loads:
        for setup in SETUPS:
            runs = [run_point(setup, load, seed, args.measure_s) for seed in range(args.seeds)]
            row: dict[str, Any] = {"load": load, "setup": setup}
            for key in runs[0]:
                row[key] = statistics.median(r[key] for r in runs)
            row["runs"] = runs
            rows.append(row)
            print(
                f"load {load:.1f}x {setup:>10}: util {row['utilisation']:.3f} served {row['served']:.3f} "
                f"wait p50 {row['wait_p50_ms']:.1f} ms p99 {row['wait_p99_ms']:.1f} ms "
                f"violations {row['violations']}",
                flush=True,
            )
    ratios = {}
    for load in loads:
        one = next(r for r in rows if r["load"] == load and r["setup"] == "one_master")["utilisation"]
        ratios[str(load)] = {
            s: next(r for r in rows if r["load"] == load and r["setup"] == s)["utilisation"] / one
            for s in ("static", "demand")
        }
    out = {
        "description": __doc__,
        "nodes": NODES,
        "hold_mean_s": HOLD_S,
        "seeds": args.seeds,
        "measure_s": args.measure_s,
        "rows": rows,
        "utilisation_vs_one_master": ratios,
        "elapsed_s": round(time.time() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("utilisation relative to one master:", json.dumps(ratios))
    print(f"wrote {args.out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install '.[bench]'): no plot")
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for setup in SETUPS:
        xs = [r["load"] for r in rows if r["setup"] == setup]
        a1.plot(xs, [r["utilisation"] for r in rows if r["setup"] == setup], marker="o", label=setup)
        a2.plot(xs, [r["wait_p99_ms"] for r in rows if r["setup"] == setup], marker="o", label=setup)
    a1.set(xlabel="offered load (x capacity)", ylabel="decode utilisation", title="90/10 split: utilisation")
    a2.set(xlabel="offered load (x capacity)", ylabel="p99 wait (ms)", title="p99 admission wait")
    a1.legend()
    a1.grid(alpha=0.3)
    a2.grid(alpha=0.3)
    fig.tight_layout()
    png = Path(args.out).with_suffix(".png")
    fig.savefig(png, dpi=80)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
