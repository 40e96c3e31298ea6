"""The node's KV pool: the --kv-tokens flag, what the agent registers and shows, slots only."""

from __future__ import annotations

import json

import pytest

from nodeagent.main import build_parser
from tests.unit.agent_helpers import offline_agent

BASE = ["--etcd", "127.0.0.1:1", "--node-id", "d1", "--role", "decode", "--endpoint", "http://e:1"]


def test_the_flag_sets_the_pool_and_refuses_a_negative_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args([*BASE, "--kv-tokens", "300000"]).kv_tokens == 300000
    assert build_parser().parse_args(BASE).kv_tokens == 0  # 0: read it from the engine
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*BASE, "--kv-tokens", "-5"])
    assert exc.value.code == 2
    assert "--kv-tokens" in capsys.readouterr().err


def test_register_node_key_and_status_carry_the_pool() -> None:
    agent = offline_agent(4, kv_tokens=1000, discover_kv_tokens=False)
    reg = agent._register_msg("m1", 7).register
    assert reg.HasField("kv_tokens") and reg.kv_tokens == 1000
    assert json.loads(agent._node_value())["kv_tokens"] == 1000
    st = agent.status()
    assert (st["kv_tokens"], st["kv_tokens_source"]) == (1000, "flag")
    assert st["capacity_unit"] == "slots and kv tokens"


def test_an_engine_without_a_pool_is_slots_only_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    agent = offline_agent(4)
    assert not agent._register_msg("m1", 7).register.HasField("kv_tokens")
    assert agent.status()["capacity_unit"] == "slots (kv pool not known yet)"
    agent._pool_unpublished()
    agent._pool_unpublished()
    warnings = [r for r in caplog.records if "publishes no KV pool" in r.getMessage()]
    assert len(warnings) == 1 and "slots only" in warnings[0].getMessage()
    assert "http://127.0.0.1:1" in warnings[0].getMessage()
    st = agent.status()
    assert st["kv_tokens"] is None and st["capacity_unit"] == "slots only"
    assert json.loads(agent._node_value())["kv_tokens"] is None


def test_a_pool_found_later_is_registered_anew() -> None:
    agent = offline_agent(4)
    assert agent.set_kv_tokens(5000, "engine")
    assert not agent.set_kv_tokens(5000, "engine")
    assert agent._register_msg("m1", 8).register.kv_tokens == 5000
    assert agent.status()["kv_tokens_source"] == "engine"


def test_grants_carry_token_shares_to_masters_that_count_tokens() -> None:
    import time

    from nodeagent.agent import MasterLink
    from pdcoord.v1 import coordination_pb2 as pb

    agent = offline_agent(4, kv_tokens=1000, discover_kv_tokens=False, load_urls=())
    s = agent.slicer
    now = time.monotonic()
    s.set_masters(["m1", "m2"], now, time.time_ns())
    for m in ("m1", "m2"):
        s.stream_up(m, now, time.time_ns())
    new = pb.Ack(master_id="m1", applied_epoch=s.epoch, active_tokens=0, wanted_tokens=0, kept_tokens=0)
    old = pb.Ack(master_id="m2", applied_epoch=s.epoch)
    agent._on_ack(MasterLink("m1", "x:1"), new)
    agent._on_ack(MasterLink("m2", "x:2"), old)
    g1, g2 = agent._grant("m1"), agent._grant("m2")
    assert g1 is not None and g2 is not None
    assert g1.HasField("token_share") and g1.token_share == s.token_share_for("m1")
    assert g1.capacity_epoch == g2.capacity_epoch == s.epoch  # one epoch for both
    assert not g2.HasField("token_share")  # an earlier release: as before
    st = agent.status()
    assert st["handover"]["tokens"]["slots_only_masters"] == ["m2"]
    # no pool: no token share for anyone
    plain = offline_agent(4, discover_kv_tokens=False, load_urls=())
    plain.slicer.set_masters(["m1"], now, time.time_ns())
    grant = plain._grant("m1")
    assert grant is not None and not grant.HasField("token_share")
