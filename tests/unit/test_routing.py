"""The router: prefill choice by policy over the live node table, and the prefix index kept in step
with it (a prefill node that leaves can no longer make a request look like a cache hit)."""

from __future__ import annotations

import pytest

from pdmaster.registry import DECODE, PREFILL, NodeRegistry, ProtocolError
from pdmaster.routing import CacheAwarePrefill, RoundRobinPrefill, Router

PROMPT = "a shared system prompt that is long enough to fill several blocks of the index " * 4


def registry_with(*nodes: tuple[str, str]) -> tuple[NodeRegistry, dict[str, int]]:
    reg = NodeRegistry()
    streams = {}
    for node_id, role in nodes:
        _, streams[node_id] = reg.register(
            node_id=node_id,
            role=role,
            endpoint=f"http://{node_id}:1",
            running_max_req_size=4,
            start_args={"bootstrap_port": "9000"} if role == PREFILL else {},
            grant=(4, 1),
        )
    return reg, streams


def test_a_departed_prefill_node_leaves_the_prefix_index() -> None:
    reg, streams = registry_with(("p1", PREFILL), ("p2", PREFILL), ("d1", DECODE))
    router = Router(reg)
    hashes, _ = router.estimate(PROMPT)
    router.routed(reg.nodes["p1"], hashes)
    router.prefill_done(reg.nodes["p1"])
    assert router.estimate(PROMPT)[1].hit_ratio == 1.0
    reg.disconnect("p1", streams["p1"])
    # Without the fix the index still holds p1's prefix and the request classifies as a cache hit.
    est = router.estimate(PROMPT)[1]
    assert est.hit_ratio == 0.0 and "p1" not in router.index.nodes()
    assert router.prefill(est) is reg.nodes["p2"]


def test_a_prefill_node_whose_share_drops_to_zero_leaves_the_index_too() -> None:
    reg, streams = registry_with(("p1", PREFILL), ("d1", DECODE))
    router = Router(reg)
    hashes, _ = router.estimate(PROMPT)
    router.routed(reg.nodes["p1"], hashes)
    reg.apply_grant("p1", streams["p1"], 0, 2)
    assert router.estimate(PROMPT)[1].hit_ratio == 0.0
    assert router.prefill(router.estimate(PROMPT)[1]) is None


def test_cache_aware_prefers_the_hit_node_and_round_robin_rotates() -> None:
    reg, _ = registry_with(("p1", PREFILL), ("p2", PREFILL), ("d1", DECODE))
    router = Router(reg, CacheAwarePrefill())
    hashes, _ = router.estimate(PROMPT)
    router.routed(reg.nodes["p2"], hashes)
    router.prefill_done(reg.nodes["p2"])
    assert [router.prefill(router.estimate(PROMPT)[1]).node_id for _ in range(4)] == ["p2"] * 4  # type: ignore[union-attr]
    rr = Router(reg, RoundRobinPrefill())
    picked = {rr.prefill(rr.estimate(PROMPT)[1]).node_id for _ in range(4)}  # type: ignore[union-attr]
    assert picked == {"p1", "p2"}


def test_decode_is_the_lease_placement() -> None:
    reg, _ = registry_with(("p1", PREFILL), ("d1", DECODE))
    router = Router(reg)
    assert router.decode("d1") is reg.nodes["d1"]
    assert router.decode(None) is None and router.decode("gone") is None


def test_bootstrap_port_is_parsed_once_at_registration() -> None:
    reg, _ = registry_with(("p1", PREFILL))
    assert reg.nodes["p1"].bootstrap_port == 9000
    with pytest.raises(ProtocolError, match="bootstrap_port"):
        reg.register(
            node_id="p2",
            role=PREFILL,
            endpoint="http://p2:1",
            running_max_req_size=4,
            start_args={"bootstrap_port": "nine"},
        )
