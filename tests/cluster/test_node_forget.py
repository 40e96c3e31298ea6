"""A master forgets the nodes that are gone: an agent replaced under a new id (a pod replacement)
disappears from the master's node listing and from its /metrics, so per-node alerts resolve and the
table does not grow forever; the replacement is registered anew."""

from __future__ import annotations

import urllib.request

import pytest

from pdcoord.dev.cluster import LocalCluster

pytestmark = pytest.mark.cluster


def _metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=3) as r:
        return str(r.read().decode())


def _listed(cluster: LocalCluster, node_id: str) -> bool:
    return node_id in {n["node_id"] for n in cluster.masters["m1"].admission()["nodes"]}


def _in_metrics(cluster: LocalCluster, node_id: str) -> bool:
    return f'node="{node_id}"' in _metrics_text(cluster.masters["m1"].url)


def test_a_replaced_agent_is_forgotten_and_its_replacement_registered(cluster: LocalCluster) -> None:
    cluster.start_master("m1")
    old = cluster.start_agent("d-old", "decode", capacity=4)
    cluster.wait_for(lambda: cluster.masters["m1"].shares().get("d-old") == 4, timeout=20)
    assert _in_metrics(cluster, "d-old")

    # a graceful stop: the agent says Leaving, the master runs nothing there
    old.proc.terminate()
    cluster.wait_for(lambda: not _listed(cluster, "d-old") and not _in_metrics(cluster, "d-old"), timeout=20)
    cluster.start_agent("d-new", "decode", capacity=4)
    cluster.wait_for(lambda: cluster.masters["m1"].shares().get("d-new") == 4, timeout=20)
    assert 'pdcoord_node_connected{node="d-new"} 1.0' in _metrics_text(cluster.masters["m1"].url)
    assert "pdcoord_nodes_forgotten_total 1.0" in _metrics_text(cluster.masters["m1"].url)


def test_a_killed_agent_is_forgotten_once_its_etcd_key_is_gone(cluster: LocalCluster) -> None:
    cluster.start_master("m1")
    killed = cluster.start_agent("d-killed", "decode", capacity=4, lease_ttl=2)
    cut = cluster.start_agent("d-kept", "decode", capacity=4)
    cluster.wait_for(
        lambda: cluster.masters["m1"].shares() == {"d-killed": 4, "d-kept": 4},
        timeout=20,
    )
    killed.proc.kill()  # no Leaving: its stream breaks and its key goes when its lease expires
    cluster.wait_for(lambda: cluster.masters["m1"].shares().get("d-killed") == 0, timeout=20)
    # the key expires after the agent's TTL (2 s), the master looks at a disconnected node's key
    # every 10 s
    cluster.wait_for(
        lambda: not _listed(cluster, "d-killed") and not _in_metrics(cluster, "d-killed"), timeout=45
    )
    assert cut.proc.alive and _listed(cluster, "d-kept") and _in_metrics(cluster, "d-kept")
    # it comes back under the same id: registered anew
    cluster.restart_agent("d-killed")
    cluster.wait_for(lambda: cluster.masters["m1"].shares().get("d-killed") == 4, timeout=30)
