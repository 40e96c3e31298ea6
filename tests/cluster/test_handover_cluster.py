"""Strict handover with real processes: masters join, leave and restart in a loop under load.

The engines count every request that had to wait for a slot inside them (``pdsim_queued_total``):
with strict handover that stays 0, because no master ever uses a slot another may still hold. The
same loop in fast mode prints its overshoot beside it. ``PDCOORD_HANDOVER_S`` sets the loop's
duration (default 20 s per mode).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time
from typing import Any

import openai
import pytest

from pdcoord.dev.cluster import LocalCluster, scrape_metrics
from pdcoord.dev.loadgen import HANG
from pdcoord.etcd import EtcdClient
from pdcoord.keys import Keys
from tests.cluster.cluster_helpers import (
    Targets,
    churn_masters,
    cluster_load,
    post_unread,
    ready,
    summarize,
    wait_no_leases,
)
from tests.cluster.test_cluster_suite import (
    CAPS,
    DECODE,
    MODEL,
    Loads,
    decode_queued,
    load_guard,
    run_load,
    start_fleet,
)

__all__ = ["load_guard"]  # the fixture, shared with the cluster suite

pytestmark = pytest.mark.cluster

MASTERS = ["m1", "m2", "m3"]


class UsableSampler:
    """Samples Σ over masters of max(share, active) per decode node from every live master.

    The masters are read one after another, so one pass is no snapshot: a master read before it handed
    slots on and another read after it received them would count those slots twice. Each sample is
    therefore two passes, the second in reverse order, and counts for every master the smaller of its
    two readings: an overshoot that lasts across the sample (fast mode's overlap lasts as long as the
    old leases) is still seen, a handover that happens between two reads is not counted as one.
    """

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.max_seen: dict[str, int] = dict.fromkeys(DECODE, 0)
        # The readings behind each node's largest sample, for the failure message.
        self.max_detail: dict[str, str] = dict.fromkeys(DECODE, "")
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> UsableSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _read(self, masters: list[Any]) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
        seen: dict[str, dict[str, int]] = {}
        raw: dict[str, str] = {}
        for m in masters:
            if not m.proc.alive:
                continue
            try:
                body = m.admission(timeout=1.0)
            except (OSError, ValueError):
                continue
            nodes = body.get("admission_nodes", {})
            # A draining master with nothing queued takes no new work (new requests get 503 and it
            # does not retry), so only its running leases are usable: the agents hand its share to
            # the others on its Ack saying so, and its own view of the share lags by a message.
            idle_drain = bool(body.get("draining")) and not body.get("queued_slots")
            seen[m.master_id] = {
                node: int(v["active"]) if idle_drain else max(int(v["share"]), int(v["active"]))
                for node, v in nodes.items()
                if node in DECODE
            }
            raw[m.master_id] = (
                f"{'draining ' if body.get('draining') else ''}queued {body.get('queued_slots')} "
                + " ".join(f"{n}:{v['share']}/{v['active']}" for n, v in sorted(nodes.items()) if n in DECODE)
            )
        return seen, raw

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            masters = list(self.cluster.masters.values())
            first, raw1 = self._read(masters)
            second, raw2 = self._read(masters[::-1])
            total = dict.fromkeys(DECODE, 0)
            for mid in first.keys() & second.keys():
                for node in total:
                    total[node] += min(first[mid].get(node, 0), second[mid].get(node, 0))
            self.samples += 1
            for node, v in total.items():
                if v > self.max_seen[node]:
                    self.max_seen[node] = v
                    self.max_detail[node] = f"share/active then {raw1}, reversed {raw2}"


@pytest.mark.parametrize("mode", ["strict", "fast"])
def test_masters_join_leave_and_restart_in_a_loop(
    cluster: LocalCluster, load_guard: Loads, mode: str
) -> None:
    duration = float(os.environ.get("PDCOORD_HANDOVER_S", "20"))
    targets = start_fleet(cluster, MASTERS, agent_extra={"handover": mode})
    # Saturating: more concurrent users than decode slots.
    load = run_load(load_guard, targets, users=20, max_tokens=24, request_timeout_s=20, lb_retry=True)
    with UsableSampler(cluster) as sampler:
        log = churn_masters(cluster, targets, MASTERS, duration, random.Random(7))
        time.sleep(1.0)
    results = load.stop()
    queued = decode_queued(cluster)
    peaks = {n: v for n, v in sampler.max_seen.items()}
    hangs = [r for r in results if r.status == HANG]
    print(
        f"\n{mode} handover, {len(log)} actions in {duration:.0f}s ({', '.join(a.split()[1] for a in log)}): "
        f"{len(results)} requests ({summarize(results)}); pdsim_queued_total {queued}; "
        f"largest sampled Σ max(share, active) per node {peaks} in {sampler.samples} samples "
        f"(capacity {DECODE})"
    )
    assert len(log) >= duration / 4, "the churn loop did too little"
    assert {a.split()[1] for a in log} >= {"leave", "join"}, log
    assert len(results) > 100
    assert not hangs, f"{len(hangs)} requests hung"
    # Refusals (429 with Retry-After) come back at once and closed-loop users retry, so their count
    # depends on the machine's speed; what matters is that work kept completing.
    assert sum(r.ok for r in results) > 100, summarize(results)
    assert all(r.ok or (r.status == 429 and r.retry_after) or r.status == 503 for r in results), summarize(
        results
    )
    live = [m for m in MASTERS if cluster.masters[m].proc.alive]
    assert wait_no_leases(cluster) == {m: (0, 0) for m in live}
    if mode == "strict":
        assert all(v == 0 for v in queued.values()), f"decode engines queued requests: {queued}"
        for node, cap in DECODE.items():
            assert peaks[node] <= cap, (
                f"{node}: masters could use {peaks[node]} > {cap} slots: {sampler.max_detail[node]}"
            )


def test_demand_shares_follow_a_90_10_split_with_real_processes(
    cluster: LocalCluster, load_guard: Loads
) -> None:
    """Two masters, 18 closed-loop users on one and 2 on the other: throughput static vs demand.

    The fleet starts static; the agents are then restarted with ``--share-policy demand`` under the
    same load, so both halves of the run see the same processes and clients.
    """
    masters = ["m1", "m2"]
    start_fleet(cluster, masters, agent_extra={"lease_ttl": 2, "share_policy": "static"})
    m1, m2 = (cluster.masters[m].url for m in masters)

    def measure(seconds: float) -> tuple[float, dict[str, int]]:
        busy = cluster_load(lambda: [("m1", m1)], users=18, max_tokens=16, seed=3, gangs=False)
        idle = cluster_load(lambda: [("m2", m2)], users=2, max_tokens=16, seed=4, gangs=False)
        load_guard.extend([busy.start(), idle.start()])
        time.sleep(3.0)  # let the split settle
        before = len([r for r in busy.snapshot() + idle.snapshot() if r.ok])
        caps: dict[str, int] = {}
        time.sleep(seconds)
        for m in masters:
            caps[m] = cluster.masters[m].admission()["capacity"]
        after = len([r for r in busy.snapshot() + idle.snapshot() if r.ok])
        busy.stop()
        idle.stop()
        return (after - before) / seconds, caps

    static_rps, static_caps = measure(6.0)
    for node in list(cluster.agents):
        agent = cluster.agents[node]
        agent.proc.send_signal(signal.SIGTERM)  # graceful: revokes its lease
        assert agent.proc.wait(15) == 0
        agent.extra["share_policy"] = "demand"
        cluster.restart_agent(node)
    cluster.wait_for(lambda: all(ready(cluster.masters[m].url) for m in masters), timeout=20)
    demand_rps, demand_caps = measure(6.0)
    queued = decode_queued(cluster)
    print(
        f"\n90/10 split over two masters (12 decode slots): static {static_rps:.1f} ok req/s, capacity "
        f"{static_caps}; demand {demand_rps:.1f} ok req/s, capacity {demand_caps}; "
        f"pdsim_queued_total {queued}"
    )
    assert static_caps == {"m1": 6, "m2": 6}, static_caps
    # m2's 2 users of 20 are worth 1.2 of the 12 slots, and its floor is one slot of the fleet (on its
    # anchor node), so it may hold 1 or 2 depending on the instant read
    assert demand_caps["m1"] > static_caps["m1"] and demand_caps["m2"] >= 1, demand_caps
    assert sum(demand_caps.values()) <= sum(DECODE.values())
    assert demand_rps > static_rps, (static_rps, demand_rps)
    assert all(v == 0 for v in queued.values()), f"decode engines queued requests: {queued}"


def test_demand_churn_three_masters(cluster: LocalCluster, load_guard: Loads) -> None:
    """``--share-policy demand`` with 70/20/10 closed-loop traffic over three masters; the 20 %
    master is SIGKILLed mid-run (its clients move to the busiest master) and a fourth master joins
    (they move to it). Strict handover must hold throughout: the sampled Σ max(share, active) per
    decode node never exceeds its capacity and the engines never queue a request."""
    start_fleet(cluster, MASTERS, agent_extra={"share_policy": "demand"})
    groups = {"m1": 14, "m2": 4, "m3": 2}  # 20 users over 12 decode slots: saturating
    targets: dict[str, Targets] = {}
    loads = []
    for i, (mid, users) in enumerate(groups.items()):
        t = Targets(cluster)
        t.add_when_ready(mid)
        targets[mid] = t
        load = cluster_load(t, users=users, max_tokens=16, seed=20 + i, gangs=False, lb_retry=True)
        load_guard.append(load.start())
        loads.append(load)

    def capacity(mid: str) -> int:
        return int(cluster.masters[mid].admission()["capacity"])

    with UsableSampler(cluster) as sampler:
        # Demand moves slots to the busy master: more than the even split's 4 of 12.
        took_skew = cluster.wait_for(lambda: capacity("m1") > 4, timeout=20, interval=0.1)
        # Closed-loop demand moves all the time: the mean over a few seconds, not one reading.
        readings = []
        for _ in range(30):
            readings.append({m: capacity(m) for m in MASTERS})
            time.sleep(0.1)
        skew = {m: round(sum(r[m] for r in readings) / len(readings), 1) for m in MASTERS}

        t_kill = time.monotonic()
        targets["m2"].add_when_ready("m1")
        targets["m2"].remove("m2")
        cluster.masters["m2"].proc.kill()
        took_kill = cluster.wait_for(lambda: cluster.full_capacity_held(["m1", "m3"], CAPS), timeout=20)
        time.sleep(3.0)

        t_join = time.monotonic()
        cluster.start_master("m4", model="sim")
        targets["m2"].add_when_ready("m4")
        targets["m2"].remove("m1")
        cluster.wait_for(
            lambda: cluster.full_capacity_held(["m1", "m3", "m4"], CAPS), timeout=20, interval=0.02
        )
        took_join = time.monotonic() - t_join  # from the start of its process
        time.sleep(3.0)
        after = {m: capacity(m) for m in ("m1", "m3", "m4")}
        elapsed = time.monotonic() - t_kill
    results = [r for load in loads for r in load.stop()]
    queued = decode_queued(cluster)
    peaks = dict(sampler.max_seen)
    print(
        f"\ndemand, 70/20/10 over 3 masters (12 decode slots): m1 held more than 4 after {took_skew:.1f}s, "
        f"mean capacities {skew}; m2 SIGKILLed: m1+m3 held every node after {took_kill:.1f}s; m4 started: "
        f"held its share after {took_join:.1f}s, capacities {after}; {len(results)} requests in "
        f"{elapsed:.0f}s after the kill ({summarize(results)}); pdsim_queued_total {queued}; largest "
        f"sampled Σ max(share, active) per node {peaks} in {sampler.samples} samples (capacity {DECODE})"
    )
    assert sum(r.ok for r in results) > 100, summarize(results)
    assert not [r for r in results if r.status == HANG], summarize(results)
    # every master keeps at least the floor on the node it anchors to, whatever its demand
    assert skew["m1"] > 4 and min(min(r.values()) for r in readings) >= 1, skew
    assert after["m4"] >= 1, after
    assert sampler.samples > 20
    assert all(v == 0 for v in queued.values()), f"decode engines queued requests: {queued}"
    for node, cap in DECODE.items():
        assert peaks[node] <= cap, f"{node}: masters could use {peaks[node]} > {cap} slots"


@pytest.mark.parametrize(
    ("decode_ms", "orphan_timeout"), [(2.0, 20.0), (50.0, 300.0)], ids=["short-decodes", "long-decodes"]
)
def test_stopped_master_under_load_never_oversubscribes_the_engines(
    cluster: LocalCluster, load_guard: Loads, decode_ms: float, orphan_timeout: float
) -> None:
    """SIGSTOP a master while its decodes run: alive to the kernel (connections open, its address
    accepts), silent to everyone. Its agents cut its streams and must not free its slots by the live
    master's stale counts (``Ack.kept_slots``). With decode-length leases engine samples free them as
    its decodes end (``--orphan-timeout`` is set far beyond the deadline); with leases shorter than a
    sample's bracket (the Acks around it are 0.15 s apart at least) a sample can rarely tell the live
    master's leases from the stopped one's, and the orphan timeout (20 s here) hands the last slots
    on. When it runs again it still has waiters (their timeouts outlast the stop) and leases that
    end at once; it must place nothing until it has read that its streams were cut
    (``pdmaster.pausewatch``). Without that hold, 3 of 4 runs of the short-decode case queued requests
    inside an engine right after SIGCONT.

    ``decode_ms`` is the engine's time per decode step: 2 ms makes 24-token requests end within
    tens of milliseconds (a lease turns over many times between two Acks, the slowest case for the
    bracketed samples), 50 ms makes them last about as long as the failover itself."""
    masters = ["m1", "m2"]
    targets = start_fleet(
        cluster,
        masters,
        agent_extra={"orphan_timeout": orphan_timeout},
        decode_engine_args={"decode_base_ms": decode_ms},
        admission_max_wait="90:90:90",  # waiters outlast the stop: m1 has some when it runs again
    )
    # Saturating (20 users over 12 decode slots); the timeout outlasts the stop, so what m1 had in
    # flight completes once it runs again.
    load = run_load(load_guard, targets, users=20, max_tokens=24, request_timeout_s=120, lb_retry=True)
    cluster.wait_for(lambda: cluster.masters["m1"].admission()["active"] > 0, timeout=10)

    stopped = cluster.masters["m1"]
    targets.remove("m1")  # the load balancer stops sending to it; its in-flight requests stay on it
    t_stop = time.monotonic()
    stopped.proc.send_signal(signal.SIGSTOP)
    try:
        took = cluster.wait_for(lambda: cluster.full_capacity_held(["m2"], CAPS), timeout=90, interval=0.1)
        time.sleep(2.0)  # m2 runs on the whole fleet for a while
        queued_stopped = decode_queued(cluster)
    finally:
        stopped.proc.send_signal(signal.SIGCONT)
    stopped_for = time.monotonic() - t_stop
    rejoined = cluster.wait_for(lambda: cluster.full_capacity_held(masters, CAPS), timeout=30, interval=0.1)
    queued_rejoined = decode_queued(cluster)  # tells a resume's overshoot from a later handover's
    targets.add_when_ready("m1")
    time.sleep(3.0)
    results = load.stop()
    queued = decode_queued(cluster)
    leases = wait_no_leases(cluster)
    on_stopped = [r for r in results if r.master == "m1" and r.overlaps(t_stop)]
    print(
        f"\nSIGSTOP m1 under load ({decode_ms:g} ms decode steps): m2 held every node's capacity "
        f"{took:.2f}s after the stop; m1 stopped {stopped_for:.1f}s, both held their shares "
        f"{rejoined:.2f}s after SIGCONT; {len(results)} requests ({summarize(results)}); in flight on m1 at "
        f"the stop: {len(on_stopped)} ({summarize(on_stopped)}); pdsim_queued_total {queued_stopped} "
        f"while stopped, {queued_rejoined} once both held their shares, {queued} at the end; "
        f"(active, queued) after {leases}"
    )
    assert on_stopped, "the stop caught no request in flight on m1; the test exercised nothing"
    assert "did not run for" in stopped.proc.tail(5000), "m1 did not notice that it had been stopped"
    assert scrape_metrics(stopped.url).get("pdcoord_master_pauses_total", 0) >= 1
    # pdsim never runs more than its capacity; a request it had to queue is the overshoot.
    assert all(v == 0 for v in queued_stopped.values()), f"queued while m1 stood still: {queued_stopped}"
    assert all(v == 0 for v in queued.values()), f"decode engines queued requests: {queued}"
    assert not [r for r in results if r.status == HANG], summarize(results)
    assert all(r.ok or (r.status == 429 and r.retry_after) or r.status == 503 for r in results), summarize(
        results
    )
    assert leases == {m: (0, 0) for m in masters}, leases


def test_a_stalled_client_s_lease_stops_counting_once_its_engine_finished(cluster: LocalCluster) -> None:
    """The engine stops counting a decode at its last token, whatever its client reads. From then on
    the master must not count the lease as surely running there (the base of Ack.kept_slots): an
    engine sample set against it would free slots a cut-off master still runs. A client that reads
    nothing of an 8 MB answer: once the engine has finished, the master has released the lease (it
    read the whole answer) or marked it unseen (it stopped reading the engine for the client); the
    client then gets the whole answer, and the lease ends."""
    c = cluster
    c.start_master("m1", model=MODEL)
    c.start_node("p1", "prefill", 4, model=MODEL)
    c.start_node("d1", "decode", 4, model=MODEL)
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"p1": 4, "d1": 4}), timeout=30)
    m1, d1 = c.masters["m1"], c.engines["d1"].url
    tokens = 1500  # /generate repeats the text so far in every event: about 8 MB in all
    body = {"text": "x", "sampling_params": {"max_new_tokens": tokens}, "stream": True}
    sock = post_unread(m1.http_port, "/generate", body, timeout=60)
    try:

        def engine_done() -> bool:
            m = scrape_metrics(d1)
            return m.get("pdsim_tokens_total", 0.0) >= tokens and m.get("pdsim_running", 1.0) == 0

        c.wait_for(engine_done, timeout=60, interval=0.05)
        seen = m1.admission()
        print(f"\nengine done, nothing read: active {seen['active']}, unseen {seen['unseen_slots']}")
        assert seen["active"] - seen["unseen_slots"] == 0, seen
        raw = bytearray()
        while data := sock.recv(1 << 20):
            raw += data
    finally:
        sock.close()
    assert raw.startswith(b"HTTP/1.1 200"), bytes(raw[:200])
    assert raw.count(b"data: {") == tokens, raw.count(b"data: {")
    assert raw.endswith(b"0\r\n\r\n") and b"data: [DONE]" in raw[-64:], bytes(raw[-200:])  # chunked end
    c.wait_for(lambda: m1.admission()["active"] == 0, timeout=10)


History = list[tuple[str, dict[str, Any]]]


def _key_history(endpoint: str, key: str, since: int, timeout: float = 10.0) -> History:
    """The puts and the delete of ``key`` after revision ``since``: (kind, its JSON), up to the delete."""

    async def read() -> History:
        out: History = []
        async with EtcdClient([endpoint]) as client:
            async with asyncio.timeout(timeout):
                async for ev in client.watch_prefix(key, start_revision=since + 1):
                    if ev.key != key:
                        continue
                    out.append((ev.kind, json.loads(ev.value) if ev.kind == "put" else {}))
                    if ev.kind == "delete":
                        return out
        return out

    return asyncio.run(read())


def test_a_drain_that_times_out_cancels_its_requests_before_the_key_goes(cluster: LocalCluster) -> None:
    """A master whose drain timed out (a request still streaming) cancels what still runs, so that
    nothing of it runs by the time its key goes, and marks the key drained just before it revokes it:
    the agents then free its slots at once, as for a master that drained with nothing left running."""
    c = cluster
    c.start_master("m1", model=MODEL, drain_timeout=1)
    c.start_node("p1", "prefill", 4, model=MODEL)
    c.start_node("d1", "decode", 4, model=MODEL)
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"p1": 4, "d1": 4}), timeout=30)
    d1 = c.engines["d1"].url
    cancelled = scrape_metrics(d1).get("pdsim_cancelled_total", 0.0)
    key = Keys.for_cluster(c.cluster).master("m1")

    async def revision() -> int:
        async with EtcdClient([c.etcd]) as client:
            return (await client.get_prefix(key))[1]

    since = asyncio.run(revision())
    outcome: list[BaseException | int] = []

    def stream() -> None:
        client = openai.OpenAI(base_url=c.masters["m1"].url + "/v1", api_key="-", max_retries=0, timeout=60)
        n = 0
        try:
            for _ in client.completions.create(model=MODEL, prompt="long", max_tokens=20000, stream=True):
                n += 1
        except Exception as exc:  # the stream is cut: what a client sees of a drain that timed out
            outcome.append(exc)
        else:
            outcome.append(n)

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    c.wait_for(lambda: scrape_metrics(d1).get("pdsim_running", 0.0) == 1, timeout=30)
    assert c.masters["m1"].proc.terminate(timeout=30) == 0
    reader.join(timeout=30)
    assert not reader.is_alive() and outcome and not isinstance(outcome[0], int), outcome
    history = _key_history(c.etcd, key, since)
    assert [kind for kind, _ in history] == ["put", "delete"], history  # marked drained, then gone
    assert history[0][1].get("drained") is True, history
    c.wait_for(lambda: scrape_metrics(d1).get("pdsim_cancelled_total", 0.0) > cancelled, timeout=10)
    c.wait_for(lambda: scrape_metrics(d1).get("pdsim_running", 1.0) == 0, timeout=10)
    # The agent took it out for good: nothing of m1 stays reserved on d1.
    c.wait_for(lambda: not c.agents["d1"].status()["handover"]["orphans"], timeout=10)


def test_an_idle_master_keeps_one_slot_of_the_fleet_and_serves_from_it(
    cluster: LocalCluster, load_guard: Loads
) -> None:
    """Under demand shares a master asks for its floor on one decode node only (its anchor): while
    the other master's clients want every slot, the idle one holds one slot of the fleet, not one per
    node, and still answers its next request at once from it."""
    start_fleet(cluster, ["m1", "m2"])
    busy = cluster_load(
        lambda: [("m1", cluster.masters["m1"].url)], users=24, max_tokens=16, seed=5, gangs=False
    )
    load_guard.append(busy.start())

    def shares(mid: str) -> dict[str, int]:
        nodes = cluster.masters[mid].admission()["admission_nodes"]
        return {n: int(v["share"]) for n, v in nodes.items() if n in DECODE}

    def settled() -> bool:
        idle = [s for s in shares("m2").values() if s]  # a node where it holds nothing is not listed
        return idle == [1] and sum(shares("m1").values()) == sum(DECODE.values()) - 1

    took = cluster.wait_for(settled, timeout=40, interval=0.2)
    anchor = [n for n, s in shares("m2").items() if s == 1]
    client = openai.OpenAI(base_url=cluster.masters["m2"].url + "/v1", api_key="-", max_retries=0, timeout=30)
    answer = client.completions.create(model=MODEL, prompt="from the idle master", max_tokens=4)
    results = busy.stop()
    queued = decode_queued(cluster)
    print(
        f"\nidle master's shares {shares('m2')} (anchor {anchor}) after {took:.1f}s; "
        f"busy: {summarize(results)}"
    )
    assert answer.choices[0].text
    assert sum(r.ok for r in results) > 50, summarize(results)
    assert all(v == 0 for v in queued.values()), f"decode engines queued requests: {queued}"
