"""An agent reports when something a master uses changed, or for the heartbeat; an engine that stays
down changes nothing, so it sends no more than one beside an idle engine.

Two clusters side by side on one etcd, each a master and one decode agent with its load probe and
liveness check on (as beside a real engine): in one the engine is an idle pdsim, in the other nothing
listens at the engine's address. Each master counts the Reports its agent sends
(``pdcoord_agent_messages_total``) over the same window. Before this was fixed the agent of a dead
engine asked its masters for their demand every second (its load probe failed, and without a load
signal an agent keeps asking) and each master answered every Report with an Ack.

Real processes on loopback: etcd, masters, agents and a pdsim engine.
"""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

import pytest

from pdcoord.dev.cluster import LocalCluster
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.dev.netutil import free_port

pytestmark = pytest.mark.cluster

WINDOW_S = 12.0


def reports_received(c: LocalCluster, master: str) -> float:
    with urllib.request.urlopen(c.masters[master].url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(
        r'^pdcoord_agent_messages_total\{(?=[^}]*direction="received")(?=[^}]*kind="report")[^}]*\} (\S+)$',
        text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


def _node(c: LocalCluster, master: str, node: str) -> dict[str, Any]:
    nodes = c.masters[master].admission()["nodes"]
    found: dict[str, Any] = next(n for n in nodes if n["node_id"] == node)
    return found


def test_an_agent_whose_engine_stays_down_sends_no_more_than_beside_an_idle_engine(
    etcd: Any, proc_group: ProcessGroup
) -> None:
    tag = time.monotonic_ns()
    # (cluster, its master, its node): process names differ, as they share one process group
    idle = (LocalCluster(proc_group, etcd.endpoint, f"quiet-idle-{tag}"), "m-idle", "d-idle")
    down = (LocalCluster(proc_group, etcd.endpoint, f"quiet-down-{tag}"), "m-down", "d-down")
    for c, m, _ in (idle, down):
        c.start_master(m)
    idle[0].start_node(idle[2], "decode", 4)
    # Nothing listens there: the probe and the liveness check fail from the start.
    down[0].start_agent(down[2], "decode", endpoint=f"http://127.0.0.1:{free_port()}", capacity=4)
    for c, m, n in (idle, down):
        # the agent granted its master the whole node, and the master holds it (in use or not)
        c.wait_for(lambda c=c, m=m, n=n: _node(c, m, n)["share"] == 4, timeout=30)  # type: ignore[misc]
    # The dead engine is declared down (3 failed checks); the idle one stays up.
    down[0].wait_for(lambda: _node(*down)["engine_down"] is True, timeout=30)
    assert _node(*idle)["engine_down"] is False
    time.sleep(3.0)  # past the start's reports (the verdict's flip, the first Acks)

    runs = {"idle": idle, "down": down}
    before = {k: reports_received(c, m) for k, (c, m, _) in runs.items()}
    t0 = time.monotonic()
    time.sleep(WINDOW_S)
    after = {k: reports_received(c, m) for k, (c, m, _) in runs.items()}
    window = time.monotonic() - t0
    sent = {k: after[k] - before[k] for k in after}
    print(
        f"\nReports in {window:.1f} s from an agent beside an idle engine: {sent['idle']:g}; "
        f"beside a dead engine: {sent['down']:g}"
    )
    # Before the fix the dead engine's agent sent one a second (about 12 here). The heartbeat
    # (--report-interval, 30 s) may fall into the window once for each.
    assert sent["down"] <= sent["idle"] + 1, sent
    assert sent["down"] <= 2, sent
    assert _node(*down)["engine_down"] is True  # still down, still known as down
