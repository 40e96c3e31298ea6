"""A master that cannot reach etcd stops admitting before its lease could expire, and comes back.

etcd is frozen with SIGSTOP (its kernel keeps the connections open, nothing answers: what a silent cut
looks like to the master) for longer than the master's lease TTL, while a master, its agents and
their engines run. etcd is frozen for the agents too here: what matters is that the master stops on
its own clock, without an answer from etcd telling it anything.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
from typing import Any

import pytest

from pdcoord.dev.cluster import LocalCluster, http_json, scrape_metrics
from pdcoord.dev.etcd_server import LocalEtcd
from tests.cluster.cluster_helpers import ready
from tests.cluster.test_dataplane import post

pytestmark = pytest.mark.cluster

TTL = 3


def _completion(url: str) -> Any:
    return post(url + "/v1/completions", {"model": "m", "prompt": "hello there", "max_tokens": 4}, timeout=10)


def _readiness(url: str) -> dict[str, Any]:
    try:
        return dict(http_json(url + "/readiness"))
    except urllib.error.HTTPError as exc:
        return dict(json.loads(exc.read()))


def test_a_master_cut_from_etcd_stops_admitting_on_its_own_clock_and_comes_back(
    local_cluster: LocalCluster, local_etcd: LocalEtcd
) -> None:
    c = local_cluster
    m = c.start_master("m1", lease_ttl=TTL)
    c.start_node("p1", "prefill", 4)
    c.start_node("d1", "decode", 4)
    c.wait_for(lambda: ready(m.url), timeout=30)
    assert _completion(m.url).status_code == 200
    metrics = scrape_metrics(m.url)
    assert metrics["pdcoord_master_lease_held"] == 1 and metrics["pdcoord_admission_capacity_slots"] == 4

    assert local_etcd.pid is not None
    os.kill(local_etcd.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        took = c.wait_for(lambda: scrape_metrics(m.url)["pdcoord_master_lease_held"] == 0, timeout=TTL + 15)
        print(f"the master stopped counting on its lease {took:.2f} s after etcd froze (TTL {TTL} s)")
        # The last renewal etcd confirmed was sent at most TTL/3 before the freeze; the master gives
        # up on it half a second before that renewal's TTL ends. Generous here (a loaded machine):
        # the exact rule is pinned by the unit tests.
        assert took <= TTL + 1.0
        metrics = scrape_metrics(m.url)
        assert metrics["pdcoord_admission_capacity_slots"] == 0
        assert metrics["pdcoord_master_lease_losses_total"] >= 1
        body = _readiness(m.url)
        assert body["ready"] is False and "lease" in body["reason"]
        refused = _completion(m.url)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "etcd_lease_lost"
        assert refused.headers["Retry-After"] == "1"
        # etcd stays frozen past the TTL: the lease may expire when it resumes
        time.sleep(max(0.0, stopped + TTL + 1.5 - time.monotonic()))
        assert scrape_metrics(m.url)["pdcoord_master_lease_held"] == 0
    finally:
        os.kill(local_etcd.pid, signal.SIGCONT)
    c.wait_for(lambda: ready(m.url), timeout=40)
    c.wait_for(lambda: _completion(m.url).status_code == 200, timeout=30)
    metrics = scrape_metrics(m.url)
    assert metrics["pdcoord_master_lease_held"] == 1 and metrics["pdcoord_admission_capacity_slots"] == 4
    assert m.proc.alive and all(a.proc.alive for a in c.agents.values())
