"""When the agent asks its masters for Acks during a handover (``NodeAgent._report_period``)."""

from __future__ import annotations

import time

from nodeagent.agent import MasterLink, NodeAgent
from nodeagent.slicing import SharePolicy
from pdcoord.load import EngineLoad
from pdcoord.v1 import coordination_pb2 as pb
from tests.unit.agent_helpers import offline_agent


def agent_in_a_failover() -> tuple[NodeAgent, float]:
    """Masters a, b, c shared the node; c's stream went down and its grace ended: a and b are to
    grow into c's slots once an engine sample shows them free. Nothing is polled yet."""
    a = offline_agent(12, load_urls=("http://127.0.0.1:1/metrics",), shares=SharePolicy(policy="static"))
    s, t = a.slicer, time.monotonic() + 10
    s.set_masters(["a", "b", "c"], t, 1)
    for m in ("a", "b", "c"):
        s.stream_up(m, t, 2)
    s.on_probe(0, t, t, 3)  # the previous incarnation left nothing running
    for m in ("a", "b", "c"):
        s.on_ack(m, s.epoch, 0, 0, t, 4)
    assert dict(s.shares) == {"a": 4, "b": 4, "c": 4} and not s.handover_pending
    s.stream_down("c", t + 1, 5)
    assert s.tick(t + 2.1, 6)
    assert s.waits_for_engine and dict(s.shares) == {"a": 4, "b": 4}
    a.load = EngineLoad(probe_ok=True)
    for m in ("a", "b"):
        a.links[m] = MasterLink(m, "127.0.0.1:1", connected=True)
        a.links[m].send_now.set()  # the exclusion's epoch is about to go out to both
    return a, t + 2.1


def test_a_handover_waiting_only_for_the_engine_does_not_poll_the_masters() -> None:
    agent, now = agent_in_a_failover()
    poll, idle = agent.cfg.handover_poll, agent.cfg.report_interval
    # Reports about to go out: their Acks may show something to ask for.
    assert agent._report_period(now) == poll
    for link in agent.links.values():  # written...
        link.send_now.clear()
        link.sent_epoch, link.reported_at = agent.slicer.epoch, now
    assert agent._report_period(now + 0.01) == poll  # ...and unanswered
    for link in agent.links.values():  # answered: both hold the new epoch and run nothing extra
        link.last_ack = pb.Ack(applied_epoch=agent.slicer.epoch, active_slots=0)
        link.acked_at = now + 0.02
    # Only the engine sample can move this on now, and it wakes the loop itself.
    assert agent.slicer.handover_pending
    assert agent._report_period(now + 0.03) == idle
    # A master that still runs more than its grant is worth asking again.
    agent.links["a"].last_ack = pb.Ack(applied_epoch=agent.slicer.epoch, active_slots=9)
    assert agent._report_period(now + 0.03) == poll


def test_a_master_behind_the_current_epoch_is_polled() -> None:
    agent, now = agent_in_a_failover()
    for link in agent.links.values():
        link.send_now.clear()
        link.sent_epoch, link.reported_at = agent.slicer.epoch, now
        link.last_ack = pb.Ack(applied_epoch=agent.slicer.epoch - 1, active_slots=0)
        link.acked_at = now + 0.02
    assert agent._report_period(now + 0.03) == agent.cfg.handover_poll
    # A link that is down is asked nothing: its stream coming back wakes the loop.
    for link in agent.links.values():
        link.connected = False
    assert agent._report_period(now + 0.03) == agent.cfg.report_interval
