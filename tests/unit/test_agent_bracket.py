"""How the agent brackets an engine sample with Acks when a master that may be alive still holds
slots (``NodeAgent._probe_loop``, ``Handover.reconsider``)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

from nodeagent.agent import MasterLink, NodeAgent
from nodeagent.slicing import SharePolicy, Slicer
from pdcoord.load import EngineLoad
from pdcoord.v1 import coordination_pb2 as pb
from tests.unit.agent_helpers import offline_agent


class Engine:
    """The engine's count: b's two cut-off leases and a's three; every sample is logged."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.twice = asyncio.Event()

    async def sample(self) -> EngineLoad:
        self.log.append("sample")
        if self.log.count("sample") >= 2:
            self.twice.set()
        return EngineLoad(running=5, probe_ok=True)


async def master_a(agent: NodeAgent, link: MasterLink, log: list[str], freed: asyncio.Event) -> None:
    """Answers every Report at once, as a master of this release: 3 leases, all kept."""
    while True:
        await link.send_now.wait()
        link.send_now.clear()
        msg = agent._report_msg("a")
        link.report_seq, link.reported_at = msg.report.seq, time.monotonic()
        log.append("report")
        await asyncio.sleep(0.01)
        ack = pb.Ack(applied_epoch=agent.slicer.epoch, active_slots=3, seq=msg.report.seq, kept_slots=3)
        link.last_ack, link.acked_at = ack, time.monotonic()
        if agent._on_ack(link, ack):
            agent._changed()
        orphans = agent.slicer.snapshot()["orphans"]
        assert isinstance(orphans, dict)
        held = orphans.get("b", 0)
        log.append(f"ack, b holds {held}")
        if held < 4:
            freed.set()


def agent_with_b_cut_off() -> NodeAgent:
    """a and b each ran 4 of 8 slots; b's stream went down and it left the split. b is not found
    gone (alive but cut off), so its slots wait for a sample that a's Acks bracket."""
    policy = SharePolicy(policy="static")
    agent = offline_agent(8, load_urls=("http://127.0.0.1:1/metrics",), shares=policy)
    t = time.monotonic() - 10  # the agent started well before: its own times are all past
    agent.slicer = s = Slicer(node_id="d1", capacity=8, policy=policy, now=t)
    s.set_masters(["a", "b"], t, 1)
    for m in ("a", "b"):
        s.stream_up(m, t, 2)
    s.on_probe(0, t + 2, t + 2, 3)
    for m in ("a", "b"):
        s.on_ack(m, s.epoch, 4, 0, t + 2, 4, kept=0)
    s.stream_down("b", t + 3, 5)
    assert s.tick(t + 5, 6)
    assert s.snapshot()["orphans"] == {"b": 4} and s.waits_for_bracket
    # its last Report carried the current grant: nothing new to tell it
    agent.links["a"] = MasterLink("a", "127.0.0.1:1", connected=True, sent_epoch=s.epoch, sent_share=4)
    return agent


async def test_a_sample_is_taken_between_fresh_acks_and_frees_only_what_they_account_for() -> None:
    agent = agent_with_b_cut_off()
    log: list[str] = []
    freed = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = [
        asyncio.create_task(master_a(agent, agent.links["a"], log, freed)),
        asyncio.create_task(agent._probe_loop(Engine(log))),  # type: ignore[arg-type]
    ]
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await freed.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # b runs 2 of the 5: exactly that stays reserved, and a grows into the rest only.
    assert agent.slicer.snapshot()["orphans"] == {"b": 2}, (agent.slicer.snapshot(), log)
    assert agent.slicer.share_for("a") == 6
    # The plain sample frees nothing (a's last Ack is older than some of its lease ends); the answer
    # to the next Report, sent after the sample came back, brackets it and frees what it accounts for.
    assert log[:3] == ["sample", "report", "ack, b holds 2"], log


async def test_a_master_that_does_not_answer_counts_for_nothing_and_the_sample_is_taken_anyway() -> None:
    """A connected master that does not answer (hung) cannot bracket the sample: the agent samples
    after waiting a second for it, and sets nothing of a's against the count."""
    agent = agent_with_b_cut_off()
    log: list[str] = []
    engine = Engine(log)
    task = asyncio.create_task(agent._probe_loop(engine))  # type: ignore[arg-type]
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await engine.twice.wait()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert log.count("sample") >= 2, log
    assert agent.slicer.snapshot()["orphans"] == {"b": 4}
    assert agent.slicer.share_for("a") == 4


def test_an_ack_without_kept_slots_is_read_as_from_an_earlier_release() -> None:
    agent = agent_with_b_cut_off()
    link = agent.links["a"]
    link.report_seq, link.reported_at = 9, 123.0
    agent._on_ack(link, pb.Ack(applied_epoch=agent.slicer.epoch, active_slots=3, seq=9))
    h = agent.slicer._ho.holders["a"]
    assert h.kept is None and h.answers_sent_at == 123.0
    agent._on_ack(link, pb.Ack(applied_epoch=agent.slicer.epoch, active_slots=3, seq=8, kept_slots=0))
    assert h.kept == 0 and h.answers_sent_at == -math.inf  # an answer to an earlier Report
