"""Engine faults end to end (DESIGN §7): a decode engine is SIGKILLed under light load while its agent
stays up; the master stops placing work there, and takes the node back when the engine returns.

Real processes on loopback: etcd, a master, agents and pdsim engines.
"""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

import pytest

from pdcoord.cluster import LocalCluster, http_json
from pdcoord.launcher import ProcessGroup
from tests.cluster_helpers import Load, LoadConfig, summarize

pytestmark = pytest.mark.cluster

DECODE = {"d1": 4, "d2": 4}
PREFILL = {"p1": 8}


def _node(c: LocalCluster, node: str) -> dict[str, Any]:
    nodes = c.masters["m1"].admission()["nodes"]
    found: dict[str, Any] = next(n for n in nodes if n["node_id"] == node)
    return found


def _engine_up_gauge(c: LocalCluster, node: str) -> float | None:
    with urllib.request.urlopen(c.masters["m1"].url + "/metrics", timeout=3) as r:
        text = r.read().decode()
    m = re.search(r'^pdcoord_node_engine_up\{[^}]*node="' + node + r'"[^}]*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def _agent_status(c: LocalCluster, node: str) -> dict[str, Any]:
    argv = c.agents[node].proc.argv
    port = argv[argv.index("--health-port") + 1]
    status: dict[str, Any] = http_json(f"http://127.0.0.1:{port}/status")
    return status


def test_killed_decode_engine_leaves_capacity_and_comes_back(etcd, proc_group: ProcessGroup) -> None:  # type: ignore[no-untyped-def]
    c = LocalCluster(proc_group, etcd.endpoint, f"faults-{time.monotonic_ns()}")
    c.start_master("m1", model="sim")
    for name, cap in PREFILL.items():
        c.start_node(name, "prefill", cap, model="sim")
    for name, cap in DECODE.items():
        c.start_node(name, "decode", cap, model="sim")
    caps = {**PREFILL, **DECODE}
    c.wait_for(lambda: c.full_capacity_held(["m1"], caps), timeout=30)
    assert _node(c, "d2")["engine_up"] is True
    assert _engine_up_gauge(c, "d2") == 1.0

    load = Load(
        lambda: [("m1", c.masters["m1"].url)],
        LoadConfig(users=3, max_tokens=8, request_timeout_s=30, gang_fraction=0.1, session_fraction=0.2),
    ).start()
    try:
        load.wait_for_results(10, timeout=30)
        c.engines["d2"].proc.kill()  # the engine dies; its agent stays up

        def gone() -> bool:
            n = _node(c, "d2")
            return bool(n["engine_down"]) and n["effective_share"] == 0

        c.wait_for(gone, timeout=30, interval=0.1)
        t_gone = time.monotonic()
        assert c.masters["m1"].admission()["capacity"] == DECODE["d1"]
        assert _node(c, "d2")["engine_reason"]  # why: the agent's last error
        assert _engine_up_gauge(c, "d2") == 0.0
        agent = _agent_status(c, "d2")
        assert agent["engine"]["up"] is False and agent["engine"]["reason"]
        assert agent["masters"]["m1"]["connected"] is True  # the stream stays up

        n_before = len(load.snapshot())
        load.wait_for_results(n_before + 15, timeout=60)  # requests keep flowing on d1

        c.engines["d2"].proc.start()  # the same argv: the same port and bootstrap port
        c.wait_for(lambda: _node(c, "d2")["effective_share"] == DECODE["d2"], timeout=30, interval=0.1)
        assert _node(c, "d2")["engine_up"] is True
        assert c.masters["m1"].admission()["capacity"] == sum(DECODE.values())
        assert _engine_up_gauge(c, "d2") == 1.0
        n_back = len(load.snapshot())
        load.wait_for_results(n_back + 10, timeout=60)
    finally:
        results = load.stop()

    after = [r for r in results if r.started >= t_gone]
    assert after, "no request ran after the node left"
    bad = [r for r in after if r.status not in (200, 429) or (r.status == 200 and r.error)]
    assert not bad, f"after the node left, requests must end in 200 or 429: {summarize(bad)}"
    assert any(r.ok for r in after)
