"""Failover time: SIGKILL one of two masters under load; how long until the survivor holds everything.

Fleet: 1 prefill (64 slots) + 2 decode (32 slots each) pdsim engines, each with its node agent;
two masters with the default lease TTL (5 s). Per trial: streamed load through both masters
(``python -m pdcoord.dev.loadgen``, its own process), SIGKILL one master, then poll the survivor's
``GET /admission`` every 10 ms until its effective share on every node equals the node's capacity.
A fresh master (new id) then joins and the next trial waits for the even split again.

Two agent configurations, each in its own cluster:

* ``stream``: production defaults (``--grace 1``): an agent drops a master whose gRPC stream has
  been down for 1 s, so the share moves as soon as the stream breaks plus the grace.
* ``stream-fast``: the same with ``--handover fast``: the dead master's slots move at once instead
  of waiting for an engine sample that shows its requests ended (strict handover, the default).
* ``stream-no-gone-on-refusal``: the defaults with ``--no-gone-on-refusal``: the refused connection to
  the killed master's address proves nothing (for networks whose firewalls reject rather than drop),
  so its share moves after the grace, once engine samples bracketed by the survivor's Acks show its
  requests ended, or when its key expires.
* ``lease-only``: ``--grace 1000000``: stream-based exclusion is off in effect; the share moves
  only when the dead master's etcd key goes away with its lease (TTL 5 s).

Writes bench/results/failover.json and bench/results/failover.png. ``--baseline REF`` runs every mode
a second time with the masters and agents of that git revision (each mode's baseline right before it,
in the same run), for an A/B of a change; ``--out NAME`` writes elsewhere under bench/results.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from peers import RESULTS, baseline_env, checkout_baseline, environment, git_commit, pyplot, write_json

from pdcoord.dev.cluster import LocalCluster
from pdcoord.dev.etcd_server import LocalEtcd
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.dev.loadgen import percentile

FLEET = {"p1": ("prefill", 64), "d1": ("decode", 32), "d2": ("decode", 32)}
MODES = {
    "stream": {},
    "stream-fast": {"handover": "fast"},
    "stream-no-gone-on-refusal": {"no_gone_on_refusal": True},
    "lease-only": {"grace": 1_000_000},
}


def holds_all(c: LocalCluster, master: str, caps: dict[str, int]) -> bool:
    shares = c.masters[master].shares()
    return all(shares.get(n, 0) == cap for n, cap in caps.items())


def run_mode(mode: str, trials: int, concurrency: int, log_dir: str) -> dict[str, Any]:
    caps = {n: cap for n, (_, cap) in FLEET.items()}
    times: list[float] = []
    with LocalEtcd(log_path=f"{log_dir}/etcd.log") as etcd, ProcessGroup(log_dir) as group:
        c = LocalCluster(group, etcd.endpoint, f"failover-{mode}")
        live = ["m0", "m1"]
        for m in live:
            c.start_master(m)
        for name, (role, cap) in FLEET.items():
            c.start_node(name, role, cap, **MODES[mode])
        c.wait_for(lambda: c.full_capacity_held(live, caps), timeout=30)
        next_id = 2
        for t in range(trials):
            victim, survivor = live[t % 2], live[1 - t % 2]
            urls = ",".join(c.masters[m].url for m in live)
            load = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pdcoord.dev.loadgen",
                    "--url",
                    urls,
                    "--concurrency",
                    str(concurrency),
                    "--duration",
                    "60",
                    "--warmup",
                    "0",
                    "--tokens",
                    "20",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                time.sleep(1.0)  # load is flowing through both masters
                c.masters[victim].proc.kill()
                t0 = time.monotonic()
                c.wait_for(lambda s=survivor: holds_all(c, s, caps), timeout=30, interval=0.01)
                dt = time.monotonic() - t0
            finally:
                load.terminate()
                load.wait(10)
            times.append(dt)
            print(
                f"{mode:<10} trial {t + 1:>2}/{trials}: killed {victim}, "
                f"{survivor} held all after {dt:.3f} s",
                flush=True,
            )
            # a fresh master takes the victim's place; wait for the even split before the next trial
            new = f"m{next_id}"
            next_id += 1
            c.start_master(new)
            # survivor first: the next trial (odd/even) kills the newcomer, then the veteran
            live = [survivor, new]
            c.wait_for(lambda lv=list(live): c.full_capacity_held(lv, caps), timeout=30)
    return {
        "trials": len(times),
        "seconds": [round(x, 4) for x in times],
        "p50_s": percentile(times, 50),
        "p99_s": percentile(times, 99),
        "min_s": min(times),
        "max_s": max(times),
    }


@contextlib.contextmanager
def _code_of(tree: str) -> Any:
    """The processes started meanwhile (masters, agents, engines, load) import the code in ``tree``."""
    env = baseline_env(tree)
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=16, help="load generator concurrency")
    p.add_argument("--modes", default="stream,stream-fast,lease-only")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--baseline", help="also run every mode with the code of this git revision (A/B)")
    p.add_argument("--out", default="failover.json", help="file name under bench/results")
    args = p.parse_args()
    log_root = args.log_dir or tempfile.mkdtemp(prefix="pdcoord-failover-")
    env = environment()
    results: dict[str, Any] = {}
    base = checkout_baseline(args.baseline) if args.baseline else None
    for mode in args.modes.split(","):
        if base is not None:
            label = f"{mode} (baseline {git_commit(args.baseline)[:7]})"
            with _code_of(base):
                results[label] = run_mode(mode, args.trials, args.concurrency, f"{log_root}/{mode}-baseline")
        results[mode] = run_mode(mode, args.trials, args.concurrency, f"{log_root}/{mode}")
    data = {
        "benchmark": "failover",
        "environment": env,
        "config": {
            "fleet": {n: {"role": r, "capacity": cap} for n, (r, cap) in FLEET.items()},
            "masters": 2,
            "lease_ttl_s": 5,
            "agent_flags": MODES,
            "load_concurrency": args.concurrency,
            "poll_interval_s": 0.01,
        },
        "results": results,
    }
    path = write_json(args.out, data)
    print(f"wrote {path}")
    print("| agents | trials | p50 s | p99 s | min s | max s |")
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(
            f"| {mode} | {r['trials']} | {r['p50_s']:.3f} | {r['p99_s']:.3f} | "
            f"{r['min_s']:.3f} | {r['max_s']:.3f} |"
        )
    plot(results, args.out.rsplit(".", 1)[0] + ".png")


def plot(results: dict[str, Any], name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 2.6), dpi=80)
    names = list(results)
    for i, n in enumerate(names, start=1):
        secs = results[n]["seconds"]
        ax.plot(secs, [i] * len(secs), "|", markersize=14, label="trials" if i == 1 else None)
        ax.plot([results[n]["p50_s"]], [i], "o", color="black", label="p50" if i == 1 else None)
    ax.set_yticks(range(1, len(names) + 1), names)
    ax.set_ylim(0.5, len(names) + 0.5)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds from SIGKILL until the survivor holds all capacity")
    fig.tight_layout()
    fig.savefig(RESULTS / name)
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
