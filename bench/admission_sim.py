"""Controller-level admission experiment in virtual time (deterministic, a few seconds to run).

    .venv/bin/python bench/admission_sim.py      # writes bench/results/admission_sim.json

Poisson arrivals of the three classes (30 % CONTINUATION, 30 % PROBABLE_CACHE_HIT, 40 % COLD) of which
5 % are n=4 gangs; every lease is held for a fixed 50 ms service time; offered load 0.7x, 1.0x and
1.5x the capacity (64 slots on 4 decode nodes of 16). Three admission policies see the same arrivals:

* ``pdcoord``: this controller (bounded queue of one wave, DRR 8:3:1, timeouts 30/15/5 s, backfill);
* ``reject_when_full``: run if it fits on a node now, else 429 at once (the old master behaviour);
* ``fifo``: one strict FIFO queue with the same bound and timeouts, head-of-line blocking.

This is an admission-controller experiment, not an end-to-end model/GPU throughput measurement.
"""

from __future__ import annotations

import heapq
import json
import random
import statistics
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdcoord.config import EnvArgumentParser, positive_float, positive_int
from pdmaster.admission import CLASS_ORDER, AdmissionCore, AdmissionPolicy, RequestClass, Ticket

SERVICE_S = 0.05
SHARES = {f"d{i}": 16 for i in range(4)}
CAPACITY = sum(SHARES.values())
MIX = ((RequestClass.CONTINUATION, 0.3), (RequestClass.PROBABLE_CACHE_HIT, 0.3), (RequestClass.COLD, 0.4))
GANG_P, GANG_N = 0.05, 4
WAITS = {RequestClass.CONTINUATION: 30.0, RequestClass.PROBABLE_CACHE_HIT: 15.0, RequestClass.COLD: 5.0}

Arrival = tuple[float, int, RequestClass]  # time, slots, class


def arrivals(load: float, duration: float, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    mean_slots = (1 - GANG_P) + GANG_P * GANG_N
    rate = load * CAPACITY / SERVICE_S / mean_slots  # requests per second
    out: list[Arrival] = []
    t = rng.expovariate(rate)
    while t < duration:
        r = rng.random()
        cls = MIX[0][0] if r < 0.3 else MIX[1][0] if r < 0.6 else MIX[2][0]
        out.append((t, GANG_N if rng.random() < GANG_P else 1, cls))
        t += rng.expovariate(rate)
    return out


class Result:
    def __init__(self) -> None:
        self.waits: dict[RequestClass, list[float]] = {c: [] for c in CLASS_ORDER}
        self.gang_waits: list[float] = []
        self.gangs = 0
        self.outcomes: Counter[str] = Counter()
        self.busy_slot_s = 0.0
        self.offered: Counter[RequestClass] = Counter()

    def granted(self, slots: int, cls: RequestClass, wait: float, start: float, horizon: float) -> None:
        self.outcomes["granted"] += 1
        self.waits[cls].append(wait)
        if slots > 1:
            self.gang_waits.append(wait)
        end = start + SERVICE_S
        self.busy_slot_s += slots * max(0.0, min(end, horizon) - min(start, horizon))


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_pdcoord(arr: list[Arrival], horizon: float) -> Result:
    clock = VirtualClock()
    core = AdmissionCore(AdmissionPolicy(max_wait_s=WAITS), clock=clock)
    core.set_shares(SHARES)
    res = Result()
    events: list[tuple[float, int, Ticket]] = []  # releases
    seq = 0

    def handle(changes: list[Ticket]) -> None:
        nonlocal seq
        for t in changes:
            if t.state == "granted":
                res.granted(t.slots, t.request_class, clock.now - t.enqueued_at, clock.now, horizon)
                seq += 1
                heapq.heappush(events, (clock.now + SERVICE_S, seq, t))
            else:
                assert t.reason is not None
                res.outcomes[t.reason.code] += 1

    def advance(to: float) -> None:
        inf = float("inf")
        while True:
            nd = core.next_deadline()
            nd = inf if nd is None else nd
            nr = events[0][0] if events else inf
            if min(nd, nr) > to:
                clock.now = to
                return
            if nr <= nd:
                clock.now = nr
                handle(core.release(heapq.heappop(events)[2]))
            else:
                clock.now = nd
                handle(core.expire())

    for at, slots, cls in arr:
        advance(at)
        if slots > 1:
            res.gangs += 1
        core.submit(slots, cls)
        handle(core.last_changes)
    advance(horizon + 60)
    return res


class _Nodes:
    def __init__(self) -> None:
        self.active = dict.fromkeys(SHARES, 0)

    def fit(self, n: int) -> str | None:
        node = max(SHARES, key=lambda k: (SHARES[k] - self.active[k], k))
        return node if SHARES[node] - self.active[node] >= n else None


def run_reject_when_full(arr: list[Arrival], horizon: float) -> Result:
    nodes = _Nodes()
    res = Result()
    releases: list[tuple[float, str, int]] = []
    for at, slots, cls in arr:
        while releases and releases[0][0] <= at:
            _, done_node, n = heapq.heappop(releases)
            nodes.active[done_node] -= n
        if slots > 1:
            res.gangs += 1
        node = nodes.fit(slots)
        if node is None:
            res.outcomes["rejected_busy"] += 1
            continue
        nodes.active[node] += slots
        res.granted(slots, cls, 0.0, at, horizon)
        heapq.heappush(releases, (at + SERVICE_S, node, slots))
    return res


def run_fifo(arr: list[Arrival], horizon: float) -> Result:
    nodes = _Nodes()
    res = Result()
    bound = CAPACITY
    queue: deque[list[Any]] = deque()  # [arrived, slots, cls, alive]
    deadlines: list[tuple[float, int, list[Any]]] = []
    queued_slots = 0
    releases: list[tuple[float, str, int]] = []
    seq = 0

    def dispatch(now: float) -> None:
        nonlocal queued_slots
        while queue:
            head = queue[0]
            if not head[3]:
                queue.popleft()
                continue
            node = nodes.fit(head[1])
            if node is None:
                return  # strict FIFO: the head blocks everyone behind it
            queue.popleft()
            head[3] = False
            queued_slots -= head[1]
            nodes.active[node] += head[1]
            res.granted(head[1], head[2], now - head[0], now, horizon)
            heapq.heappush(releases, (now + SERVICE_S, node, head[1]))

    def advance(to: float) -> None:
        nonlocal queued_slots
        while True:
            nr = releases[0][0] if releases else None
            nd = deadlines[0][0] if deadlines else None
            nxt = min((x for x in (nr, nd) if x is not None), default=None)
            if nxt is None or nxt > to:
                return
            if nr is not None and nr == nxt:
                _, node, n = heapq.heappop(releases)
                nodes.active[node] -= n
                dispatch(nxt)
            else:
                _, _, item = heapq.heappop(deadlines)
                if item[3]:
                    item[3] = False
                    queued_slots -= item[1]
                    res.outcomes["timeout"] += 1
                    dispatch(nxt)

    for at, slots, cls in arr:
        advance(at)
        if slots > 1:
            res.gangs += 1
        if queued_slots + slots > bound:
            res.outcomes["queue_full"] += 1
            continue
        item = [at, slots, cls, True]
        queue.append(item)
        queued_slots += slots
        seq += 1
        heapq.heappush(deadlines, (at + WAITS[cls], seq, item))
        dispatch(at)
    advance(horizon + 60)
    return res


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=1000, method="inclusive")[min(998, max(0, int(q * 1000) - 1))]


def summarize(res: Result, arr: list[Arrival], horizon: float) -> dict[str, Any]:
    n_arrivals = len(arr)
    offered = Counter(c for _, _, c in arr)
    granted = res.outcomes["granted"]
    ms: Callable[[float | None], float | None] = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    return {
        "arrivals": n_arrivals,
        "completed_per_s": round(granted / horizon, 1),
        "rejection_rate": round(1 - granted / n_arrivals, 4),
        "outcomes": dict(res.outcomes),
        "served_fraction": {c.value: round(len(res.waits[c]) / max(1, offered[c]), 4) for c in CLASS_ORDER},
        "slot_utilization": round(res.busy_slot_s / (CAPACITY * horizon), 4),
        "wait_ms": {
            c.value: {"p50": ms(pct(res.waits[c], 0.5)), "p99": ms(pct(res.waits[c], 0.99))}
            for c in CLASS_ORDER
        },
        "gangs": res.gangs,
        "gangs_completed": len(res.gang_waits),
        "gang_wait_ms": {"p50": ms(pct(res.gang_waits, 0.5)), "p99": ms(pct(res.gang_waits, 0.99))},
    }


POLICIES: dict[str, Callable[[list[Arrival], float], Result]] = {
    "pdcoord": run_pdcoord,
    "reject_when_full": run_reject_when_full,
    "fifo": run_fifo,
}


def markdown(rows: list[dict[str, Any]]) -> str:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:g}"

    head = (
        "| load | policy | completed/s | rejected | util | served CONT/PROB/COLD "
        "| wait p50/p99 ms CONT | PROB | COLD | gangs done | gang wait p50/p99 ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        w = r["wait_ms"]
        served = " / ".join(f"{r['served_fraction'][c.value] * 100:.0f}%" for c in CLASS_ORDER)
        lines.append(
            f"| {r['load']}x | {r['policy']} | {r['completed_per_s']:g} | {r['rejection_rate'] * 100:.1f} % "
            f"| {r['slot_utilization'] * 100:.1f} % "
            f"| {served} "
            + " ".join(f"| {f(w[c.value]['p50'])} / {f(w[c.value]['p99'])}" for c in CLASS_ORDER)
            + f" | {r['gangs_completed']}/{r['gangs']} "
            + f"| {f(r['gang_wait_ms']['p50'])} / {f(r['gang_wait_ms']['p99'])} |"
        )
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = EnvArgumentParser(prog="admission_sim", env_prefix="PDBENCH", description=__doc__)
    p.add_argument(
        "--duration", type=positive_float, default=30.0, help="virtual seconds of arrivals per run"
    )
    p.add_argument("--seed", type=positive_int, default=1529)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "admission_sim.json"))
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for load in (0.7, 1.0, 1.5):
        arr = arrivals(load, args.duration, args.seed)
        for name, fn in POLICIES.items():
            row = {"load": load, "policy": name, **summarize(fn(arr, args.duration), arr, args.duration)}
            rows.append(row)
    table = markdown(rows)
    print(table)
    out = {
        "command": ".venv/bin/python bench/admission_sim.py",
        "duration_s": args.duration,
        "seed": args.seed,
        "capacity_slots": CAPACITY,
        "service_s": SERVICE_S,
        "mix": {c.value: p for c, p in MIX},
        "gang_fraction": GANG_P,
        "gang_slots": GANG_N,
        "rows": rows,
        "markdown": table,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
