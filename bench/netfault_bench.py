"""Network faults: how long until the masters that can still reach a node hold all of it, and how long
after the heal until every master is back at its exact share.

The fleet and the scenarios are the cluster tests' (``tests/cluster/netfault.py``): etcd behind a
fault proxy, masters m1 and m2, p1 (8 slots) and d1, d2 (6 decode slots each), every process in its
own network namespace behind a routing hub; the agents split statically. 20 closed-loop clients send
requests through both masters; each fault lasts ``--cut`` seconds, then heals. Per scenario and run:

* ``survivors_full_s``: from the fault to the masters that still reach each node holding all of it
  (null: not within the fault — a cut-off master's slots stay reserved until an engine sample proves
  them free or ``--orphan-timeout`` passes);
* ``survivors_free_s``: from the fault to those masters holding every slot of each node that the other
  masters' leases do not run (what is left of a cut-off master's requests keeps its slots until they end);
* ``full_after_heal_s``: from the heal to the exact split on every master;
* the least decode capacity each master had during the fault, the outcomes of the requests, the
  decode engines' over-capacity events (must be 0) and, for the slow etcd, the failover and join times
  with etcd at 300 ms ± 200 ms.

``--tokens 12-20`` (0.3-0.5 s requests at the default 25 ms step) is the tests' load; ``--tokens
200-300`` makes long requests (5-7.5 s). Needs root, ``ip`` and ``nft``. Writes
bench/results/netfault.json (``--out``).

    .venv/bin/python bench/netfault_bench.py --runs 3
    .venv/bin/python bench/netfault_bench.py --runs 1 --tokens 200-300 --out netfault_long.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any

from peers import ROOT, environment, write_json

sys.path.insert(0, str(ROOT))

from tests.cluster import netfault
from tests.cluster.netfault import HAZARDS, SCENARIOS, fleet_in_namespaces, run_scenario


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def _stats(values: list[float | None]) -> dict[str, Any]:
    got = [v for v in values if v is not None]
    return {
        "runs": len(values),
        "reached": len(got),
        "median": round(statistics.median(got), 2) if got else None,
        "min": min(got) if got else None,
        "max": max(got) if got else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=3, help="fleets, one after another (default 3)")
    p.add_argument("--cut", type=float, default=10.0, help="seconds each fault lasts (default 10)")
    p.add_argument(
        "--tokens", type=_range, default=(12, 20), help="tokens per request, LO-HI (default 12-20)"
    )
    p.add_argument("--users", type=int, default=20, help="closed-loop clients (default 20)")
    p.add_argument(
        "--scenario",
        action="append",
        choices=[*SCENARIOS, *HAZARDS],
        help="only these (repeatable; the hazards run only when named)",
    )
    p.add_argument("--orphan-timeout", type=float, default=None, help="the agents' --orphan-timeout")
    p.add_argument("--out", default="netfault.json", help="file name under bench/results")
    args = p.parse_args()
    reason = netfault.unavailable()
    if reason:
        sys.exit(f"netfault_bench: {reason}")
    names = args.scenario or list(SCENARIOS)
    agent_extra = {} if args.orphan_timeout is None else {"orphan_timeout": args.orphan_timeout}
    runs: list[dict[str, Any]] = []
    started = time.time()
    for run in range(args.runs):
        with (
            tempfile.TemporaryDirectory(prefix="netfault-bench-") as tmp,
            fleet_in_namespaces(tmp, f"netfault-bench-{run}", agent_extra=agent_extra) as fleet,
        ):
            for name in names:
                what, apply = {**SCENARIOS, **HAZARDS}[name]
                result = run_scenario(
                    fleet, name, what, apply, cut_s=args.cut, users=args.users, tokens=args.tokens
                )
                runs.append({"run": run, **result.as_json()})
    summary: dict[str, Any] = {}
    for name in names:
        rs = [r for r in runs if r["name"] == name]
        summary[name] = {
            "what": rs[0]["what"],
            "survivors_full_s": _stats([r["survivors_full_s"] for r in rs]),
            "survivors_free_s": _stats([r.get("survivors_free_s") for r in rs]),
            "full_after_heal_s": _stats([r["full_after_heal_s"] for r in rs]),
            "over_capacity": sum(sum(r["over_capacity"].values()) for r in rs),
            "bad_requests": sum(len(r["bad"]) for r in rs),
            "requests": sum(r["requests"] for r in rs),
        }
        if name == "slow_etcd":
            for key in ("failover_s", "join_s"):
                summary[name][key] = _stats([r["notes"].get(key) for r in rs])
    out = {
        "benchmark": "netfault",
        "command": " ".join([".venv/bin/python", "bench/netfault_bench.py", *sys.argv[1:]]),
        "environment": environment(),
        "config": {
            "runs": args.runs,
            "cut_s": args.cut,
            "tokens": list(args.tokens),
            "decode_step_ms": netfault.DECODE_STEP_MS,
            "users": args.users,
            "capacities": netfault.CAPS,
            "masters": netfault.MASTERS,
            "agent_extra": agent_extra,
        },
        "elapsed_s": round(time.time() - started, 1),
        "summary": summary,
        "runs": runs,
    }
    path = write_json(args.out, out)
    print(f"wrote {path}")
    for name, s in summary.items():
        print(
            f"{name:26s} survivors full {s['survivors_full_s']}  all free {s['survivors_free_s']}  "
            f"after heal {s['full_after_heal_s']}  "
            f"over capacity {s['over_capacity']}  bad {s['bad_requests']} of {s['requests']}"
        )


if __name__ == "__main__":
    main()
