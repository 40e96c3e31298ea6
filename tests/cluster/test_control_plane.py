"""Control plane end to end: real etcd, real master and agent processes, real gRPC on loopback."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error

import grpc
import pytest

from pdcoord.dev.cluster import LocalCluster, http_json
from pdcoord.dev.etcd_server import LocalEtcd
from pdcoord.v1 import coordination_pb2 as pb
from pdcoord.v1 import coordination_pb2_grpc as pb_grpc
from tests.cluster.cluster_helpers import expected_share_table

pytestmark = pytest.mark.cluster

CAPS = {"d1": 8, "d2": 8, "d3": 5, "d4": 1}


def start_fleet(c: LocalCluster, masters: list[str], caps: dict[str, int]) -> None:
    for m in masters:
        c.start_master(m)
    for node, cap in caps.items():
        c.start_agent(node, "decode", capacity=cap)


def test_three_masters_four_agents_match_the_slicing_function(cluster: LocalCluster) -> None:
    masters = ["m1", "m2", "m3"]
    start_fleet(cluster, masters, CAPS)
    want = expected_share_table(masters, CAPS)
    cluster.wait_for(lambda: cluster.share_table() == want, timeout=15)
    for m in masters:
        adm = cluster.masters[m].admission()
        assert adm["master_id"] == m
        assert adm["capacity"] == sum(want[m].values())
        for n in adm["nodes"]:
            assert {
                "node_id",
                "role",
                "endpoint",
                "running_max_req_size",
                "share",
                "epoch",
                "connected",
            } <= set(n)
            assert n["connected"] and n["running_max_req_size"] == CAPS[n["node_id"]]
    for node, cap in CAPS.items():
        assert sum(want[m][node] for m in masters) == cap
    metrics = http_json_text(cluster.masters["m1"].url + "/metrics")
    assert "pdcoord_decode_capacity_slots" in metrics and 'pdcoord_node_share_slots{node="d1"' in metrics


def http_json_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as r:
        return r.read().decode()


def test_sigkill_and_sigterm_failover_and_join(cluster: LocalCluster) -> None:
    masters = ["m1", "m2", "m3"]
    start_fleet(cluster, masters, CAPS)
    cluster.wait_for(lambda: cluster.share_table() == expected_share_table(masters, CAPS), timeout=15)
    before = cluster.masters["m1"].epochs()

    cluster.masters["m3"].proc.kill()
    took = cluster.wait_for(lambda: cluster.full_capacity_held(["m1", "m2"], CAPS), timeout=10, interval=0.01)
    print(f"\nSIGKILL failover: survivors hold full capacity after {took:.3f}s")
    # Generous (a loaded machine; the timing is benchmarked): below the 5 s lease TTL, so the agents
    # acted on the broken streams, not on etcd expiring m3's key.
    assert took < 4.5
    assert cluster.share_table() == expected_share_table(["m1", "m2"], CAPS)
    # Every node's epoch moves on, including where m1's share stays the same (d4: its one slot is
    # m1's before and after); that report may arrive just after the shares are full, so poll.
    cluster.wait_for(lambda: all(cluster.masters["m1"].epochs()[n] > before[n] for n in CAPS), timeout=10)
    after_kill = cluster.masters["m1"].epochs()

    cluster.masters["m2"].proc.terminate()
    took = cluster.wait_for(lambda: cluster.full_capacity_held(["m1"], CAPS), timeout=10, interval=0.01)
    print(f"SIGTERM handover: m1 holds full capacity after {took:.3f}s")
    assert took < 4.5  # below the lease TTL: m2 handed its shares back as it drained (target 0.5 s)
    assert cluster.masters["m2"].proc.returncode == 0

    cluster.start_master("m4")
    cluster.wait_for(lambda: cluster.share_table() == expected_share_table(["m1", "m4"], CAPS), timeout=10)
    cluster.wait_for(lambda: all(cluster.masters["m1"].epochs()[n] > after_kill[n] for n in CAPS), timeout=10)


def _stopped_agent_noticed_after(cluster: LocalCluster, timeout: float) -> float:
    """SIGSTOP agent d1 (its kernel keeps the connection open, nothing answers) and return how long
    master m1 took to drop its stream; d1 is continued and back at its full share afterwards."""
    cluster.wait_for(lambda: cluster.masters["m1"].shares().get("d1") == 4, timeout=15)
    agent = cluster.agents["d1"]
    agent.proc.send_signal(signal.SIGSTOP)
    try:

        def d1_disconnected() -> bool:
            nodes = cluster.masters["m1"].admission()["nodes"]
            return not any(n["node_id"] == "d1" and n["connected"] for n in nodes)

        took = cluster.wait_for(d1_disconnected, timeout=timeout)
    finally:
        agent.proc.send_signal(signal.SIGCONT)
    cluster.wait_for(lambda: cluster.masters["m1"].shares().get("d1") == 4, timeout=20)
    return took


def test_a_hung_agent_is_noticed_by_its_master_through_keep_alive(cluster: LocalCluster) -> None:
    """A stopped agent must lose its node on the master within about a second, before any agent's
    grace could hand its share on. gRPC left such a stream open for a minute unless told its ping
    timeout."""
    cluster.start_master("m1")
    cluster.start_agent("d1", "decode", capacity=4)
    took = _stopped_agent_noticed_after(cluster, timeout=20)
    print(f"\nthe master noticed the stopped agent after {took:.2f}s")


def test_a_master_with_a_longer_keepalive_tells_its_agents_how_long(cluster: LocalCluster) -> None:
    """--keepalive trades CPU for how soon a cut stream is noticed. The agents read the master's
    detection time from its etcd key and let its slots wait that long; it still notices a hung agent."""
    cluster.start_master("m1", keepalive=2.0, keepalive_timeout=1.0)
    cluster.start_agent("d1", "decode", capacity=4)
    cluster.wait_for(lambda: cluster.masters["m1"].shares().get("d1") == 4, timeout=15)
    status = cluster.agents["d1"].status()
    assert status["peer_detect_s"] == pytest.approx(3.1)
    assert status["masters"]["m1"]["keepalive_s"] == 2.0
    took = _stopped_agent_noticed_after(cluster, timeout=30)
    print(f"\nthe master (--keepalive 2) noticed the stopped agent after {took:.2f}s")
    bad = subprocess.run(
        [sys.executable, "-m", "pdmaster", "--etcd", cluster.etcd, "--cluster", cluster.cluster,
         "--master-id", "m2", "--keepalive", "0.01"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert bad.returncode == 2 and "--keepalive" in bad.stderr, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr


def test_a_killed_master_leaves_at_once_and_a_stopped_one_keeps_its_share_for_the_grace(
    cluster: LocalCluster,
) -> None:
    """The agents' grace and the masters' lease TTL (60 s each) are far longer than this test waits:
    only the refused connection to a killed master's address can move its share on before then. A
    stopped master (SIGSTOP: alive, its kernel still accepts connections) is one that may still place
    work once it runs again, so it must keep its share although its streams break."""
    masters = ["m1", "m2", "m3"]
    for m in masters:
        cluster.start_master(m, lease_ttl=60)
    for node, cap in CAPS.items():
        cluster.start_agent(node, "decode", capacity=cap, grace=60)
    cluster.wait_for(lambda: cluster.share_table() == expected_share_table(masters, CAPS), timeout=15)

    cluster.masters["m3"].proc.kill()
    took = cluster.wait_for(lambda: cluster.full_capacity_held(["m1", "m2"], CAPS), timeout=30)
    print(f"\nSIGKILL with a 60 s grace and TTL: the survivors hold everything after {took:.3f}s")
    for node in CAPS:
        # A node where m3 held nothing may notice a little later: its shares did not wait for it.
        cluster.wait_for(
            lambda node=node: (
                "refuses connections" in cluster.agents[node].proc.tail(5000)  # type: ignore[misc]
                and "master m3" in cluster.agents[node].proc.tail(5000)
            ),
            timeout=20,
        )

    m2 = cluster.masters["m2"]
    m2.proc.send_signal(signal.SIGSTOP)
    try:

        def streams_to_m2_down() -> bool:
            return all(not a.status()["masters"]["m2"]["connected"] for a in cluster.agents.values())

        cluster.wait_for(streams_to_m2_down, timeout=30)  # the agents' keep-alive, about 2 s
        time.sleep(1.5)  # past every try of its address (the last 0.5 s after the stream broke)
        for node, agent in cluster.agents.items():
            st = agent.status()
            assert "m2" in st["handover"]["members"], (node, st["handover"])
            lines = agent.proc.tail(5000).splitlines()
            assert not [ln for ln in lines if "master m2" in ln and "refuses connections" in ln], node
    finally:
        m2.proc.send_signal(signal.SIGCONT)
    cluster.wait_for(lambda: cluster.share_table() == expected_share_table(["m1", "m2"], CAPS), timeout=30)


def test_an_agent_told_not_to_trust_refusals_keeps_a_killed_masters_share_for_the_grace(
    cluster: LocalCluster,
) -> None:
    """--no-gone-on-refusal: behind a firewall that rejects traffic a refusal may come from a live
    master, so that agent leaves the killed master's share to the grace (60 s here; and to its etcd
    key, whose lease lasts 60 s) while the agent at its defaults hands it on at once."""
    for m in ["m1", "m2"]:
        cluster.start_master(m, lease_ttl=60)
    cluster.start_agent("d1", "decode", capacity=4, grace=60, no_gone_on_refusal=True)
    cluster.start_agent("d2", "decode", capacity=4, grace=60)
    caps = {"d1": 4, "d2": 4}
    cluster.wait_for(lambda: cluster.share_table() == expected_share_table(["m1", "m2"], caps), timeout=15)
    assert cluster.agents["d1"].status()["gone_on_refusal"] is False
    assert cluster.agents["d2"].status()["gone_on_refusal"] is True

    cluster.masters["m2"].proc.kill()
    cluster.wait_for(lambda: cluster.masters["m1"].shares().get("d2") == 4, timeout=30)
    cluster.wait_for(lambda: not cluster.agents["d1"].status()["masters"]["m2"]["connected"], timeout=30)
    time.sleep(1.5)  # past every try of its address (the last 0.5 s after the stream broke)
    st = cluster.agents["d1"].status()
    assert "m2" in st["handover"]["members"], st["handover"]
    assert cluster.masters["m1"].shares().get("d1") == 2
    log = cluster.agents["d1"].proc.tail(5000)
    assert "master m2" in log and "counts as gone once its etcd key is gone too" in log, log[-3000:]
    assert "its process is gone" not in log


def test_duplicate_master_and_node_ids_are_refused(cluster: LocalCluster) -> None:
    cluster.start_master("m1")
    cluster.start_agent("d1", "decode", capacity=4)
    dup = subprocess.run(
        [sys.executable, "-m", "pdmaster", "--etcd", cluster.etcd, "--cluster", cluster.cluster,
         "--master-id", "m1", "--http-host", "127.0.0.1", "--http-port", "0",
         "--grpc-host", "127.0.0.1", "--grpc-port", "0"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert dup.returncode == 2
    assert "m1" in dup.stderr and "live" in dup.stderr
    dup = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--etcd", cluster.etcd, "--cluster", cluster.cluster,
         "--node-id", "d1", "--role", "decode", "--endpoint", "http://127.0.0.1:9",
         "--running-max-req-size", "4", "--register-wait", "1"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert dup.returncode == 2
    assert "'d1'" in dup.stderr and "--register-wait" in dup.stderr
    # A health port already taken (here by the master's HTTP port): an error naming the flag.
    taken = cluster.masters["m1"].http_port
    clash = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--etcd", cluster.etcd, "--cluster", cluster.cluster,
         "--node-id", "d2", "--role", "decode", "--endpoint", "http://127.0.0.1:9",
         "--running-max-req-size", "4", "--health-host", "127.0.0.1", "--health-port", str(taken)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert clash.returncode == 2, clash.stderr[-2000:]
    assert "--health-port" in clash.stderr and str(taken) in clash.stderr
    assert "Traceback" not in clash.stderr


def test_missing_capacity_is_read_from_engine_or_fails_clearly(cluster: LocalCluster) -> None:
    argv = [sys.executable, "-m", "nodeagent", "--etcd", cluster.etcd, "--cluster", cluster.cluster,
            "--node-id", "dx", "--role", "decode", "--endpoint"]  # fmt: skip
    # An engine that does not answer yet (in a pod it is still loading its model): the agent waits.
    waiting = subprocess.Popen([*argv, "http://127.0.0.1:9"], stderr=subprocess.PIPE, text=True)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=3)
    finally:
        waiting.kill()
        _, err = waiting.communicate(timeout=10)
    assert "waiting for the engine" in err
    # An engine that answers but does not publish its limit (vLLM): a clear error naming the flag.
    vllm = cluster.start_engine("v1", "decode", 4, api="vllm")
    bad = subprocess.run([*argv, vllm.url], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "--running-max-req-size" in bad.stderr and "max_running_requests" in bad.stderr


def test_legacy_agent_beside_new_agents(cluster: LocalCluster) -> None:
    cluster.start_master("m1")
    cluster.start_master("m2")
    cluster.start_agent("new", "decode", capacity=6)
    cluster.start_agent("old", "decode", capacity=3, no_grant=True)
    cluster.wait_for(
        lambda: cluster.share_table() == {"m1": {"new": 3, "old": 3}, "m2": {"new": 3, "old": 3}}, timeout=15
    )
    nodes = {n["node_id"]: n for n in cluster.masters["m1"].admission()["nodes"]}
    assert nodes["old"]["legacy"] and not nodes["new"]["legacy"]


def test_agent_restart_keeps_epochs_increasing(cluster: LocalCluster) -> None:
    cluster.start_master("m1")
    cluster.start_master("m2")
    cluster.start_agent("d1", "decode", capacity=4)
    cluster.wait_for(lambda: cluster.full_capacity_held(["m1", "m2"], {"d1": 4}), timeout=15)
    e1 = cluster.masters["m1"].epochs()["d1"]
    cluster.agents["d1"].proc.kill()
    cluster.wait_for(lambda: cluster.share_table()["m1"].get("d1") == 0, timeout=5)
    assert cluster.masters["m1"].admission()["capacity"] == 0
    cluster.restart_agent("d1")  # waits for the old lease to expire, then registers again
    cluster.wait_for(lambda: cluster.full_capacity_held(["m1", "m2"], {"d1": 4}), timeout=20)
    assert cluster.masters["m1"].epochs()["d1"] > e1


# -- protocol refusals with a hand-written gRPC client -----------------------------------------


def _register(node: str, cap: int = 4, share: int | None = 2, epoch: int = 100) -> pb.AgentMessage:
    reg = pb.Register(node_id=node, role=pb.DECODE, endpoint="http://127.0.0.1:9", running_max_req_size=cap)
    if share is not None:
        reg.grant.CopyFrom(pb.Grant(capacity_share=share, capacity_epoch=epoch))
    return pb.AgentMessage(register=reg)


def _report(share: int, epoch: int, seq: int) -> pb.AgentMessage:
    return pb.AgentMessage(
        report=pb.Report(grant=pb.Grant(capacity_share=share, capacity_epoch=epoch), seq=seq)
    )


def _exchange(
    addr: str, msgs: list[pb.AgentMessage], hold: float = 0.0
) -> tuple[list[pb.Ack], grpc.RpcError | None]:
    def gen():  # type: ignore[no-untyped-def]
        yield from msgs
        time.sleep(hold)

    acks: list[pb.Ack] = []
    with grpc.insecure_channel(addr) as ch:
        try:
            for m in pb_grpc.NodeCoordinationStub(ch).Connect(gen(), timeout=10):
                acks.append(m.ack)
        except grpc.RpcError as exc:
            return acks, exc
    return acks, None


def test_protocol_rules_on_the_master(cluster: LocalCluster) -> None:
    m = cluster.start_master("m1", max_node_capacity=16)
    addr = f"127.0.0.1:{m.grpc_port}"

    # a lower epoch is ignored and counted; the stream stays up
    acks, err = _exchange(addr, [_register("h1"), _report(3, 101, 1), _report(1, 50, 2)], hold=0.3)
    assert err is None and [a.applied_epoch for a in acks] == [100, 101, 101]
    assert "pdcoord_stale_reports_total 1.0" in http_json_text(m.url + "/metrics")

    _, err = _exchange(addr, [_report(1, 1, 1)])
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first message must be Register" in (err.details() or "")

    _, err = _exchange(addr, [_register("h2", cap=17, share=1)])
    assert err is not None and err.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "--max-node-capacity" in (err.details() or "")

    _, err = _exchange(addr, [_register("h3"), _report(3, 100, 1)])
    assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "epoch 100" in (err.details() or "")

    # a node id held by another live stream
    import threading

    holder = threading.Thread(target=_exchange, args=(addr, [_register("h4")], 1.5))
    holder.start()
    time.sleep(0.5)
    _, err = _exchange(addr, [_register("h4")])
    holder.join()
    assert err is not None and err.code() == grpc.StatusCode.ALREADY_EXISTS and "h4" in (err.details() or "")
    # none of the refused streams changed the node table
    nodes = {n["node_id"]: n for n in http_json(m.url + "/admission")["nodes"]}
    assert set(nodes) <= {"h1", "h3", "h4"} and nodes["h1"]["share"] == 3


def test_etcd_restart_under_running_masters_and_agents(local_cluster: LocalCluster, local_etcd) -> None:  # type: ignore[no-untyped-def]
    c = local_cluster
    c.start_master("m1")
    c.start_master("m2")
    caps = {"d1": 5, "d2": 3}
    for node, cap in caps.items():
        c.start_agent(node, "decode", capacity=cap)
    c.wait_for(lambda: c.full_capacity_held(["m1", "m2"], caps), timeout=15)
    local_etcd.kill()
    time.sleep(1.0)
    # traffic-relevant state survives: shares stay as they were while etcd is down
    assert c.full_capacity_held(["m1", "m2"], caps)
    local_etcd.restart()
    c.start_master("m3")  # membership converges after the restart: watches resumed
    c.wait_for(lambda: c.share_table() == expected_share_table(["m1", "m2", "m3"], caps), timeout=20)
    for p in [*c.masters.values(), *c.agents.values()]:
        assert p.proc.alive, f"{p.proc.name} died across the etcd restart"


def test_a_master_waiting_for_etcd_is_alive_but_neither_registered_nor_ready(
    local_cluster: LocalCluster, local_etcd: LocalEtcd
) -> None:
    """A load balancer must not send to a master no agent can know yet, and a restart script must
    be able to tell "registered" from "waiting": /health answers with ``registered``."""
    c = local_cluster
    local_etcd.kill()
    m = c.start_master("m1", wait=False)

    def probe(path: str) -> tuple[int, dict[str, object]]:
        try:
            return 200, http_json(m.url + path)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    c.wait_for(lambda: probe("/health")[0] == 200, timeout=30)
    assert probe("/health")[1]["registered"] is False
    status, body = probe("/readiness")
    assert (status, body["reason"]) == (503, "not registered in etcd")
    local_etcd.restart()
    c.wait_for(lambda: probe("/health")[1]["registered"] is True, timeout=30)
    c.start_agent("p1", "prefill", capacity=2)
    c.start_agent("d1", "decode", capacity=2)
    c.wait_for(lambda: probe("/readiness")[0] == 200, timeout=20)
    assert m.proc.alive


def test_an_idle_demand_fleet_sends_next_to_nothing(cluster: LocalCluster) -> None:
    """Demand shares beside engines with a load signal: while no master runs or queues
    anything there is no demand to follow, so agents do not poll the masters for it (they did, every
    rebalance interval: two messages per node and master a second on an idle fleet)."""
    from pdcoord.dev.cluster import scrape_metrics

    cluster.start_master("m1")
    cluster.start_master("m2")
    for node in ("d1", "d2"):
        cluster.start_node(node, "decode", 8, share_policy="demand")
    cluster.wait_for(lambda: cluster.full_capacity_held(["m1", "m2"], {"d1": 8, "d2": 8}), timeout=30)

    def received() -> float:
        return scrape_metrics(cluster.masters["m1"].url).get("pdcoord_agent_messages_total", 0.0)

    time.sleep(3)  # start-up's own reports settle
    before = received()
    time.sleep(8)
    # Polling would be 16 here (2 nodes x 1/s); heartbeats (30 s) and load changes allow a few.
    assert received() - before <= 4


def test_an_agent_stops_dialling_a_master_once_its_key_is_gone(cluster: LocalCluster) -> None:
    """A master killed for good: once its key expires the agent drops the link, and nothing of it
    keeps dialling the dead address (gRPC kept a closed channel's transport alive while a finished
    call object still existed, so every agent reconnected to every dead master once a second)."""
    cluster.start_master("m1")
    cluster.start_master("m2")
    agent = cluster.start_agent("d1", "decode", capacity=4)
    cluster.wait_for(lambda: cluster.full_capacity_held(["m1", "m2"], {"d1": 4}), timeout=15)
    dead_port = cluster.masters["m2"].grpc_port
    cluster.masters["m2"].proc.kill()
    # The lease TTL (5 s) lets the key go; the agent then drops the link.
    cluster.wait_for(lambda: set(agent.status()["masters"]) == {"m1"}, timeout=20)
    time.sleep(2.0)  # the agent collects its dropped links' leftovers a second after the drop
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", dead_port))
        listener.listen(16)
        listener.settimeout(0.2)
        dials = 0
        deadline = time.monotonic() + 4.0  # a live link redials at least once a second
        while time.monotonic() < deadline:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            dials += 1
            conn.close()
    assert dials == 0, f"the agent dialled the dropped master's address {dials} times in 4 s"
    assert cluster.full_capacity_held(["m1"], {"d1": 4})
