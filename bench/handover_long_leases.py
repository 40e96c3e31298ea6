"""Strict handover in the protocol model with leases as long as decodes: how many fault scenarios
overshoot a node's capacity, and how many fail to converge.

The model's standard scenarios (tests/unit/test_handover_sim.py) hold leases for 0.3 s on average;
here the mean is 0.3, 3 and 10 s at the same offered load (12 slots' worth of arrivals per master per
second of lease), with a stable phase long enough for the leases to end. Run it against another
revision by putting that tree first on the path, e.g. a worktree of the commit before a change:

    .venv/bin/python bench/handover_long_leases.py --seeds 100
    git worktree add /tmp/pdcoord-before 8eba884
    PYTHONPATH=/tmp/pdcoord-before .venv/bin/python bench/handover_long_leases.py --seeds 100

Prints one line per (policy, mean lease) and writes nothing: the counts are the result.
"""

from __future__ import annotations

import argparse

from pdcoord.dev.protocol_model import ProtocolSim, SimConfig


def config(policy: str, hold_s: float) -> SimConfig:
    return SimConfig(
        handover="strict",
        policy=policy,
        chaos_s=20.0,
        settle_s=15.0 + 4 * hold_s,
        quiet_s=5.0 + 4 * hold_s,
        hold_mean_s=hold_s,
        rates=dict.fromkeys(("m1", "m2", "m3"), 12.0 / hold_s),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=100)
    p.add_argument("--holds", default="0.3,3,10", help="mean lease durations, seconds")
    args = p.parse_args()
    for policy in ("static", "demand"):
        for hold_s in (float(x) for x in args.holds.split(",")):
            over, unconverged = [], []
            for seed in range(args.seeds):
                sim = ProtocolSim(config(policy, hold_s), seed)
                if sim.run().violations:
                    over.append(seed)
                if sim.converged():
                    unconverged.append(seed)
            print(
                f"{policy:6} mean lease {hold_s:g} s: {len(over)}/{args.seeds} overshoot {over[:8]}, "
                f"{len(unconverged)} not converged {unconverged[:8]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
