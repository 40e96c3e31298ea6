"""The agent's stream loop (``NodeAgent._stream_on``) keeps its link alive through a call that ends
under it: a link whose task ends never reconnects, and its master loses the node for good."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nodeagent.agent import MasterLink
from pdcoord.retry import Backoff, Outage
from pdcoord.v1 import coordination_pb2 as pb
from tests.unit.agent_helpers import offline_agent


class FinishedCall:
    """A call the master already ended (it dropped the connection): gRPC refuses the write."""

    async def write(self, _msg: Any) -> None:
        raise asyncio.InvalidStateError("RPC already finished.")

    async def read(self) -> Any:
        raise AssertionError("not reached")


class LiveCall:
    """A call the master answers: one Ack, then nothing more."""

    def __init__(self) -> None:
        self.written: list[pb.AgentMessage] = []
        self._acked = False

    async def write(self, msg: pb.AgentMessage) -> None:
        self.written.append(msg)

    async def read(self) -> Any:
        if not self._acked:
            self._acked = True
            return pb.MasterMessage(ack=pb.Ack(master_id="m1", applied_epoch=1))
        await asyncio.Event().wait()


class FakeChannel:
    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def stream_stream(self, *_a: Any, **_kw: Any) -> Any:
        return lambda *_a, **_kw: self.calls.pop(0)

    async def channel_ready(self) -> None:
        return None


async def test_a_report_written_as_the_call_ends_does_not_end_the_link() -> None:
    agent = offline_agent(4, health_check=False)
    agent.slicer.set_masters(["m1"], 0.0, 1)
    link = MasterLink("m1", "127.0.0.1:1")
    live = LiveCall()
    channel = FakeChannel([FinishedCall(), live])
    task = asyncio.create_task(
        agent._stream_on(link, channel, Backoff(0.01, 0.01), Outage(logging.getLogger("test"), "test"))
    )
    try:
        for _ in range(200):
            if link.connected or task.done():
                break
            await asyncio.sleep(0.01)
        assert not task.done(), task.exception() if not task.cancelled() else "cancelled"
        assert link.connected and live.written and live.written[0].WhichOneof("msg") == "register"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
