"""What renewing a lease costs the client: N leases kept alive by ``LeaseKeeper`` on one client,
against a local etcd, renewed every ``--interval`` seconds; client CPU-seconds per renewal.

Every master and agent renews its lease every TTL/3 (1.7 s by default); a fleet's agents and etcd
pay for it per node. ``--baseline REF`` also runs the same measurement on the ``pdcoord`` package of
git revision REF (a worktree under the temp dir), alternating runs in the same minutes:

    .venv/bin/python bench/lease_renew_bench.py
    .venv/bin/python bench/lease_renew_bench.py --baseline 0b54f1d --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from peers import RESULTS, ROOT, checkout_baseline, environment, git_commit

from pdcoord.dev.etcd_server import LocalEtcd

ONE_RUN = """
import asyncio, json, sys, time
sys.path.insert(0, sys.argv[1])
from pdcoord.etcd import EtcdClient
from pdcoord.registration import LeaseKeeper

async def main(endpoint, leases, interval, seconds):
    async with EtcdClient([endpoint]) as client:
        ids = [await client.grant_lease(10) for _ in range(leases)]
        keepers = [LeaseKeeper(client, i, 10, interval=interval).start() for i in ids]
        await asyncio.sleep(1.0)
        r0, c0, w0 = sum(k.renewals for k in keepers), time.process_time(), time.monotonic()
        await asyncio.sleep(seconds)
        r1, c1, w1 = sum(k.renewals for k in keepers), time.process_time(), time.monotonic()
        for k in keepers:
            await k.stop()
        for i in ids:
            await client.revoke_lease(i)
    print(json.dumps({"renewals_per_s": round((r1 - r0) / (w1 - w0), 1),
                      "client_cpu_us_per_renewal": round((c1 - c0) / (r1 - r0) * 1e6)}))

asyncio.run(main(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])))
"""


def _run(root: Path, endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, "-c", ONE_RUN, str(root), endpoint]
    argv += [str(args.leases), str(args.interval), str(args.seconds)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=args.seconds + 120, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--leases", type=int, default=100)
    p.add_argument("--interval", type=float, default=0.2, help="seconds between one lease's renewals")
    p.add_argument("--seconds", type=float, default=10.0, help="measuring window per run")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--baseline", help="also measure the pdcoord of this git revision (A/B of a change)")
    p.add_argument("--out", type=Path, default=RESULTS / "lease_renew.json")
    args = p.parse_args()
    variants = {f"this tree ({git_commit('HEAD')[:7]})": ROOT}
    if args.baseline:
        variants[f"baseline ({git_commit(args.baseline)[:7]})"] = Path(checkout_baseline(args.baseline))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with LocalEtcd() as etcd:
        for _ in range(args.runs):
            for name, root in variants.items():
                result = _run(root, etcd.endpoint, args)
                runs[name].append(result)
                print(name, json.dumps(result), flush=True)
    summary = {
        name: {
            "median_client_cpu_us_per_renewal": statistics.median(r["client_cpu_us_per_renewal"] for r in rs),
            "median_renewals_per_s": statistics.median(r["renewals_per_s"] for r in rs),
            "runs": rs,
        }
        for name, rs in runs.items()
    }
    result = {
        "environment": environment(),
        "command": " ".join(sys.argv),
        "leases": args.leases,
        "interval_s": args.interval,
        "seconds": args.seconds,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "variants": summary,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
