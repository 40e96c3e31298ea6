"""No process exits on a transient fault (DESIGN §11): etcd that is not there yet at start-up.

Real processes: a master and 20 agents start while nothing listens on the etcd port; etcd comes up
about 10 s later on that port; every agent must end up with a live stream to the master, and none
may have exited meanwhile.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pdcoord.dev.cluster import LocalCluster
from pdcoord.dev.etcd_server import LocalEtcd
from pdcoord.dev.launcher import ProcessGroup, http_ok
from pdcoord.dev.netutil import free_port

AGENTS = 20


def _connected(cluster: LocalCluster, master_id: str) -> set[str]:
    try:
        nodes = cluster.masters[master_id].admission(timeout=5.0)["nodes"]
    except OSError:
        return set()
    return {n["node_id"] for n in nodes if n["connected"] and n["effective_share"] > 0}


@pytest.mark.timeout(240)
def test_master_and_agents_wait_for_etcd(proc_group: ProcessGroup, cluster_name: str, tmp_path: Path) -> None:
    port, peer_port = free_port(), free_port()
    cluster = LocalCluster(proc_group, f"127.0.0.1:{port}", cluster_name)
    cluster.start_master("m1", wait=False)
    nodes = [f"n{i:02d}" for i in range(AGENTS)]
    for i, node in enumerate(nodes):
        cluster.start_agent(node, "decode" if i % 4 else "prefill", capacity=8 + i, wait=False)
    time.sleep(10.0)  # everything retries against a closed port meanwhile
    exited = [p.name for p in proc_group.processes if not p.alive]
    assert not exited, f"exited while etcd was unreachable: {exited}"
    assert not _connected(cluster, "m1")
    # Meanwhile an agent answers on its health port: not ready, and /status says why.
    waiting = cluster.agents["n00"]
    assert not http_ok(f"http://127.0.0.1:{waiting.health_port}/health")
    assert waiting.status()["registered"] is False

    server = LocalEtcd(port, peer_port, data_dir=str(tmp_path / "etcd"), log_path=tmp_path / "etcd.log")
    server.start()
    try:
        deadline = time.monotonic() + 120
        while _connected(cluster, "m1") != set(nodes):
            exited = [f"{p!r}: {p.tail(30)}" for p in proc_group.processes if not p.alive]
            assert not exited, f"exited after etcd came up: {exited}"
            assert time.monotonic() < deadline, (
                f"connected after 120 s: {sorted(_connected(cluster, 'm1'))} of {len(nodes)}"
            )
            time.sleep(0.5)
        assert all(p.alive for p in proc_group.processes)
        # one line per outage, not one per try: the agent logs stay short
        log = cluster.agents["n00"].proc.tail(200)
        tries = [line for line in log.splitlines() if "cannot register" in line and "retrying" in line]
        assert len(tries) == 1, log
    finally:
        proc_group.stop_all()
        server.stop()


def test_backoff_is_capped_doubling_with_bounded_jitter() -> None:
    from pdcoord.retry import Backoff

    low = Backoff(0.2, 5.0, 0.5, rng=lambda: 0.0)
    high = Backoff(0.2, 5.0, 0.5, rng=lambda: 1.0)
    lows = [low.next() for _ in range(10)]
    highs = [high.next() for _ in range(10)]
    assert lows[:3] == pytest.approx([0.1, 0.2, 0.4])
    assert highs[:3] == pytest.approx([0.3, 0.6, 1.2])
    assert max(highs) == pytest.approx(7.5) and min(lows[5:]) == pytest.approx(2.5)
    low.reset()
    assert low.next() == pytest.approx(0.1)


def test_outage_logs_its_start_and_end_once(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from pdcoord.retry import Outage

    outage = Outage(logging.getLogger("t"), "etcd")
    with caplog.at_level(logging.INFO, logger="t"):
        for _ in range(50):
            outage.failed("UNAVAILABLE")
        outage.recovered()
        outage.recovered()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "retrying" in lines[0] and "recovered after 50 failed tries" in lines[1]


def test_registry_tells_share_listeners_once_per_batch() -> None:
    from pdmaster.registry import DECODE, NodeRegistry

    queued: list[object] = []
    reg = NodeRegistry(defer=queued.append)
    seen: list[dict[str, int]] = []
    reg.subscribe(lambda shares: seen.append(dict(shares)))
    streams = {}
    for i in range(5):
        _, streams[i] = reg.register(
            node_id=f"d{i}", role=DECODE, endpoint="http://x", running_max_req_size=8, grant=(4, 1)
        )
    assert reg.capacity == 20 and len(seen) == 1 and len(queued) == 1
    queued.pop()()  # type: ignore[operator]
    assert seen[-1] == {f"d{i}": 4 for i in range(5)}
    reg.disconnect("d2", streams[2])
    assert [n.node_id for n in reg.live(DECODE)] == ["d0", "d1", "d3", "d4"]
    assert reg.capacity == 16
