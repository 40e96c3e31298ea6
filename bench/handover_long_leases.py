"""Strict handover in the protocol model with leases as long as decodes: how many fault scenarios
overshoot a node's capacity, and how many fail to converge.

The model's standard scenarios (tests/unit/test_handover_sim.py) hold leases for 0.3 s on average;
here the mean is 0.3, 3 and 10 s at the same offered load (12 slots' worth of arrivals per master per
second of lease), with a stable phase long enough for the leases to end. Run it against another
revision by putting that tree first on the path, e.g. a worktree of the commit before a change:

    .venv/bin/python bench/handover_long_leases.py --seeds 100
    git worktree add /tmp/pdcoord-before 8eba884
    PYTHONPATH=/tmp/pdcoord-before .venv/bin/python bench/handover_long_leases.py --seeds 100

Slow clients and how masters end their leases (``SimConfig.lease_end``, ``slow_fraction``,
``relay_mean_s``; the agent's ``end_seen_s``) are flags; a tree whose model lacks one of them runs
only with that flag at its default:

    .venv/bin/python bench/handover_long_leases.py --seeds 30 --slow-fraction 0.1
    .venv/bin/python bench/handover_long_leases.py --seeds 30 --slow-fraction 0.1 --lease-end relay

So are a lease's prefill and what the agents and masters do about it (``prefill_mean_s``,
``protocol``, ``sample_counts``, ``start_seen_s``, ``kept_from``, ``polling``, ``unsent_on_loss``),
e.g. agents and masters before and after they counted the leases waiting for their KV:

    .venv/bin/python bench/handover_long_leases.py --holds 3,10 --prefill-mean 1 --protocol vllm \
        --polling worth
    .venv/bin/python bench/handover_long_leases.py --holds 3,10 --prefill-mean 1 --protocol vllm \
        --polling worth --sample-counts held --start-seen 0.1 --kept-from sent

Prints one line per (policy, mean lease) and writes nothing: the counts are the result.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from pdcoord.dev.protocol_model import ProtocolSim, SimConfig

# Flags for SimConfig fields that older models lack: (field, its default in those that have it).
KNOBS = {
    "lease_end": "seen",
    "slow_fraction": 0.0,
    "relay_mean_s": 2.0,
    "end_seen_s": None,  # None: the model's own default (nodeagent.handover.END_SEEN_S)
    "prefill_mean_s": 0.0,
    "protocol": "sglang",
    "sample_counts": "running",
    "start_seen_s": 0.0,
    "kept_from": "grant",
    "polling": "all",
    "unsent_on_loss": "send",
}


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


def knobs(args: argparse.Namespace) -> dict[str, object]:
    """The SimConfig fields the flags change; exits when this tree's model lacks one of them."""
    have = {f.name for f in dataclasses.fields(SimConfig)}
    out: dict[str, object] = {}
    for name, default in KNOBS.items():
        value = getattr(args, name)
        if value is None or value == default:
            continue
        if name not in have:
            sys.exit(f"this tree's protocol model has no SimConfig.{name}: run without that flag")
        out[name] = value
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=100)
    p.add_argument("--holds", default="0.3,3,10", help="mean lease durations, seconds")
    p.add_argument(
        "--lease-end",
        dest="lease_end",
        choices=("seen", "relay"),
        default="seen",
        help="masters of this release (seen) or of earlier ones, which hold a lease until relayed (relay)",
    )
    p.add_argument(
        "--slow-fraction", dest="slow_fraction", type=float, default=0.0, help="leases of a slow client"
    )
    p.add_argument(
        "--relay-mean",
        dest="relay_mean_s",
        type=float,
        default=2.0,
        help="mean seconds from a slow client's decode end until it has the answer",
    )
    p.add_argument(
        "--end-seen",
        dest="end_seen_s",
        type=float,
        default=None,
        help="seconds after a sample the agent closes its bracket (default: END_SEEN_S)",
    )
    p.add_argument(
        "--prefill-mean",
        dest="prefill_mean_s",
        type=float,
        default=0.0,
        help="mean prefill, seconds (0: the engine counts a lease from its grant)",
    )
    p.add_argument(
        "--protocol",
        choices=("sglang", "vllm"),
        default="sglang",
        help="PD protocol: the decode request goes out at grant (sglang) or after the prefill (vllm)",
    )
    p.add_argument(
        "--sample-counts",
        dest="sample_counts",
        choices=("running", "held"),
        default="running",
        help="what an engine sample counts: running requests, or every request the engine holds",
    )
    p.add_argument(
        "--start-seen",
        dest="start_seen_s",
        type=float,
        default=0.0,
        help="seconds after the Acks that open a bracket the agent takes its sample",
    )
    p.add_argument(
        "--kept-from",
        dest="kept_from",
        choices=("grant", "sent"),
        default="grant",
        help="masters count a lease in kept_slots from its grant, or once its decode request went out",
    )
    p.add_argument(
        "--polling",
        choices=("all", "worth"),
        default="all",
        help="during a handover the agent polls every master, or those whose Ack can move it on",
    )
    p.add_argument(
        "--unsent-on-loss",
        dest="unsent_on_loss",
        choices=("send", "cancel"),
        default="send",
        help="a master that lost a node sends its leases' pending decode requests there, or cancels them",
    )
    args = p.parse_args()
    extra = knobs(args)
    if extra:
        print("with", ", ".join(f"{k}={v}" for k, v in extra.items()), flush=True)
    for policy in ("static", "demand"):
        for hold_s in (float(x) for x in args.holds.split(",")):
            over, unconverged = [], []
            for seed in range(args.seeds):
                sim = ProtocolSim(dataclasses.replace(config(policy, hold_s), **extra), seed)
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
