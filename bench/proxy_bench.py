"""Router overhead: the same pdsim P/D pair reached directly, through pdmaster and through sglang-router.

One prefill and one decode pdsim (``--fast`` timing, capacity 256 each so admission never throttles),
20 streamed tokens per request, closed-loop load at each concurrency from
``python -m pdcoord.dev.loadgen`` in its own process. Contenders, interleaved in a rotating order
inside every repetition:

* ``direct``: the load generator does the router's work itself (fresh bootstrap_room, the same body
  to P and D at once, stream from D): the floor any PD router is measured against.
* ``pdmaster``: one master with etcd and two node agents (one per engine) holding the full shares.
* ``pdmaster-asyncio``: the same master on the stock asyncio event loop (``--event-loop asyncio``)
  instead of uvloop, to show what the loop alone is worth.
* ``sglang-router``: ``sglang_router.launch_router --pd-disaggregation`` (installed by this script
  into bench/.venv-sglang-router), default policies.
* ``pdmaster-baseline`` (with ``--baseline REF``): the master of git revision REF (checked out into a
  temporary worktree and imported from there), same engines, same run: an A/B of a change.

Writes bench/results/proxy.json and bench/results/proxy.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from peers import (
    BENCH,
    CLK_TCK,
    RESULTS,
    baseline_env,
    checkout_baseline,
    environment,
    git_commit,
    median,
    pyplot,
    run_loadgen,
    write_json,
)

from pdcoord.dev.cluster import LocalCluster
from pdcoord.dev.etcd_server import LocalEtcd
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.dev.netutil import free_port

SGLANG_ROUTER_VERSION = "0.3.2"
SGLANG_VENV = BENCH / ".venv-sglang-router"
CAPACITY = 256


def ensure_sglang_router() -> tuple[str | None, str | None]:
    """(python of the sglang-router venv, None) or (None, the error that stopped us)."""
    py = SGLANG_VENV / "bin" / "python"
    check = [
        str(py),
        "-c",
        "import sglang_router, importlib.metadata as m; print(m.version('sglang-router'))",
    ]
    if py.exists():
        out = subprocess.run(check, capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip() == SGLANG_ROUTER_VERSION:
            return str(py), None
    steps = [
        [sys.executable, "-m", "venv", str(SGLANG_VENV)],
        [str(py), "-m", "pip", "install", "-q", f"sglang-router=={SGLANG_ROUTER_VERSION}"],
    ]
    for cmd in steps:
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            return None, f"{' '.join(cmd)} failed ({out.returncode}): {(out.stderr or out.stdout)[-1500:]}"
    return str(py), None


# A tokenizer for the served model, found in the router's working directory. sglang-router loads
# one at start-up and, finding no local folder named after the model, would try to download it.
# Word-level, two entries: pdsim's output is " tok<k>", and the router only needs to load it.
_TOKENIZER_JSON = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [
        {"id": 0, "content": "[UNK]", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True},
    ],
    "normalizer": None,
    "pre_tokenizer": {"type": "Whitespace"},
    "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "tok": 1}, "unk_token": "[UNK]"},
}  # fmt: skip


def sglang_router_home(model: str = "pdsim-model") -> Path:
    """A working directory for sglang-router holding ``<model>/tokenizer.json`` (pdsim's served
    model is ``pdsim-model`` unless told otherwise), so that it never reaches for the network."""
    home = Path(tempfile.gettempdir()) / "pdcoord-sglang-router-home"
    folder = home / model
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(_TOKENIZER_JSON))
    return home


def sglang_router_env() -> dict[str, str]:
    # Belt and braces beside the local tokenizer: no hub look-ups from anything it loads.
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def start_sglang_router(
    group: ProcessGroup,
    py: str,
    prefill: Any,
    decode: Any,
    extra_decode: Sequence[Any] = (),
    *,
    extra_prefill: Sequence[Any] = (),
    args: Sequence[str] = (),
    name: str = "sglang-router",
) -> tuple[str | None, int | None, str | None]:
    port = free_port()
    more = [arg for d in extra_decode for arg in ("--decode", d.url)]
    more_p = [arg for p in extra_prefill for arg in ("--prefill", p.url, str(p.bootstrap_port))]
    argv = [
        py, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", prefill.url, str(prefill.bootstrap_port), *more_p, "--decode", decode.url, *more,
        "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--log-level", "warn", *args,
    ]  # fmt: skip
    try:
        proc = group.start(
            name,
            argv,
            ready=f"http://127.0.0.1:{port}/health",
            ready_timeout=60,
            cwd=sglang_router_home(),
            env=sglang_router_env(),
        )
    except Exception as exc:
        return None, None, f"{type(exc).__name__}: {exc}"[-3000:]
    return f"http://127.0.0.1:{port}", proc.pid, None


def py_spy_profile(pid: int, seconds: float, out: Path) -> str | None:
    """Record pdmaster with py-spy (raw collapsed stacks); None when py-spy is missing."""
    exe = Path(sys.executable).parent / "py-spy"
    if not exe.exists():
        return None
    cmd = [
        str(exe),
        "record",
        "-p",
        str(pid),
        "-d",
        str(int(seconds)),
        "-r",
        "200",
        "-f",
        "raw",
        "-o",
        str(out),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid and str(out)


def top_frames(raw: Path, n: int = 25) -> list[tuple[str, float]]:
    """Self-time share of the hottest frames in a py-spy raw (collapsed) profile."""
    self_t: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        c = int(count)
        total += c
        leaf = stack.split(";")[-1]
        self_t[leaf] = self_t.get(leaf, 0) + c
    return [(k, round(v / total, 4)) for k, v in sorted(self_t.items(), key=lambda kv: -kv[1])[:n]]


# Where the master's main-thread samples go, first matching rule wins (leaf frame unless noted).
_SHARE_RULES: list[tuple[str, Callable[[list[str]], bool]]] = [
    ("uvloop/asyncio C code (epoll, reads, callbacks)", lambda f: f[-1].startswith("Runner.run")),
    ("writing streamed events to the client", lambda f: "relay_stream.<locals>.sink" in f[-1]),
    ("writing the engine requests", lambda f: f[-1].startswith("_Connection.send")),
    ("aiohttp's own writes (head, end of stream)", lambda f: "StreamWriter._write" in f[-1]),
    ("admission", lambda f: any("admission" in x for x in f)),
    ("engine client Python (pdmaster/engine/)", lambda f: any("/engine/" in x for x in f)),
    ("request path, own code (api, pipeline, routing, relay)",
     lambda f: any(k in f[-1] for k in ("api.py", "pipeline.py", "routing.py", "relay.py"))),
    ("aiohttp server (parsing, routing, request objects)", lambda f: "aiohttp" in f[-1]),
    ("JSON, validation, prefix index, metrics",
     lambda f: any(k in f[-1] for k in ("json", "validation", "prefix_index", "prometheus"))),
]  # fmt: skip


def profile_shares(raw: Path) -> dict[str, Any]:
    """Main-thread sample shares by category; py-spy's samples of helper threads are set apart."""
    counts: dict[str, int] = {}
    main_total = helper = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        c = int(count)
        frames = stack.split(";")
        if any(f.startswith("Thread.run") for f in frames):
            helper += c
            continue
        main_total += c
        name = next((n for n, rule in _SHARE_RULES if rule(frames)), "other")
        counts[name] = counts.get(name, 0) + c
    total = main_total + helper
    return {
        "helper_thread_sample_share": round(helper / total, 4) if total else None,
        "main_thread": {k: round(v / main_total, 4) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}
        if main_total
        else {},
    }


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (utime + stime) of each thread of *pid*, keyed "name/tid"."""
    out: dict[str, float] = {}
    base = Path(f"/proc/{pid}/task")
    for task in base.iterdir() if base.exists() else []:
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[f"{name}/{task.name}"] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,50,200", help="comma-separated concurrencies")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--contenders", default="direct,pdmaster,pdmaster-asyncio,sglang-router")
    p.add_argument(
        "--profile", action="store_true", help="py-spy pdmaster during one extra run at the top load"
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="REF",
        help="also run the master of git revision REF as contender pdmaster-baseline (A/B of a change)",
    )
    p.add_argument("--out", default="proxy.json")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--replot", action="store_true", help="only redraw the PNG from the --out JSON")
    args = p.parse_args()
    if args.replot:
        saved = json.loads((RESULTS / args.out).read_text())
        cfg = saved["config"]
        png = RESULTS / (Path(args.out).stem + ".png")
        plot(saved["summary"], cfg["concurrency"], cfg["contenders"], png)
        return
    concs = [int(x) for x in args.concurrency.split(",")]
    contenders = args.contenders.split(",")
    baseline_tree: str | None = None
    if args.baseline:
        baseline_tree = checkout_baseline(args.baseline)
        if "pdmaster-baseline" not in contenders:
            contenders.append("pdmaster-baseline")
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdcoord-proxybench-")
    env = environment()
    notes: dict[str, Any] = {}

    sgl_py: str | None = None
    if "sglang-router" in contenders:
        sgl_py, err = ensure_sglang_router()
        if err:
            notes["sglang_router_install_error"] = err
            contenders.remove("sglang-router")
            print("sglang-router unavailable:", err, file=sys.stderr)

    runs: list[dict[str, Any]] = []
    with LocalEtcd(log_path=f"{log_dir}/etcd.log") as etcd, ProcessGroup(log_dir) as group:
        c = LocalCluster(group, etcd.endpoint, "proxybench")
        c.start_master("m1")
        pre = c.start_node("p1", "prefill", CAPACITY)
        dec = c.start_node("d1", "decode", CAPACITY)
        c.wait_for(lambda: c.full_capacity_held(["m1"], {"p1": CAPACITY, "d1": CAPACITY}), timeout=30)
        urls: dict[str, list[str]] = {
            "direct": [
                "--prefill",
                pre.url,
                "--decode",
                dec.url,
                "--bootstrap-port",
                str(pre.bootstrap_port),
            ],
            "pdmaster": ["--url", c.masters["m1"].url],
        }
        router_pid: dict[str, int] = {"pdmaster": c.masters["m1"].proc.pid}
        if sgl_py is not None:
            url, pid, err = start_sglang_router(group, sgl_py, pre, dec)
            if err or url is None or pid is None:
                notes["sglang_router_start_error"] = err
                contenders.remove("sglang-router")
                print("sglang-router did not start:", err, file=sys.stderr)
            else:
                urls["sglang-router"] = ["--url", url]
                router_pid["sglang-router"] = pid
        if "pdmaster-asyncio" in contenders:
            # The same master on the stock asyncio loop, in a cluster of its own (agents "ap1"/"ad1"
            # on the same engines), so it holds the full capacity too: isolates the loop's share.
            c2 = LocalCluster(group, etcd.endpoint, "proxybench-asyncio")
            m2 = c2.start_master("a1", event_loop="asyncio")
            for node, eng in (("ap1", pre), ("ad1", dec)):
                c2.start_agent(
                    node, eng.role, endpoint=eng.url, capacity=CAPACITY, bootstrap_port=eng.bootstrap_port
                )
            c2.wait_for(lambda: c2.full_capacity_held(["a1"], {"ap1": CAPACITY, "ad1": CAPACITY}), timeout=30)
            urls["pdmaster-asyncio"] = ["--url", m2.url]
            router_pid["pdmaster-asyncio"] = m2.proc.pid
        if baseline_tree is not None:
            # The baseline's master in a cluster of its own (agents of today's code on the same
            # engines: the wire protocol is the same), importing pdmaster from the baseline tree.
            c3 = LocalCluster(group, etcd.endpoint, "proxybench-baseline")
            m3 = c3.start_master("b1", env={**os.environ, **baseline_env(baseline_tree)})
            for node, eng in (("bp1", pre), ("bd1", dec)):
                c3.start_agent(
                    node, eng.role, endpoint=eng.url, capacity=CAPACITY, bootstrap_port=eng.bootstrap_port
                )
            c3.wait_for(lambda: c3.full_capacity_held(["b1"], {"bp1": CAPACITY, "bd1": CAPACITY}), timeout=30)
            urls["pdmaster-baseline"] = ["--url", m3.url]
            router_pid["pdmaster-baseline"] = m3.proc.pid
            notes["baseline"] = {"ref": args.baseline, "commit": git_commit(args.baseline)}
        engines = {"prefill": pre.proc.pid, "decode": dec.proc.pid}
        print(f"cluster up; logs in {log_dir}; contenders {contenders}", flush=True)

        for rep in range(args.repeats):
            for ci, conc in enumerate(concs):
                k = (rep + ci) % len(contenders)
                order = contenders[k:] + contenders[:k]
                for name in order:
                    watch = dict(engines)
                    if name in router_pid:
                        watch["router"] = router_pid[name]
                    res = run_loadgen(
                        [*urls[name], "--concurrency", str(conc), "--duration", str(args.duration),
                         "--warmup", str(args.warmup), "--tokens", str(args.tokens), "--seed", str(rep)],
                        watch,
                    )  # fmt: skip
                    res.update(contender=name, repeat=rep)
                    n = max(1, res["completed_total"])
                    res["cpu_ms_per_request"] = {k2: round(v * 1000 / n, 4) for k2, v in res["cpu_s"].items()}
                    runs.append(res)
                    print(
                        f"rep {rep} c={conc:<4} {name:<14} rps {res['rps']:8.1f}  ttft p50 "
                        f"{res['ttft_ms']['p50'] or 0:7.2f} p99 {res['ttft_ms']['p99'] or 0:7.2f}  e2e p50 "
                        f"{res['e2e_ms']['p50'] or 0:7.2f}  router cpu ms/req "
                        f"{res['cpu_ms_per_request'].get('router', 0):.3f}  errors {res['errors']}",
                        flush=True,
                    )
        profile: dict[str, Any] | None = None
        if args.profile:
            raw = RESULTS / "proxy_profile.txt"
            started = py_spy_profile(router_pid["pdmaster"], args.duration, raw)
            if started:
                before = thread_cpu(router_pid["pdmaster"])
                run_loadgen(
                    [*urls["pdmaster"], "--concurrency", str(max(concs)), "--duration", str(args.duration),
                     "--warmup", "1"], {},
                )  # fmt: skip
                after = thread_cpu(router_pid["pdmaster"])
                time.sleep(2)
                # Which threads really used the CPU: py-spy may sample a blocked helper thread.
                threads = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
                profile = (
                    {"file": raw.name, "top_self": top_frames(raw), "shares": profile_shares(raw),
                     "thread_cpu_s": threads}
                    if raw.exists() else None
                )  # fmt: skip
            else:
                notes["profile"] = "py-spy not installed (pip install -e '.[bench]')"

    summary = summarise(runs, concs, contenders)
    data = {
        "benchmark": "proxy",
        "environment": env,
        "config": {
            "concurrency": concs,
            "repeats": args.repeats,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "tokens": args.tokens,
            "engine_capacity": CAPACITY,
            "pdsim": "--fast",
            "sglang_router_version": SGLANG_ROUTER_VERSION if sgl_py else None,
            "contenders": contenders,
        },
        "notes": notes,
        "summary": summary,
        "profile": profile,
        "runs": runs,
    }
    path = write_json(args.out, data)
    print(f"wrote {path}")
    print_table(summary, concs, contenders)
    plot(summary, concs, contenders, RESULTS / (Path(args.out).stem + ".png"))


def summarise(runs: list[dict[str, Any]], concs: list[int], contenders: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for conc in concs:
        row: dict[str, Any] = {}
        for name in contenders:
            rs = [r for r in runs if r["concurrency"] == conc and r["contender"] == name]
            row[name] = {
                "rps": median([r["rps"] for r in rs]),
                "ttft_p50_ms": median([r["ttft_ms"]["p50"] for r in rs]),
                "ttft_p99_ms": median([r["ttft_ms"]["p99"] for r in rs]),
                "e2e_p50_ms": median([r["e2e_ms"]["p50"] for r in rs]),
                "e2e_p99_ms": median([r["e2e_ms"]["p99"] for r in rs]),
                "router_cpu_ms_per_req": median([r["cpu_ms_per_request"].get("router") for r in rs]),
                "engines_cpu_ms_per_req": median(
                    [r["cpu_ms_per_request"]["prefill"] + r["cpu_ms_per_request"]["decode"] for r in rs]
                ),
                "errors": sum(r["errors"] for r in rs),
            }
        # ratios measured inside the same repetition, then the median over repetitions
        ratios: dict[str, Any] = {}
        reps = sorted({r["repeat"] for r in runs})

        def same_rep(a: str, b: str, key: Any, conc: int = conc, reps: list[int] = reps) -> float | None:
            vals = []
            for rep in reps:
                ra = [
                    r for r in runs if r["concurrency"] == conc and r["contender"] == a and r["repeat"] == rep
                ]
                rb = [
                    r for r in runs if r["concurrency"] == conc and r["contender"] == b and r["repeat"] == rep
                ]
                if ra and rb:
                    va, vb = key(ra[0]), key(rb[0])
                    if va is not None and vb:
                        vals.append(va / vb)
            return median(vals)

        def diff_ms(a: str, b: str, conc: int = conc, reps: list[int] = reps) -> float | None:
            vals = []
            for rep in reps:
                ra = [
                    r for r in runs if r["concurrency"] == conc and r["contender"] == a and r["repeat"] == rep
                ]
                rb = [
                    r for r in runs if r["concurrency"] == conc and r["contender"] == b and r["repeat"] == rep
                ]
                if ra and rb and ra[0]["ttft_ms"]["p50"] is not None and rb[0]["ttft_ms"]["p50"] is not None:
                    vals.append(ra[0]["ttft_ms"]["p50"] - rb[0]["ttft_ms"]["p50"])
            return median(vals)

        if "direct" in contenders and "pdmaster" in contenders:
            ratios["pdmaster_minus_direct_ttft_p50_ms"] = diff_ms("pdmaster", "direct")
            ratios["pdmaster_over_direct_rps"] = same_rep("pdmaster", "direct", lambda r: r["rps"])
        if "pdmaster-asyncio" in contenders and "pdmaster" in contenders:
            ratios["uvloop_over_asyncio_cpu_per_req"] = same_rep(
                "pdmaster", "pdmaster-asyncio", lambda r: r["cpu_ms_per_request"].get("router")
            )
            ratios["uvloop_over_asyncio_rps"] = same_rep("pdmaster", "pdmaster-asyncio", lambda r: r["rps"])
        if "sglang-router" in contenders and "pdmaster" in contenders:
            ratios["pdmaster_over_sglang_rps"] = same_rep("pdmaster", "sglang-router", lambda r: r["rps"])
            ratios["pdmaster_over_sglang_cpu_per_req"] = same_rep(
                "pdmaster", "sglang-router", lambda r: r["cpu_ms_per_request"].get("router")
            )
            ratios["sglang_minus_direct_ttft_p50_ms"] = (
                diff_ms("sglang-router", "direct") if "direct" in contenders else None
            )
        row["ratios"] = ratios
        out[str(conc)] = row
    return out


def print_table(summary: dict[str, Any], concs: list[int], contenders: list[str]) -> None:
    print("| concurrency | contender | req/s | TTFT p50 / p99 ms | e2e p50 / p99 ms | router CPU ms/req |")
    print("|---|---|---|---|---|---|")
    for conc in concs:
        for name in contenders:
            s = summary[str(conc)][name]

            def f(x: float | None, d: int = 2) -> str:
                return "-" if x is None else f"{x:.{d}f}"

            print(
                f"| {conc} | {name} | {f(s['rps'], 1)} | {f(s['ttft_p50_ms'])} / {f(s['ttft_p99_ms'])} | "
                f"{f(s['e2e_p50_ms'])} / {f(s['e2e_p99_ms'])} | {f(s['router_cpu_ms_per_req'], 3)} |"
            )
        print(f"| {conc} | ratios | {summary[str(conc)]['ratios']} |||||")


def plot(summary: dict[str, Any], concs: list[int], contenders: list[str], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.0), dpi=80)
    width = 0.8 / len(contenders)
    metrics = [
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("rps", "requests/s"),
        ("router_cpu_ms_per_req", "router CPU ms/req"),
    ]
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for i, name in enumerate(contenders):
            vals = [summary[str(c)][name][key] or 0 for c in concs]
            ax.bar([j + i * width for j in range(len(concs))], vals, width, label=name)
        ax.set_xticks([j + width * (len(contenders) - 1) / 2 for j in range(len(concs))])
        ax.set_xticklabels([f"c={c}" for c in concs])
        ax.set_title(title, fontsize=10)
        if key == "ttft_p50_ms":
            ax.set_yscale("log")  # c=1 (ms) and c=200 (hundreds of ms) on one axis
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
