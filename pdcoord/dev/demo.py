"""``pdcoord demo``: a whole cluster on this machine, under load, through a master failure.

Local etcd, 2 masters, 2 prefill + 3 decode simulated engines each with its node agent; a mixed
workload for ``--duration`` seconds with a live progress line; one master SIGKILLed part-way and
restarted. Ends with a summary and exits 0 only when the invariants held.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict

from pdcoord.dev.cluster import LocalCluster, scrape_metrics
from pdcoord.dev.etcd_server import LocalEtcd
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.dev.loadgen import CONN_FAILED, HANG, BackgroundLoad, LoadConfig, Outcome, RequestMix, percentile

PREFILL = {"p1": 32, "p2": 32}
DECODE = {"d1": 8, "d2": 8, "d3": 4}
KILLED = "m2"  # the master the demo SIGKILLs part-way


def error_kind(o: Outcome) -> str:
    """How a failed or refused request ended, as the summary's table names it."""
    if o.status == HANG:
        return "hung (no answer within the client's timeout)"
    if o.status == CONN_FAILED:
        return f"connection failed or broken ({o.error or 'no status'})"
    return f"{o.status} {o.error}".strip()


def refused(o: Outcome) -> bool:
    """429: the admission queue's bound at work; the client waits for Retry-After and tries again."""
    return o.status == 429


def is_5xx(o: Outcome) -> bool:
    return 500 <= o.status < 600


def fmt_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]

    def line(r: list[str]) -> str:
        cells = (
            str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))
        )
        return "  ".join(cells)

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def share_rows(table: dict[str, dict[str, int]]) -> str:
    nodes = sorted({n for shares in table.values() for n in shares})
    rows = [[m, *[str(table[m].get(n, 0)) for n in nodes]] for m in sorted(table)]
    return fmt_table(rows, ["master", *nodes])


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdcoord-demo-")
        self.events: list[str] = []
        self.shares: dict[str, dict[str, dict[str, int]]] = {}
        self.failover_s: float | None = None
        self.rejoin_s: float | None = None
        self.problems: list[str] = []
        self.waiting: dict[str, object] = {}  # agents' handover state when the failover overran
        self.killed_at: float | None = None  # time.monotonic() of the SIGKILL
        self.back_at: float | None = None  # when its replacement held its share again

    def say(self, text: str) -> None:
        print(text, flush=True)

    def run(self) -> int:
        with LocalEtcd(log_path=f"{self.log_dir}/etcd.log") as etcd, ProcessGroup(self.log_dir) as group:
            self.say(f"pdcoord demo: logs in {self.log_dir}")
            c = LocalCluster(group, etcd.endpoint, "demo")
            self.cluster = c
            t0 = time.monotonic()
            for m in ("m1", "m2"):
                c.start_master(m)
            for name, cap in PREFILL.items():
                c.start_node(name, "prefill", cap, fast=False)
            for name, cap in DECODE.items():
                c.start_node(name, "decode", cap, fast=False)
            caps = {**PREFILL, **DECODE}
            c.wait_for(lambda: c.full_capacity_held(["m1", "m2"], caps), timeout=30)
            self.say(f"cluster up in {time.monotonic() - t0:.1f}s: etcd {etcd.endpoint}, masters "
                     + ", ".join(f"{m.master_id}={m.url}" for m in c.masters.values()))  # fmt: skip
            self.shares["before"] = c.share_table()
            self.say("\nshares before (slots per node):\n" + share_rows(self.shares["before"]) + "\n")
            outcomes = self.load(caps)
            code = self.summary(outcomes)
            if self.args.keep:
                self.keep()
            return code

    # -- load and chaos -----------------------------------------------------------------------
    def live_masters(self) -> list[tuple[str, str]]:
        return [(m.master_id, m.url) for m in self.cluster.masters.values() if m.proc.alive] or [("m1", "")]

    def load(self, caps: dict[str, int]) -> list[Outcome]:
        duration = self.args.duration
        cfg = LoadConfig(users=int(sum(DECODE.values()) * 1.5), duration_s=duration, seed=self.args.seed,
                         request_timeout_s=60, mix=RequestMix(max_tokens=24))  # fmt: skip
        start = time.monotonic()
        load = BackgroundLoad(self.live_masters, cfg).start()
        killed = restarted = False
        c = self.cluster
        while load.running:
            load.join(timeout=1.0)
            el = time.monotonic() - start
            self.progress(el, load.snapshot())
            if not killed and el >= 0.35 * duration:
                killed = True
                self.say(f"\n[{el:5.1f}s] SIGKILL master {KILLED} (pid {c.masters[KILLED].proc.pid})")
                self.killed_at = time.monotonic()
                c.masters[KILLED].proc.kill()
                try:
                    self.failover_s = self.wait_failover(caps)
                    self.say(f"[{time.monotonic() - start:5.1f}s] m1 holds the full capacity "
                             f"{self.failover_s:.2f}s after the kill")  # fmt: skip
                except TimeoutError:
                    self.problems.append("survivor did not get the full capacity within 10 s")
                self.shares["during"] = c.share_table()
            if killed and not restarted and el >= 0.6 * duration:
                restarted = True
                self.say(f"\n[{el:5.1f}s] restarting master m2")
                try:
                    # The killed m2's lease lives for its TTL: a new m2 is refused until it expires.
                    c.start_master_when_free(KILLED)
                    self.rejoin_s = c.wait_for(lambda: c.full_capacity_held(["m1", "m2"], caps), 15, 0.02)
                except TimeoutError:
                    self.problems.append("m2 did not get its share back within 15 s")
                self.back_at = time.monotonic()
                self.shares["after"] = c.share_table()
        self.say("")
        return load.stop()

    def wait_failover(self, caps: dict[str, int]) -> float:
        """Seconds until m1 holds the full capacity (TimeoutError after 10 s). Past the budget, what
        the decode agents still wait for is recorded, to say why."""
        c, budget = self.cluster, self.args.failover_budget
        start = time.monotonic()
        try:
            return c.wait_for(lambda: c.full_capacity_held(["m1"], caps), min(budget, 10.0), 0.02)
        except TimeoutError:
            self.waiting = {n: self.handover_state(n) for n in DECODE}
        c.wait_for(lambda: c.full_capacity_held(["m1"], caps), max(0.0, 10.0 - budget), 0.02)
        return time.monotonic() - start

    def handover_state(self, node: str) -> object:
        try:
            st = self.cluster.agents[node].status()
        except (OSError, ValueError, KeyError) as exc:
            return f"status unavailable: {exc}"
        keep = ("shares", "handover", "load", "masters")
        return {k: st.get(k) for k in keep}

    def progress(self, elapsed: float, outcomes: list[Outcome]) -> None:
        done = len(outcomes)
        ok = sum(o.ok for o in outcomes)
        n_refused = sum(refused(o) for o in outcomes)
        parts = []
        for m in self.cluster.masters.values():
            if not m.proc.alive:
                parts.append(f"{m.master_id}: down")
                continue
            try:
                a = m.admission()
                parts.append(f"{m.master_id}: cap {a['capacity']} active {a.get('active', 0)} "
                             f"queued {a.get('queued_requests', 0)}")  # fmt: skip
            except OSError:
                parts.append(f"{m.master_id}: ?")
        self.say(f"[{elapsed:5.1f}s] requests {done} ok {ok} refused (429) {n_refused} "
                 f"failed {done - ok - n_refused} | " + " | ".join(parts))  # fmt: skip

    # -- summary ------------------------------------------------------------------------------
    def summary(self, outcomes: list[Outcome]) -> int:
        c = self.cluster
        time.sleep(0.5)
        leaked = {}
        for m in c.masters.values():
            if m.proc.alive:
                try:
                    c.wait_for(lambda m=m: m.admission().get("active", 0) == 0, 5)  # type: ignore[misc]
                except TimeoutError:
                    leaked[m.master_id] = m.admission().get("active")
        by_class: dict[str, list[Outcome]] = defaultdict(list)
        for o in outcomes:
            if o.ok:
                by_class[o.klass or "?"].append(o)
        rows = [[k, str(len(v)), f"{percentile([o.wait_ms for o in v], 50):.1f}",
                 f"{percentile([o.wait_ms for o in v], 99):.1f}",
                 f"{percentile([o.latency_s * 1000 for o in v], 50):.0f}"]
                for k, v in sorted(by_class.items())]  # fmt: skip
        header = ["class", "completed", "wait p50 ms", "wait p99 ms", "latency p50 ms"]
        self.say("completed requests by admission class:\n" + fmt_table(rows, header))

        rows = []
        queued_total = 0.0
        for name, cap in DECODE.items():
            mt = scrape_metrics(c.engines[name].url)
            peak, queued = mt.get("pdsim_max_running", 0.0), mt.get("pdsim_queued_total", 0.0)
            queued_total += queued
            rows.append([name, str(cap), f"{peak:.0f}", f"{queued:.0f}"])
            if peak > cap:
                self.problems.append(f"{name}: peak concurrency {peak:.0f} above running_max_req_size {cap}")
        self.say("\ndecode nodes:\n" + fmt_table(rows, ["node", "running_max_req_size", "peak running",
                                                           "pdsim_queued_total"]))  # fmt: skip
        for phase in ("before", "during", "after"):
            if phase in self.shares:
                self.say(f"\nshares {phase}:\n" + share_rows(self.shares[phase]))
        if self.failover_s is not None:
            self.say(f"\nfailover: m1 held the full capacity {self.failover_s:.2f}s after m2 was killed")
        if self.rejoin_s is not None:
            self.say(f"rejoin: shares re-sliced {self.rejoin_s:.2f}s after m2 restarted")
        self.say("\n" + self.error_table(outcomes))
        hangs = sum(1 for o in outcomes if o.status == HANG)
        five_xx = [o for o in outcomes if is_5xx(o)]
        failed = [o for o in outcomes if not o.ok and not refused(o)]
        n_refused = sum(refused(o) for o in outcomes)
        if hangs:
            self.problems.append(f"{hangs} requests hung")
        if leaked:
            self.problems.append(f"leases still held after the load: {leaked}")
        budget = self.args.failover_budget
        if self.failover_s is not None and self.failover_s > budget:
            self.problems.append(f"failover took {self.failover_s:.2f}s (> {budget:g} s)")
        if self.waiting:
            self.say(f"\nwhat the decode agents waited for {budget:g} s after the kill:")
            for node, state in self.waiting.items():
                self.say(f"  {node}: {json.dumps(state, sort_keys=True)}")
        if not outcomes or not sum(o.ok for o in outcomes):
            self.problems.append("no request completed")
        from_killed = Counter(self.from_killed(o) for o in failed)
        elsewhere = len(failed) - from_killed["in flight when killed"] - from_killed["after the kill"]
        self.say(f"\n{len(outcomes)} requests: {sum(o.ok for o in outcomes)} completed, {n_refused} refused "
                 f"(429), {len(failed)} failed, of which {len(five_xx)} 5xx "
                 f"({sum(bool(self.from_killed(o)) for o in five_xx)} from the killed master {KILLED})\n"
                 f"failed on {KILLED}: {from_killed['in flight when killed']} in flight when it was killed, "
                 f"{from_killed['after the kill']} after it, until its replacement held its share (refused "
                 f"connections, 503 while the replacement started); other failures: {elsewhere}\n"
                 f"{queued_total:.0f} requests queued inside decode engines")  # fmt: skip
        if self.problems:
            self.say("INVARIANTS VIOLATED:\n  " + "\n  ".join(self.problems))
            return 1
        self.say("all invariants held")
        return 0

    def from_killed(self, o: Outcome) -> str:
        """What the killed master had to do with *o*: "in flight when killed", "after the kill" (sent
        to it before its replacement held its share again), or "" (nothing)."""
        at = self.killed_at
        if at is None or o.master != KILLED or o.ended < at:
            return ""
        if o.started <= at:
            return "in flight when killed"
        return "after the kill" if self.back_at is None or o.started < self.back_at else ""

    def error_table(self, outcomes: list[Outcome]) -> str:
        """Refusals and failures by kind, each with the masters that gave them."""
        lines = []
        for title, pick in (
            ("refused (429: the queue bound at work; clients wait for Retry-After)", refused),
            ("failed", lambda o: not o.ok and not refused(o)),
        ):
            by_kind: dict[str, Counter[str]] = defaultdict(Counter)
            for o in outcomes:
                if pick(o):
                    how = self.from_killed(o)
                    where = f"{o.master} {how}" if how else o.master
                    by_kind[error_kind(o)][where] += 1
            rows = sorted(by_kind.items(), key=lambda kv: -sum(kv[1].values()))
            body = "".join(
                f"\n  {kind}: {sum(where.values())} ("
                + ", ".join(f"{w}: {n}" for w, n in sorted(where.items())) + ")"
                for kind, where in rows
            )  # fmt: skip
            lines.append(f"{title}:" + (body or " none"))
        return "\n".join(lines)

    def keep(self) -> None:
        m = next(iter(self.cluster.masters.values()))
        self.say(f"""
cluster left running (Ctrl-C to stop). Masters: {", ".join(x.url for x in self.cluster.masters.values())}
  curl -s {m.url}/admission | python -m json.tool
  curl -sN {m.url}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model":"sim","messages":[{{"role":"user","content":"hi"}}],"stream":true}}'
  python -c "import openai; c = openai.OpenAI(base_url='{m.url}/v1', api_key='x'); \\
print(c.chat.completions.create(model='sim', messages=[{{'role':'user','content':'hi'}}]).choices[0].message)"
""")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


def run_demo(args: argparse.Namespace) -> int:
    try:
        return Demo(args).run()
    except KeyboardInterrupt:
        print("interrupted; everything stopped", file=sys.stderr)
        return 130
