"""What an agent reads from its engine when no flag says it, and the load signal a stock engine gives.

Real pdsim engines in the SGLang flavour (``--api sglang``), one of them without ``/metrics`` (SGLang
serves it only with ``--enable-metrics``), real agents and masters on loopback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from pdcoord.dev.cluster import LocalCluster
from pdcoord.dev.netutil import free_port

pytestmark = pytest.mark.cluster


def _node(c: LocalCluster, master: str, node: str) -> dict[str, Any]:
    return next(n for n in c.masters[master].admission()["nodes"] if n["node_id"] == node)


def test_an_agent_reads_capacity_bootstrap_port_and_model_from_the_engine(cluster: LocalCluster) -> None:
    c = cluster
    c.start_master("m1")
    p = c.start_engine("p1", "prefill", 6, api="sglang", disable_metrics=True, model="served-name")
    d = c.start_engine("d1", "decode", 5, api="sglang", disable_metrics=True)
    # No --running-max-req-size, --bootstrap-port or --model: all come from /get_server_info.
    c.start_agent("p1", "prefill", endpoint=p.url)
    c.start_agent("d1", "decode", endpoint=d.url)
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"p1": 6, "d1": 5}), timeout=30)
    p1 = _node(c, "m1", "p1")
    assert p1["bootstrap_port"] == p.bootstrap_port
    assert p1["start_args"]["model"] == "served-name"
    # /metrics is off: the agents fall back to what a stock SGLang serves
    signal = c.agents["d1"].status()["load"]["signal"]
    assert signal["signal"].endswith(("/v1/loads", "/get_load")), signal
    assert "/metrics" in str(signal["problems"])
    # and the masters route through them
    c.wait_for(lambda: _node(c, "m1", "d1")["load"]["probe_ok"], timeout=30)


def test_an_agent_waits_for_an_engine_that_is_not_up_yet(cluster: LocalCluster) -> None:
    c = cluster
    c.start_master("m1")
    port = free_port()
    agent = c.start_agent("d1", "decode", endpoint=f"http://127.0.0.1:{port}", wait=False)
    time.sleep(2.0)
    assert agent.proc.alive, agent.proc.tail()  # still waiting, not exited
    c.start_engine("d1", "decode", 3, api="sglang", port=port)
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"d1": 3}), timeout=30)


def test_a_prefill_sglang_engine_without_a_bootstrap_port_is_refused_at_start(cluster: LocalCluster) -> None:
    p = cluster.start_engine("p1", "prefill", 4, api="sglang", bootstrap_port=0)
    out = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--etcd", cluster.etcd, "--node-id", "p1", "--role", "prefill",
         "--endpoint", p.url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "--bootstrap-port" in out.stderr and "disaggregation_bootstrap_port" in out.stderr


def test_a_crashed_master_is_failed_over_without_engine_metrics(cluster: LocalCluster) -> None:
    """Strict handover frees a crashed master's slots once the engine shows its requests ended: with
    /metrics off that sample comes from SGLang's load endpoint, well before --orphan-timeout."""
    c = cluster
    c.start_master("m1")
    c.start_master("m2")
    d = c.start_engine("d1", "decode", 8, api="sglang", disable_metrics=True)
    c.start_agent("d1", "decode", endpoint=d.url, capacity=8, orphan_timeout=120)
    c.wait_for(lambda: c.full_capacity_held(["m1", "m2"], {"d1": 8}), timeout=30)
    c.masters["m1"].proc.kill()
    # Within 60 s, half of --orphan-timeout: the engine's load sample freed the slots, not the timeout.
    c.wait_for(lambda: _node(c, "m2", "d1")["effective_share"] == 8, timeout=60)


def test_the_kv_pool_comes_from_the_engine_from_the_flag_or_is_slots_only(cluster: LocalCluster) -> None:
    """SGLang publishes max_total_num_tokens (/get_server_info, /metrics); --kv-tokens overrides it;
    an engine that publishes none (pdsim in the vLLM flavour has no vllm:cache_config_info) runs on
    slots alone, visibly in the agent's /status and in `pdcoord status`."""
    c = cluster
    c.start_master("m1")
    d1 = c.start_engine("d1", "decode", 4, api="sglang", max_total_tokens=40000)
    d2 = c.start_engine("d2", "decode", 4, api="sglang", max_total_tokens=40000)
    d3 = c.start_engine("d3", "decode", 4, api="vllm")
    c.start_agent("d1", "decode", endpoint=d1.url, capacity=4)
    c.start_agent("d2", "decode", endpoint=d2.url, capacity=4, kv_tokens=10000)
    c.start_agent("d3", "decode", endpoint=d3.url, capacity=4)
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"d1": 4, "d2": 4, "d3": 4}), timeout=30)
    want = {
        "d1": (40000, "engine", "slots and kv tokens"),
        "d2": (10000, "flag", "slots and kv tokens"),
        "d3": (None, None, "slots only"),
    }

    def pools() -> dict[str, tuple[Any, Any, Any]]:
        out = {}
        for n in want:
            st = c.agents[n].status()
            out[n] = (st["kv_tokens"], st["kv_tokens_source"], st["capacity_unit"])
        return out

    c.wait_for(lambda: pools() == want, timeout=30)
    # the master reads each pool from the Register; its token share is the whole pool once its Acks
    # count tokens (a master that counts none gets no token share, and places on slots as before)
    for n, pool in (("d1", 40000), ("d2", 10000), ("d3", None)):
        assert _node(c, "m1", n).get("kv_tokens") == pool

    def token_shares_settled() -> bool:
        for n, pool in (("d1", 40000), ("d2", 10000)):
            counts = c.agents[n].status()["masters"]["m1"]["active_tokens"] is not None
            if _node(c, "m1", n).get("token_share") != (pool if counts else None):
                return False
        return _node(c, "m1", "d3").get("token_share") is None

    c.wait_for(token_shares_settled, timeout=30)
    assert "publishes no KV pool" in c.agents["d3"].proc.tail(200)
    argv = [sys.executable, "-c", "from pdcoord.dev.cli import main; main()", "status",
            "--etcd", c.etcd, "--cluster", c.cluster, "--json"]  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    nodes = {n["node_id"]: n for n in json.loads(out.stdout)["nodes"]}
    assert nodes["d1"]["kv_tokens"] == 40000 and nodes["d2"]["kv_tokens"] == 10000
    assert nodes["d3"]["capacity_unit"] == "slots only"


def test_a_pool_found_after_the_streams_opened_reaches_the_masters(cluster: LocalCluster) -> None:
    """The engine was not up when the agent started (capacity from the flag): its pool comes later,
    and since only a Register says the pool, every stream registers again with it."""
    c = cluster
    c.start_master("m1")
    port = free_port()
    c.start_agent("d1", "decode", endpoint=f"http://127.0.0.1:{port}", capacity=3, no_health_check=True)
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"d1": 3}), timeout=30)
    assert _node(c, "m1", "d1").get("kv_tokens") is None
    c.start_engine("d1", "decode", 3, api="sglang", port=port, max_total_tokens=30000)
    c.wait_for(lambda: c.agents["d1"].status()["kv_tokens"] == 30000, timeout=30)
    c.wait_for(lambda: _node(c, "m1", "d1").get("kv_tokens") == 30000, timeout=30)
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"d1": 3}), timeout=30)
