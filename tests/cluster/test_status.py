"""`pdcoord status` against a running local cluster, run as an operator runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from pdcoord.dev.cluster import LocalCluster

pytestmark = pytest.mark.cluster

CAPS = {"p1": 8, "d1": 4, "d2": 3}
# A deadline, not a measurement: this machine is small and shared; the cluster usually settles in
# a few seconds.
DEADLINE_S = 90.0


def status(cluster: LocalCluster, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", "from pdcoord.dev.cli import main; main()", "status",
            "--etcd", cluster.etcd, "--cluster", cluster.cluster, *extra]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def status_json(cluster: LocalCluster) -> tuple[int, dict[str, Any]]:
    r = status(cluster, "--json")
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return r.returncode, json.loads(r.stdout)


def poll_until_ok(cluster: LocalCluster) -> dict[str, Any]:
    """The first look that exits 0, checking that every look that did not named its problem."""
    start = time.monotonic()
    while True:
        code, doc = status_json(cluster)
        if code == 0:
            assert doc["ok"] and not doc["problems"]
            return doc
        assert doc["problems"], doc  # non-zero always says why
        if time.monotonic() - start > DEADLINE_S:
            pytest.fail(f"pdcoord status never exited 0 within {DEADLINE_S:.0f}s: {doc['problems']}")
        time.sleep(0.5)


def test_status_shows_the_fleet_and_fails_while_a_killed_master_is_missed(cluster: LocalCluster) -> None:
    cluster.start_master("m1")
    # A lease that outlives the kill by several seconds: the window in which status must fail does
    # not depend on how fast this machine runs the command.
    cluster.start_master("m2", lease_ttl=15)
    for name, cap in CAPS.items():
        cluster.start_node(name, "prefill" if name.startswith("p") else "decode", cap)
    cluster.wait_for(lambda: cluster.full_capacity_held(["m1", "m2"], CAPS), timeout=60)

    # healthy: every master and node, each node's capacity split between both masters, exit 0
    doc = poll_until_ok(cluster)
    assert [m["master_id"] for m in doc["masters"]] == ["m1", "m2"]
    assert all(m["answered"] and m["capacity"] > 0 for m in doc["masters"])
    assert sorted(n["node_id"] for n in doc["nodes"]) == sorted(CAPS)
    for n in doc["nodes"]:
        assert n["capacity"] == CAPS[n["node_id"]] == n["held"]
        assert n["engine"]["up"] is True
        shares = n["shares"]
        assert set(shares) == {"m1", "m2"} and all(s["connected"] and not s["stale"] for s in shares.values())
        assert sum(s["share"] for s in shares.values()) == n["capacity"]
        assert {s["epoch"] for s in shares.values()} == {n["epoch"]}
    assert doc["decode_capacity"] == doc["decode_held"] == CAPS["d1"] + CAPS["d2"]

    text = status(cluster)
    assert text.returncode == 0, text.stdout + text.stderr
    for word in ("m1", "m2", *CAPS, "status: ok"):
        assert word in text.stdout, text.stdout

    # m2 SIGKILLed: its key stays in etcd until its lease expires, and nobody answers for it
    cluster.masters["m2"].proc.kill()
    r = status(cluster)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "master m2 is registered in etcd but" in r.stdout, r.stdout

    # non-zero until the survivor holds the whole capacity (and m2's key is gone)
    doc = poll_until_ok(cluster)
    assert [m["master_id"] for m in doc["masters"]] == ["m1"]
    for n in doc["nodes"]:
        assert n["held"] == n["capacity"] == n["shares"]["m1"]["share"], n
    assert cluster.full_capacity_held(["m1"], CAPS)


def test_status_without_etcd_or_masters(cluster: LocalCluster) -> None:
    # nothing registered under this cluster name: an empty fleet is a problem, not a crash
    r = status(cluster, "--settle", "0")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no master is registered" in r.stdout and "no node agent is registered" in r.stdout
    # etcd that does not answer: exit 2, naming it
    r = subprocess.run(
        [sys.executable, "-m", "pdcoord.status", "--etcd", "127.0.0.1:1", "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "127.0.0.1:1" in r.stderr
