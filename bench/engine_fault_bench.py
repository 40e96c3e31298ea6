"""A decode engine dies under load: pdmaster and sglang-router side by side.

One prefill and two decode pdsim engines (SGLang flavour, ``/metrics`` on), closed-loop clients
(the shared load generator, cold and shared-prefix prompts, streamed and not, no gangs). After a
warm-up, decode engine ``d2`` is SIGKILLed (its node agent stays up), kept down ``--down`` seconds,
then restarted on the same port. The same fleet and load run through:

* ``pdmaster``: one master, an agent beside every engine (engine health checks, the master's
  per-engine circuit breaker, retry before the first byte);
* ``sglang-router``: ``sglang_router.launch_router --pd-disaggregation`` with its default health
  checks and circuit breaker (installed into bench/.venv-sglang-router by bench/proxy_bench.py's
  helper).

Measured per contender (``--trials`` runs each, interleaved): requests that failed (anything but 200
or 429) in all and after the first 3 s of the fault; time to exclude (the last failure that started
after the kill, relative to the kill); time to readmit (the first request d2 answers after its
restart, from d2's own request log); goodput (successful requests per second) before, during and after
the fault. Writes bench/results/engine_fault.json and bench/results/engine_fault.png.

    .venv/bin/python bench/engine_fault_bench.py            # about 4 minutes
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
import urllib.request
from typing import Any

from peers import RESULTS, environment, median, pyplot, write_json
from proxy_bench import SGLANG_ROUTER_VERSION, ensure_sglang_router, start_sglang_router

from pdcoord.dev.cluster import LocalCluster
from pdcoord.dev.etcd_server import LocalEtcd
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.dev.loadgen import BackgroundLoad, LoadConfig, Outcome, RequestMix

CAPACITY = {"p1": 16, "d1": 8, "d2": 8}
ENGINE_ARGS = {"api": "sglang", "decode_base_ms": 20}


def d2_requests(url: str) -> int:
    """Requests d2 has received since its (re)start, from its own request log."""
    try:
        with urllib.request.urlopen(url + "/admin/requests", timeout=2) as r:
            return int(json.loads(r.read())["total"])
    except OSError:
        return -1


def run_trial(contender: str, trial: int, args: argparse.Namespace, sgl_py: str | None) -> dict[str, Any]:
    log_dir = tempfile.mkdtemp(prefix=f"pdcoord-faultbench-{contender}-")
    with LocalEtcd(log_path=f"{log_dir}/etcd.log") as etcd, ProcessGroup(log_dir) as group:
        c = LocalCluster(group, etcd.endpoint, f"faultbench-{trial}")
        engines = {}
        for name, cap in CAPACITY.items():
            role = "prefill" if name.startswith("p") else "decode"
            if contender == "pdmaster":
                engines[name] = c.start_node(name, role, cap, model="sim", engine_args=ENGINE_ARGS)
            else:
                engines[name] = c.start_engine(name, role, cap, **ENGINE_ARGS)
        if contender == "pdmaster":
            c.start_master("m1", model="sim")
            c.wait_for(lambda: c.full_capacity_held(["m1"], CAPACITY), timeout=60)
            url = c.masters["m1"].url
        else:
            assert sgl_py is not None
            url, _pid, err = start_sglang_router(
                group, sgl_py, engines["p1"], engines["d1"], extra_decode=[engines["d2"]]
            )
            if err or url is None:
                raise RuntimeError(f"sglang-router did not start: {err}")
        mix = RequestMix(weights={"cold": 0.5, "shared_prefix": 0.5}, max_tokens=12, stream_fraction=0.7)
        load = BackgroundLoad(
            lambda: [("router", url)],
            LoadConfig(users=args.users, seed=trial, request_timeout_s=60, mix=mix),
        ).start()
        time.sleep(args.warmup)
        d2 = engines["d2"]
        killed = time.monotonic()
        d2.proc.send_signal(signal.SIGKILL)
        d2.proc.wait(10)
        time.sleep(args.down)
        restarted = time.monotonic()
        d2.proc.start()
        readmitted: float | None = None
        deadline = restarted + args.after
        while time.monotonic() < deadline:
            if readmitted is None and d2_requests(d2.url) > 0:
                readmitted = time.monotonic()
            time.sleep(0.05)
        outcomes = load.stop()
    return summarise_trial(contender, trial, outcomes, killed, restarted, readmitted, args)


def summarise_trial(
    contender: str,
    trial: int,
    outcomes: list[Outcome],
    killed: float,
    restarted: float,
    readmitted: float | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    def failed(o: Outcome) -> bool:
        return o.status not in (200, 429) or bool(o.error)

    start = killed - args.warmup
    during = [o for o in outcomes if killed <= o.started < restarted]
    fails = [o for o in outcomes if failed(o)]
    late_fails = [o for o in fails if o.started >= killed + 3.0 and o.started < restarted]
    fault_fails = [o for o in fails if o.started >= killed - 0.5]
    last_fail = max((o.started for o in fault_fails if o.started < restarted), default=None)

    def goodput(lo: float, hi: float) -> float:
        ok = [o for o in outcomes if o.ok and lo <= o.ended < hi]
        return round(len(ok) / max(hi - lo, 1e-9), 2)

    timeline = [
        {
            "t": round(t - killed, 2),
            "ok": sum(1 for o in outcomes if o.ok and t <= o.ended < t + 0.5),
            "failed": sum(1 for o in fails if t <= o.ended < t + 0.5),
        }
        for t in [start + 0.5 * i for i in range(int((restarted + args.after - start) / 0.5))]
    ]
    return {
        "contender": contender,
        "trial": trial,
        "requests": len(outcomes),
        "failed_total": len(fault_fails),
        "failed_after_3s": len(late_fails),
        "failed_statuses": sorted({o.status for o in fault_fails}),
        "time_to_exclude_s": round(last_fail - killed, 2) if last_fail is not None else 0.0,
        "time_to_readmit_s": round(readmitted - restarted, 2) if readmitted is not None else None,
        "goodput_rps": {
            "before": goodput(start, killed),
            "during": goodput(killed, restarted),
            "after": goodput(restarted + 2.0, restarted + args.after),
        },
        "requests_during_fault": len(during),
        "timeline": timeline,
    }


def plot(runs: list[dict[str, Any]], path: Any) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for ax, contender in zip(axes, ("pdmaster", "sglang-router"), strict=True):
        run = next((r for r in runs if r["contender"] == contender), None)
        if run is None:
            continue
        ts = [p["t"] for p in run["timeline"]]
        ax.plot(ts, [p["ok"] * 2 for p in run["timeline"]], label="200 per s")
        ax.plot(ts, [p["failed"] * 2 for p in run["timeline"]], label="failed per s", color="tab:red")
        ax.axvline(0, color="grey", linestyle="--")
        ax.set_title(f"{contender} (d2 killed at 0 s)")
        ax.set_xlabel("seconds from the kill")
        ax.legend(loc="upper right")
    axes[0].set_ylabel("requests per second")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--users", type=int, default=10)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--down", type=float, default=10.0, help="seconds the engine stays down")
    p.add_argument("--after", type=float, default=12.0, help="seconds measured after the restart")
    p.add_argument("--contenders", default="pdmaster,sglang-router")
    p.add_argument("--out", default="engine_fault.json")
    args = p.parse_args()
    contenders = args.contenders.split(",")
    notes: dict[str, Any] = {}
    sgl_py: str | None = None
    if "sglang-router" in contenders:
        sgl_py, err = ensure_sglang_router()
        if err:
            notes["sglang_router_install_error"] = err
            contenders.remove("sglang-router")
    runs = []
    for trial in range(args.trials):
        for contender in contenders if trial % 2 == 0 else contenders[::-1]:
            run = run_trial(contender, trial, args, sgl_py)
            runs.append(run)
            print(
                f"trial {trial} {contender:<14} failed {run['failed_total']:5d} (after 3 s: "
                f"{run['failed_after_3s']:4d})  exclude {run['time_to_exclude_s']:6.2f} s  readmit "
                f"{run['time_to_readmit_s']} s  goodput {run['goodput_rps']}",
                flush=True,
            )
    summary = {}
    for contender in contenders:
        mine = [r for r in runs if r["contender"] == contender]
        summary[contender] = {
            key: median([r[key] for r in mine if r[key] is not None])
            for key in ("failed_total", "failed_after_3s", "time_to_exclude_s", "time_to_readmit_s")
        } | {
            f"goodput_{phase}_rps": median([r["goodput_rps"][phase] for r in mine])
            for phase in ("before", "during", "after")
        }
    data = {
        "benchmark": "engine_fault",
        "environment": environment(),
        "config": {
            "capacity": CAPACITY,
            "engine_args": ENGINE_ARGS,
            "users": args.users,
            "warmup_s": args.warmup,
            "down_s": args.down,
            "after_s": args.after,
            "trials": args.trials,
            "sglang_router_version": SGLANG_ROUTER_VERSION if sgl_py else None,
        },
        "notes": notes,
        "summary": summary,
        "runs": runs,
    }
    path = write_json(args.out, data)
    print(json.dumps(summary, indent=1))
    plot(runs, RESULTS / "engine_fault.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
