"""What an agent standing in its engine's door would cost: every decode request and streamed token
through one more HTTP hop beside the engine.

Why. Under an asymmetric cut (a master cut from an agent but not from the engine) the agent infers a
cut-off master's requests in flight from engine samples, which turnover of short requests defeats
(bench/README.md, *Network faults*). An agent that relayed its engine's traffic would know each
master's requests exactly and could refuse what exceeds a share at the door. This measures the price
before anyone builds it: the same master and pdsim pair (``--fast``, capacity 256 so nothing throttles)
with the decode engine reached directly (``pdmaster``) and through a minimal door (``pdmaster-door``:
an aiohttp server and client that pass each request on and stream the answer back chunk by chunk,
counting requests in flight per master, nothing else). Closed-loop load, interleaved contenders; CPU of
master, door and engines per request, and per streamed token from two answer lengths.

    .venv/bin/python bench/door_bench.py          # → bench/results/door.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
from typing import Any

from peers import environment, median, run_loadgen, write_json

from pdcoord.dev.cluster import LocalCluster
from pdcoord.dev.etcd_server import LocalEtcd
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.dev.netutil import free_port, port_open

CAPACITY = 256
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def serve_door(upstream: str, port: int) -> None:
    """The door: pass every request on to ``upstream`` and stream the answer back."""
    import aiohttp
    from aiohttp import web

    in_flight: collections.Counter[str] = collections.Counter()

    async def handle(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        master = request.headers.get("X-Request-Id", "?")[:16]  # the master's id prefix
        in_flight[master] += 1
        try:
            body = await request.read()
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
            async with session.request(
                request.method, upstream + request.path_qs, data=body, headers=headers
            ) as up:
                resp = web.StreamResponse(
                    status=up.status,
                    headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP},
                )
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        finally:
            in_flight[master] -= 1

    async def session_ctx(app: web.Application) -> Any:
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)
        )
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", handle)
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="50,200")
    p.add_argument("--tokens", default="20,200", help="answer lengths (two give the cost per token)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=1.5)
    p.add_argument("--out", default="door.json")
    p.add_argument("--serve-door", nargs=2, metavar=("UPSTREAM", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_door:
        serve_door(args.serve_door[0], int(args.serve_door[1]))
        return
    concs = [int(x) for x in args.concurrency.split(",")]
    token_counts = [int(x) for x in args.tokens.split(",")]
    contenders = ["pdmaster", "pdmaster-door"]
    log_dir = tempfile.mkdtemp(prefix="pdcoord-doorbench-")
    runs: list[dict[str, Any]] = []
    with LocalEtcd(log_path=f"{log_dir}/etcd.log") as etcd, ProcessGroup(log_dir) as group:
        pre_direct = LocalCluster(group, etcd.endpoint, "door-direct")
        pre = pre_direct.start_engine("p1", "prefill", CAPACITY)
        dec = pre_direct.start_engine("d1", "decode", CAPACITY)
        door_port = free_port()
        door = group.start(
            "door",
            [sys.executable, __file__, "--serve-door", dec.url, str(door_port)],
            ready=lambda: port_open("127.0.0.1", door_port),
        )
        urls: dict[str, str] = {}
        pids: dict[str, int] = {}
        for name, dec_endpoint in (("pdmaster", dec.url), ("pdmaster-door", f"http://127.0.0.1:{door_port}")):
            c = LocalCluster(group, etcd.endpoint, f"door-{name}")
            mid = "m-" + name.replace("pdmaster-", "").replace("pdmaster", "direct")
            m = c.start_master(mid)
            c.start_agent(
                f"p-{mid}", "prefill", endpoint=pre.url, capacity=CAPACITY, bootstrap_port=pre.bootstrap_port
            )
            c.start_agent(
                f"d-{mid}",
                "decode",
                endpoint=dec_endpoint,
                capacity=CAPACITY,
                bootstrap_port=dec.bootstrap_port,
            )
            c.wait_for(
                lambda c=c, mid=mid: c.full_capacity_held(
                    [mid], {f"p-{mid}": CAPACITY, f"d-{mid}": CAPACITY}
                ),
                timeout=30,
            )
            urls[name] = m.url
            pids[name] = m.proc.pid
        print(f"cluster up; logs in {log_dir}", flush=True)
        for rep in range(args.repeats):
            for ti, tokens in enumerate(token_counts):
                for ci, conc in enumerate(concs):
                    order = contenders if (rep + ti + ci) % 2 == 0 else contenders[::-1]
                    for name in order:
                        watch = {"master": pids[name], "prefill": pre.proc.pid, "decode": dec.proc.pid}
                        if name == "pdmaster-door":
                            watch["door"] = door.pid
                        res = run_loadgen(
                            ["--url", urls[name], "--concurrency", str(conc),
                             "--duration", str(args.duration), "--warmup", str(args.warmup),
                             "--tokens", str(tokens), "--seed", str(rep)],
                            watch,
                        )  # fmt: skip
                        n = max(1, res["completed_total"])
                        res.update(contender=name, repeat=rep, tokens=tokens)
                        res["cpu_ms_per_request"] = {
                            k: round(v * 1000 / n, 4) for k, v in res["cpu_s"].items()
                        }
                        runs.append(res)
                        print(
                            f"rep {rep} tokens {tokens:<4} c={conc:<4} {name:<14} rps {res['rps']:7.1f} "
                            f"ttft p50 {res['ttft_ms']['p50'] or 0:7.2f} "
                            f"e2e p50 {res['e2e_ms']['p50'] or 0:8.2f} "
                            f"cpu ms/req {res['cpu_ms_per_request']} errors {res['errors']}",
                            flush=True,
                        )
    summary = summarise(runs, concs, token_counts)
    data = {
        "benchmark": "door",
        "environment": environment(),
        "config": {
            "concurrency": concs,
            "tokens": token_counts,
            "repeats": args.repeats,
            "duration_s": args.duration,
            "engine_capacity": CAPACITY,
            "pdsim": "--fast",
            "door": "aiohttp server + aiohttp client, chunk by chunk, uvloop",
        },
        "summary": summary,
        "runs": runs,
    }
    print(f"wrote {write_json(args.out, data)}")
    for row in summary["rows"]:
        print(row)
    for k, v in summary["per_token"].items():
        print(k, v)


def summarise(runs: list[dict[str, Any]], concs: list[int], token_counts: list[int]) -> dict[str, Any]:
    rows = []
    for tokens in token_counts:
        for conc in concs:
            for name in ("pdmaster", "pdmaster-door"):
                rs = [
                    r
                    for r in runs
                    if r["contender"] == name and r["tokens"] == tokens and r["concurrency"] == conc
                ]
                if not rs:
                    continue

                def cpu(key: str, rs: list[dict[str, Any]] = rs) -> float | None:
                    return median([r["cpu_ms_per_request"].get(key) for r in rs])

                rows.append({
                    "tokens": tokens, "concurrency": conc, "contender": name,
                    "rps": median([r["rps"] for r in rs]),
                    "ttft_p50_ms": median([r["ttft_ms"]["p50"] for r in rs]),
                    "ttft_p99_ms": median([r["ttft_ms"]["p99"] for r in rs]),
                    "e2e_p50_ms": median([r["e2e_ms"]["p50"] for r in rs]),
                    "e2e_p99_ms": median([r["e2e_ms"]["p99"] for r in rs]),
                    "master_cpu_ms_per_req": cpu("master"),
                    "door_cpu_ms_per_req": cpu("door"),
                    "engines_cpu_ms_per_req": median(
                        [r["cpu_ms_per_request"]["prefill"] + r["cpu_ms_per_request"]["decode"] for r in rs]
                    ),
                    "errors": sum(r["errors"] for r in rs),
                })  # fmt: skip
    per_token: dict[str, Any] = {}
    if len(token_counts) >= 2:
        lo, hi = min(token_counts), max(token_counts)
        for conc in concs:

            def at(tokens: int, key: str, conc: int = conc) -> float | None:
                row = next(
                    (r for r in rows if r["tokens"] == tokens and r["concurrency"] == conc
                     and r["contender"] == "pdmaster-door"), None,
                )  # fmt: skip
                return None if row is None else row[key]

            out = {}
            for key in ("door_cpu_ms_per_req", "master_cpu_ms_per_req"):
                a, b = at(lo, key), at(hi, key)
                if a is not None and b is not None:
                    out[key.replace("_ms_per_req", "_us_per_token")] = round((b - a) * 1000 / (hi - lo), 2)
                    out[key.replace("_ms_per_req", "_ms_per_req_fixed")] = round(
                        a - (b - a) * lo / (hi - lo), 3
                    )
            per_token[f"c{conc}"] = out
    return {"rows": rows, "per_token": per_token}


if __name__ == "__main__":
    main()
