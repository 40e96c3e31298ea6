"""The keep-alive defaults (DESIGN §5: a master pings an idle agent stream after 2 s and allows 1 s for
the answer) against the release before masters advertised their keep-alive, in both directions.

* A master of that release (``tests/frozen/keepalive_unadvertised.py``) really pings after 0.65 s and
  notices a cut stream within 1.65 s: today's agent must assume exactly that for a key without
  ``keepalive_s``/``detect_s``, not today's defaults.
* An agent of that release allows every master 1.75 s and reads only ``grpc`` from its key: it still
  connects to a master at today's defaults and pings it as before, but its strict handover waits
  less than such a master may take to notice a silently cut stream. The protocol model shows what
  that means (an overshoot now and then); hence the upgrade order (agents first) in the README.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import yaml

from nodeagent.agent import GRPC_CLIENT_OPTIONS, MasterEntry, master_channel_options
from nodeagent.slicing import PEER_DETECT_S, PEER_DETECT_SLACK_S
from pdcoord.config import EtcdSettings
from pdcoord.dev.protocol_model import ProtocolSim, SimConfig
from pdcoord.keepalive import (
    DEFAULT_DETECT_S,
    DEFAULT_KEEPALIVE_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    UNADVERTISED_DETECT_S,
    UNADVERTISED_KEEPALIVE_S,
)
from pdmaster.config import MasterConfig
from pdmaster.main import build_parser
from pdmaster.server import GRPC_SERVER_OPTIONS, grpc_server_options
from tests.unit.agent_helpers import offline_agent

sys.path.insert(0, str(Path(__file__).parents[1] / "frozen"))
import keepalive_unadvertised as old

ROOT = Path(__file__).parents[2]


def _parse(value: dict[str, object]) -> MasterEntry | None:
    agent = offline_agent(4)
    return agent._parse_master(agent.keys.masters_prefix + "m1", json.dumps(value).encode())[1]


def test_the_defaults_are_a_ping_after_2_s_and_1_s_for_the_answer() -> None:
    assert (DEFAULT_KEEPALIVE_S, DEFAULT_KEEPALIVE_TIMEOUT_S, DEFAULT_DETECT_S) == (2.0, 1.0, 3.0)
    cfg = MasterConfig("m1", EtcdSettings(["127.0.0.1:2379"], "c", None, 5))
    assert (cfg.keepalive, cfg.keepalive_timeout, cfg.detect_s) == (2.0, 1.0, 3.0)
    args = build_parser().parse_args(["--master-id", "m1"])
    assert (args.keepalive, args.keepalive_timeout) == (2.0, 1.0)
    opts = dict(GRPC_SERVER_OPTIONS)
    assert opts == dict(grpc_server_options())
    assert opts["grpc.keepalive_time_ms"] == 2000
    assert opts["grpc.keepalive_timeout_ms"] == opts["grpc.http2.ping_timeout_ms"] == 1000
    # The chart passes its own values: they must be the same.
    values = yaml.safe_load((ROOT / "helm/pdcoord/values.yaml").read_text())
    assert values["master"]["keepalive"] == {
        "interval": DEFAULT_KEEPALIVE_S,
        "timeout": DEFAULT_KEEPALIVE_TIMEOUT_S,
    }


def test_a_default_master_s_agents_wait_its_3_s_and_ping_it_after_2_35_s() -> None:
    agent = offline_agent(4)
    key = {"grpc": "10.0.0.1:50051", "keepalive_s": DEFAULT_KEEPALIVE_S, "detect_s": DEFAULT_DETECT_S}
    entry = _parse(key)
    assert entry == MasterEntry("10.0.0.1:50051", 2.0, 3.0)
    assert agent.slicer.allow_peer_detect(entry.detect_s)
    assert agent.slicer.peer_detect_s == pytest.approx(3.0 + PEER_DETECT_SLACK_S)
    channel = dict(master_channel_options(entry.keepalive_s))
    # the master's pings (every 2 s of silence) reset the agent's timer: only the master pings
    assert channel["grpc.keepalive_time_ms"] == 2350
    assert channel["grpc.http2.ping_timeout_ms"] == 1000


async def test_a_master_of_the_earlier_release_is_assumed_to_do_what_it_did_not_today_s_defaults() -> None:
    """Its key says nothing of its keep-alive, and it pings after 0.65 s: the agent takes those
    times, not the new defaults (a 2 s assumption would make it ping such a master after 2.35 s,
    finding a hung one later than before)."""
    entry = _parse(old.MASTER_KEY)
    assert entry is not None
    assert (
        entry.keepalive_s
        == UNADVERTISED_KEEPALIVE_S
        == old.MASTER_GRPC_OPTIONS["grpc.keepalive_time_ms"] / 1000
    )
    assert entry.keepalive_s != DEFAULT_KEEPALIVE_S
    assert entry.detect_s == 0.0  # not said: the floor below covers it
    # The agent pings such a master as the earlier agents did: after 1 s, 1 s for the answer.
    channel = dict(master_channel_options(entry.keepalive_s))
    assert channel == dict(GRPC_CLIENT_OPTIONS)
    assert {k: channel[k] for k in old.AGENT_GRPC_OPTIONS} == old.AGENT_GRPC_OPTIONS
    # Strict handover lets its slots wait what the earlier agents allowed: at least its detection.
    assert UNADVERTISED_DETECT_S == old.MASTER_DETECT_S
    assert PEER_DETECT_S == old.AGENT_PEER_DETECT_S >= old.MASTER_DETECT_S
    agent = offline_agent(4)
    assert not agent.slicer.allow_peer_detect(entry.detect_s)
    assert agent.slicer.peer_detect_s == PEER_DETECT_S
    agent._set_masters({"m1": entry})
    try:
        assert agent.links["m1"].keepalive_s == 0.65
        assert agent.status()["peer_detect_s"] == PEER_DETECT_S
    finally:
        agent._stopping = True
        tasks = [link.task for link in agent.links.values() if link.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_an_agent_of_the_earlier_release_reads_a_default_master_s_key_and_pings_it_as_before() -> None:
    """Nothing it assumes about the key or the pings breaks: it finds the address, and its own pings
    (after 1 s without reads) stay above what the master refuses as too frequent."""
    entry = _parse(old.MASTER_KEY)
    assert entry is not None
    key = {**old.MASTER_KEY, "keepalive_s": DEFAULT_KEEPALIVE_S, "detect_s": DEFAULT_DETECT_S}
    assert old.agent_parse_master(json.dumps(key).encode()) == "10.0.0.1:50051"
    opts = dict(GRPC_SERVER_OPTIONS)
    assert (
        old.AGENT_GRPC_OPTIONS["grpc.keepalive_time_ms"]
        >= opts["grpc.http2.min_ping_interval_without_data_ms"]
    )
    assert opts["grpc.keepalive_permit_without_calls"] == 1 and opts["grpc.http2.max_pings_without_data"] == 0
    # What does not hold: it allows such a master less than it may take to notice a cut stream.
    assert old.AGENT_PEER_DETECT_S < DEFAULT_DETECT_S


def _sim(master_detect_s: float, agent_detect_s: float, peer_detect_s: float) -> SimConfig:
    return SimConfig(
        handover="strict",
        policy="static",
        chaos_s=20.0,
        settle_s=5.0,
        master_detect_s=master_detect_s,
        agent_detect_s=agent_detect_s,
        peer_detect_s=peer_detect_s,
    )


def test_earlier_agents_beside_default_masters_can_overshoot_today_s_agents_cannot() -> None:
    """The protocol model (random partitions, kills and restarts in virtual time): a master at the
    defaults notices a cut within 3 s. Today's agents ping it after 2.35 s and allow it 3.1 s; earlier
    agents ping it after 1 s and allow it 1.75 s, and in a few runs strict handover then hands a
    cut-off master's slots on while it still places work there (5 of seeds 0-599: 218, 254, 331, 367,
    497; none with today's agents). Seeds 200-259 are checked here."""
    new = _sim(DEFAULT_DETECT_S, DEFAULT_KEEPALIVE_S + 0.35 + 1.0, DEFAULT_DETECT_S + PEER_DETECT_SLACK_S)
    earlier = dataclasses.replace(new, agent_detect_s=2.0, peer_detect_s=old.AGENT_PEER_DETECT_S)
    seeds = range(200, 260)
    assert not [s for s in seeds if ProtocolSim(new, s).run().violations]
    assert [s for s in seeds if ProtocolSim(earlier, s).run().violations]


def test_the_readme_says_how_to_upgrade_past_the_keepalive_change() -> None:
    text = (ROOT / "README.md").read_text()
    assert "--keepalive 0.65" in text and "agents first" in text
