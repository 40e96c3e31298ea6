"""An agent reports when something a master uses changed, or for the heartbeat
(``NodeAgent._report_period``): an engine that stays down changes nothing."""

from __future__ import annotations

import time

from nodeagent.agent import MasterLink, NodeAgent
from nodeagent.slicing import SharePolicy
from pdcoord.load import EngineLoad
from pdcoord.v1 import coordination_pb2 as pb
from tests.unit.agent_helpers import offline_agent


def settled_agent() -> tuple[NodeAgent, float]:
    """Masters a and b share the node evenly, no handover pending, both streams up."""
    agent = offline_agent(8, load_urls=("http://127.0.0.1:1/metrics",), shares=SharePolicy(policy="demand"))
    s, t = agent.slicer, time.monotonic() + 10
    s.set_masters(["a", "b"], t, 1)
    for m in ("a", "b"):
        s.stream_up(m, t, 2)
    s.on_probe(0, t, t, 3)
    for m in ("a", "b"):
        s.on_ack(m, s.epoch, 0, 0, t, 4)
        agent.links[m] = MasterLink(m, "127.0.0.1:1", connected=True)
        agent.links[m].last_ack = pb.Ack(applied_epoch=s.epoch)
    assert not s.handover_pending
    return agent, t + 1


def _engine_down(agent: NodeAgent) -> None:
    for _ in range(agent.engine.failures):
        agent.engine.observe(False, "GET http://127.0.0.1:1/health: connection refused")
    assert not agent.engine.up
    agent.load = EngineLoad()  # the load probe fails too


def test_beside_an_idle_engine_only_the_heartbeat_goes_out() -> None:
    agent, now = settled_agent()
    agent.load = EngineLoad(probe_ok=True)
    assert agent._report_period(now) == agent.cfg.report_interval


def test_an_engine_that_stays_down_sends_no_more_than_an_idle_one() -> None:
    agent, now = settled_agent()
    _engine_down(agent)
    assert agent._report_period(now) == agent.cfg.report_interval
    # Also when the masters' last Acks showed demand: none of it can be placed on a down engine.
    agent.links["a"].last_ack = pb.Ack(applied_epoch=agent.slicer.epoch, active_slots=3, wanted_slots=5)
    assert agent._report_period(now) == agent.cfg.report_interval
    # Back up, the masters' demand is followed again (the flip itself reports at once).
    for _ in range(agent.engine.successes):
        agent.engine.observe(True)
    agent.load = EngineLoad(probe_ok=True)
    assert agent._report_period(now) == min(agent.cfg.report_interval, agent.cfg.shares.rebalance_interval)


def test_an_engine_without_a_load_signal_still_has_its_masters_asked_for_their_demand() -> None:
    """Up but with no load signal, a master starting work here would go unseen: keep asking."""
    agent, now = settled_agent()
    agent.load = EngineLoad()
    assert agent.engine.up
    assert agent._report_period(now) == agent.cfg.shares.rebalance_interval
