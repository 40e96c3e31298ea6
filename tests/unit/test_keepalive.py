"""A master's keep-alive (``--keepalive``, ``--keepalive-timeout``) and what its agents make of it.

A master that pings its agents less often notices a silently cut stream later, so it says in its
etcd key how late (``detect_s``); strict handover then lets a departed master's slots wait that long
for engine samples, and the agent pings such a master no more often than it is pinged.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from nodeagent.agent import GRPC_CLIENT_OPTIONS, MasterEntry, master_channel_options
from nodeagent.handover import STARTUP
from nodeagent.slicing import PEER_DETECT_S, SharePolicy, Slicer
from pdcoord.config import EtcdSettings
from pdmaster.config import ConfigError, MasterConfig
from pdmaster.server import grpc_server_options
from tests.unit.agent_helpers import offline_agent


def test_a_master_key_says_how_soon_it_notices_a_cut_stream() -> None:
    agent = offline_agent(4)
    prefix = agent.keys.masters_prefix

    def parse(doc: object) -> MasterEntry | None:
        return agent._parse_master(prefix + "m1", json.dumps(doc).encode())[1]

    assert parse({"grpc": "10.0.0.1:50051"}) == MasterEntry("10.0.0.1:50051", 0.65, 0.0)  # an older master
    assert parse({"grpc": "10.0.0.1:50051", "keepalive_s": 2, "detect_s": 3.5}) == MasterEntry(
        "10.0.0.1:50051", 2.0, 3.5
    )
    for bad in (-1, 0, "2", True, None, 1e9):
        assert parse({"grpc": "10.0.0.1:50051", "detect_s": bad}) is None, bad
        assert parse({"grpc": "10.0.0.1:50051", "keepalive_s": bad}) is None, bad


def test_the_agent_pings_a_master_no_more_often_than_the_master_pings_it() -> None:
    default = dict(master_channel_options(0.65))
    assert default == dict(GRPC_CLIENT_OPTIONS)  # today's master: the agent's own 1 s
    slow = dict(master_channel_options(2.0))
    assert slow["grpc.keepalive_time_ms"] == 2350
    assert {k: v for k, v in slow.items() if k != "grpc.keepalive_time_ms"} == {
        k: v for k, v in default.items() if k != "grpc.keepalive_time_ms"
    }
    # the answer time stays: a hung master is still noticed one ping timeout after the ping
    assert slow["grpc.http2.ping_timeout_ms"] == 1000


def test_a_slow_master_s_slots_wait_its_detection_for_engine_samples() -> None:
    s = Slicer(node_id="d1", capacity=8, policy=SharePolicy(grace=1.0, policy="static"))
    assert s.snapshot()["orphans"] == {STARTUP: 8}
    assert not s.allow_peer_detect(1.0)  # never less than the default
    assert s.peer_detect_s == PEER_DETECT_S
    assert s.allow_peer_detect(3.5)
    assert s.peer_detect_s == pytest.approx(3.6)
    assert not s.allow_peer_detect(2.0)  # only grows
    s.set_masters(["a", "b"], 0.0, 1)
    s.stream_up("a", 0.0, 2)
    s.stream_up("b", 0.0, 2)
    # What the agent's previous incarnation granted waits the longer time too.
    assert not s.on_probe(0, 3.0, 3.1, 3)
    assert s.snapshot()["orphans"] == {STARTUP: 8}
    assert s.on_probe(0, 3.7, 3.8, 4)
    s.on_ack("a", s.epoch, 0, 0, 3.9, 5)
    s.on_ack("b", s.epoch, 0, 0, 3.9, 5)
    assert dict(s.shares) == {"a": 4, "b": 4}
    s.on_ack("b", s.epoch, 3, 0, 4.0, 6)
    s.stream_down("b", 5.0, 7)  # cut silently: b may place work here until 5.0 + 3.6
    assert s.tick(6.1, 8)  # grace over: b leaves the split
    assert s.snapshot()["orphans"] == {"b": 4}
    assert not s.on_probe(0, 8.0, 8.1, 9)  # b may not have noticed yet
    assert s.snapshot()["orphans"] == {"b": 4}
    assert s.on_probe(0, 8.7, 8.8, 10)
    assert dict(s.shares) == {"a": 8}


async def test_the_agent_takes_the_master_s_times_before_it_joins_and_redials_when_they_change() -> None:
    agent = offline_agent(4)
    try:
        agent._set_masters({"m1": MasterEntry("127.0.0.1:1", 2.0, 3.0)})
        assert agent.slicer.peer_detect_s == pytest.approx(3.1)
        first = agent.links["m1"]
        assert first.keepalive_s == 2.0
        agent._set_masters({"m1": MasterEntry("127.0.0.1:1", 2.0, 3.0)})
        assert agent.links["m1"] is first  # nothing changed: the same link
        agent._set_masters({"m1": MasterEntry("127.0.0.1:1", 0.65, 1.65)})
        assert agent.links["m1"] is not first and agent.links["m1"].keepalive_s == 0.65
        assert agent.slicer.peer_detect_s == pytest.approx(3.1)  # a bound once given stays
        status = agent.status()
        assert status["peer_detect_s"] == pytest.approx(3.1)
        assert status["masters"]["m1"]["keepalive_s"] == 0.65
    finally:
        agent._stopping = True
        for link in list(agent.links.values()):
            if link.task is not None:
                link.task.cancel()
        await asyncio.gather(*(lk.task for lk in agent.links.values() if lk.task), return_exceptions=True)


def test_the_master_s_keepalive_flags() -> None:
    etcd = EtcdSettings(["127.0.0.1:2379"], "c", None, 5)
    cfg = MasterConfig("m1", etcd, keepalive=2.0, keepalive_timeout=0.5)
    assert cfg.detect_s == 2.5
    opts = dict(grpc_server_options(cfg.keepalive, cfg.keepalive_timeout))
    assert opts["grpc.keepalive_time_ms"] == 2000
    assert opts["grpc.http2.ping_timeout_ms"] == 500  # what gRPC enforces the answer time with
    with pytest.raises(ConfigError, match="--keepalive"):
        MasterConfig("m1", etcd, keepalive=0.01)


async def test_a_master_key_marked_drained_takes_the_master_out_for_good() -> None:
    """A master writes ``"drained": true`` into its key just before it revokes it; the agent reads
    it as it reads an Ack saying the master drains with nothing queued."""
    agent = offline_agent(4)
    prefix = agent.keys.masters_prefix
    doc = {"grpc": "127.0.0.1:1", "keepalive_s": 0.65, "detect_s": 1.65}
    assert agent._parse_master(prefix + "m1", json.dumps(doc).encode())[1] == MasterEntry(
        "127.0.0.1:1", 0.65, 1.65, drained=False
    )
    for flag in ("yes", 1, None):  # only a JSON true counts
        entry = agent._parse_master(prefix + "m1", json.dumps({**doc, "drained": flag}).encode())[1]
        assert entry is not None and not entry.drained, flag
    mid, entry = agent._parse_master(prefix + "m1", json.dumps({**doc, "drained": True}).encode())
    assert entry is not None and entry.drained
    try:
        live = agent._parse_master(prefix + "m1", json.dumps(doc).encode())[1]
        assert live is not None
        agent._set_masters({mid: live})
        agent.slicer.stream_up("m1", 1.0, 1)
        agent._set_masters({mid: entry})  # the put that marks it drained
        assert agent.slicer._left_for_good("m1") is False  # still in etcd
        agent._set_masters({})  # its stream still up: the revocation came first
        assert agent.slicer._left_for_good("m1")
    finally:
        for link in agent.links.values():
            if link.task is not None:
                link.task.cancel()
        await asyncio.sleep(0)
