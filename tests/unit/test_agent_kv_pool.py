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
