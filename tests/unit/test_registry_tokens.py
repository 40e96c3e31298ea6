"""Token capacity in the master's node registry (DESIGN §13): a node's KV pool and this master's
token share of it, under the same epoch as its slots, and the engine's feedback on the charges."""

from __future__ import annotations

import pytest

from pdcoord.load import EngineLoad
from pdmaster.registry import DECODE, GrantResult, NodeRegistry, ProtocolError, token_feedback


def reg(r: NodeRegistry, node: str = "d1", pool: int | None = 1000, tokens: int | None = 400):
    return r.register(
        node_id=node,
        role=DECODE,
        endpoint="http://127.0.0.1:1",
        running_max_req_size=8,
        grant=(4, 10),
        kv_tokens=pool,
        token_share=tokens,
    )


def test_token_share_travels_with_the_slot_share() -> None:
    r = NodeRegistry()
    seen: list[dict[str, tuple[int, int]]] = []
    r.subscribe_changes(lambda changes: seen.append(dict(changes)))
    node, s = reg(r)
    assert (node.kv_tokens, node.token_share, node.effective_token_share) == (1000, 400, 400)
    assert r.token_changes(seen[-1]) == ({"d1": 400}, {"d1": 1000})
    # a new epoch that moves only the tokens is a change admission hears of
    assert r.apply_grant("d1", s, 4, 11, 600) is GrantResult.APPLIED
    assert seen[-1] == {"d1": (4, 8)}
    assert r.token_changes(seen[-1]) == ({"d1": 600}, {"d1": 1000})
    assert r.snapshot()[0]["effective_token_share"] == 600
    assert r.snapshot()[0]["capacity_unit"] == "slots+tokens"


def test_same_epoch_with_other_tokens_is_a_protocol_error() -> None:
    r = NodeRegistry()
    _, s = reg(r)
    assert r.apply_grant("d1", s, 4, 10, 400) is GrantResult.UNCHANGED
    with pytest.raises(ProtocolError) as e:
        r.apply_grant("d1", s, 4, 10, 500)
    assert e.value.code == "FAILED_PRECONDITION"


def test_token_share_above_the_pool_is_refused() -> None:
    r = NodeRegistry()
    with pytest.raises(ProtocolError, match=r"token_share 1001 outside 0\.\.1000"):
        reg(r, tokens=1001)
    _, s = reg(r)
    with pytest.raises(ProtocolError, match="token_share"):
        r.apply_grant("d1", s, 4, 11, 2000)
    with pytest.raises(ProtocolError, match="kv_tokens"):
        NodeRegistry(max_kv_tokens=100).register(
            node_id="d2", role=DECODE, endpoint="http://127.0.0.1:1", running_max_req_size=8, kv_tokens=101
        )


def test_a_node_without_a_pool_runs_on_slots_alone() -> None:
    r = NodeRegistry()
    seen: list[dict[str, tuple[int, int]]] = []
    r.subscribe_changes(lambda changes: seen.append(dict(changes)))
    node, s = reg(r, pool=None, tokens=123)  # a share of nothing means nothing
    assert node.token_share is None and node.effective_token_share is None
    assert r.token_changes(seen[-1]) == ({}, {})
    assert r.snapshot()[0]["capacity_unit"] == "slots"
    assert r.apply_grant("d1", s, 4, 11, 99) is GrantResult.APPLIED
    assert node.token_share is None


def test_an_agent_that_grants_no_tokens_sets_no_token_limit() -> None:
    r = NodeRegistry()
    node, _ = reg(r, tokens=None)
    assert node.kv_tokens == 1000 and node.effective_token_share is None


def test_a_node_down_offers_no_tokens() -> None:
    r = NodeRegistry()
    node, s = reg(r)
    r.report_engine("d1", s, True, "dead")
    assert node.effective_token_share == 0
    r.disconnect("d1", s)
    assert node.effective_token_share == 0


def test_retractions_lower_the_charged_share_then_it_recovers() -> None:
    r = NodeRegistry()
    seen: list[dict[str, tuple[int, int]]] = []
    r.subscribe_changes(lambda changes: seen.append(dict(changes)))
    node, s = reg(r, tokens=1000)
    r.report_load("d1", s, EngineLoad(probe_ok=True, retractions=5))  # first word: no news
    assert node.effective_token_share == 1000
    r.report_load("d1", s, EngineLoad(probe_ok=True, retractions=7))
    assert node.effective_token_share == 850
    assert r.token_changes(seen[-1]) == ({"d1": 850}, {"d1": 1000})
    for _ in range(20):
        r.report_load("d1", s, EngineLoad(probe_ok=True, retractions=7))
    assert node.effective_token_share == 1000
    # a reconnect of the same engine keeps what the engine said
    r.report_load("d1", s, EngineLoad(probe_ok=True, retractions=9))
    r.disconnect("d1", s)
    again, _ = reg(r, tokens=1000)
    assert again.token_scale == pytest.approx(0.85)


def test_token_feedback_is_floored_and_ignores_a_restarted_engine() -> None:
    scale = 1.0
    for k in range(100):
        scale = token_feedback(scale, k, k + 1)
    assert scale == 0.5
    assert token_feedback(0.5, 100, 3) == pytest.approx(0.52)  # the count went down: no news
