"""A master whose etcd lease is lost drains, node by node, and takes grants again only from new streams.

Over real gRPC streams on loopback (no etcd, no agent process: the test writes the agent's messages):
while the lease is lost the master's Ack on a node says ``draining`` (with no queued demand) as soon as
none of its leases runs there, pushed without waiting for a Report; where a lease still runs it says
nothing new. When the lease is held again the streams whose Acks said so are closed and count 0 at
once, whatever they granted before; the agent's next Register is what counts. Then the agent's side:
the split those Acks lead to never oversubscribes the node, and hands the whole node to the other
master before the lost master's key expires.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from nodeagent.slicing import SharePolicy, Slicer
from pdcoord.config import EtcdSettings
from pdcoord.v1 import coordination_pb2 as pb
from pdcoord.v1 import coordination_pb2_grpc as pb_grpc
from pdmaster.config import MasterConfig
from pdmaster.server import MasterServer

DEADLINE_S = 10.0


async def _until(cond: Any, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class _Agent:
    """One agent's stream to the master, written by hand."""

    def __init__(self, channel: grpc.aio.Channel, node_id: str) -> None:
        self.node_id = node_id
        self.call: Any = pb_grpc.NodeCoordinationStub(channel).Connect()
        self.seq = 0

    async def register(self, share: int, epoch: int) -> pb.Ack:
        reg = pb.Register(
            node_id=self.node_id,
            role=pb.DECODE,
            endpoint=f"http://127.0.0.1:1/{self.node_id}",
            running_max_req_size=6,
            agent_version="test",
            incarnation=1,
        )
        reg.grant.CopyFrom(pb.Grant(capacity_share=share, capacity_epoch=epoch))
        await self.call.write(pb.AgentMessage(register=reg))
        return await self.read()

    async def report(self, share: int | None = None, epoch: int = 0) -> int:
        self.seq += 1
        rep = pb.Report(seq=self.seq)
        if share is not None:
            rep.grant.CopyFrom(pb.Grant(capacity_share=share, capacity_epoch=epoch))
        await self.call.write(pb.AgentMessage(report=rep))
        return self.seq

    async def read(self) -> pb.Ack:
        msg = await asyncio.wait_for(self.call.read(), DEADLINE_S)
        assert msg is not grpc.aio.EOF, f"{self.node_id}: stream ended"
        return msg.ack

    async def ended(self) -> bool:
        return await asyncio.wait_for(self.call.read(), DEADLINE_S) is grpc.aio.EOF


@pytest.fixture
async def master() -> AsyncIterator[tuple[MasterServer, grpc.aio.Channel]]:
    server = MasterServer(MasterConfig(master_id="m1", etcd=EtcdSettings(["http://127.0.0.1:9"], "unit")))
    grpc_server = grpc.aio.server()
    pb_grpc.add_NodeCoordinationServicer_to_server(server.coordination, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    server._on_lease_held(True)  # registered
    try:
        yield server, channel
    finally:
        if server._lost_drain_task is not None:
            server._lost_drain_task.cancel()
        await channel.close()
        await grpc_server.stop(None)


async def test_lost_lease_drains_where_idle_at_once_and_resumes_only_on_fresh_streams(
    master: tuple[MasterServer, grpc.aio.Channel],
) -> None:
    server, channel = master
    adm = server.admission
    d1, d2 = _Agent(channel, "d1"), _Agent(channel, "d2")
    assert not (await d1.register(3, 1)).draining
    assert not (await d2.register(3, 1)).draining
    await _until(lambda: adm.core.capacity == 6, "both shares in admission")

    lease = await adm.acquire_lease(1)
    busy, idle = (d1, d2) if lease.node == "d1" else (d2, d1)

    server._on_lease_held(False)  # no renewal confirmed in time: admission holds nothing
    assert adm.core.capacity == 0
    # Where nothing of this master runs, the agent hears at once (no Report asked for it) that it
    # drains with nothing queued: the agent can take it out of the split with nothing reserved.
    pushed = await idle.read()
    assert (pushed.draining, pushed.active_slots, pushed.wanted_slots) == (True, 0, 0)
    # Where its lease still runs it does not say so: the agent keeps that share reserved for it.
    seq = await busy.report()
    ack = await busy.read()
    assert (ack.draining, ack.active_slots, ack.seq) == (False, 1, seq)

    lease.release()  # its last lease there ends: the agent hears at once
    pushed = await busy.read()
    assert (pushed.draining, pushed.active_slots, pushed.wanted_slots) == (True, 0, 0)
    assert pushed.seq == seq  # echoes the last Report read (answers_sent_at stays exact)
    seq = await idle.report()  # answers keep saying it, with the agent's seq
    ack = await idle.read()
    assert (ack.draining, ack.seq) == (True, seq)

    # The agent took it out and handed its share on, but that grant has not reached the master yet
    # (or never will: the agent dropped the stream as the key expired). The registry still holds 3.
    assert server.registry.capacity == 6
    server._on_lease_held(True)  # etcd confirms the lease again
    # Those grants are not admitted on: both streams close and count 0 at once.
    assert adm.core.capacity == 0 and server.registry.capacity == 0
    assert await d1.ended() and await d2.ended()
    with pytest.raises(Exception):  # noqa: B017 - refused: no capacity
        await adm.acquire_lease(1)

    # The agents re-register it with what they grant now (strict handover: from free slots only).
    again = _Agent(channel, "d1")
    first = await again.register(2, 5)
    assert not first.draining
    await _until(lambda: adm.core.capacity == 2, "the fresh grant in admission")
    lease = await adm.acquire_lease(1)
    assert lease.node == "d1"
    lease.release()
    assert server.metrics.lease_losses._value.get() == 1


async def test_a_node_where_a_lease_ran_throughout_keeps_its_stream_and_grant(
    master: tuple[MasterServer, grpc.aio.Channel],
) -> None:
    server, channel = master
    adm = server.admission
    d1 = _Agent(channel, "d1")
    await d1.register(6, 1)
    await _until(lambda: adm.core.capacity == 6, "the share in admission")
    lease = await adm.acquire_lease(1)

    server._on_lease_held(False)
    await asyncio.sleep(0.3)  # several polls: nothing is pushed while the lease runs
    seq = await d1.report()
    ack = await d1.read()
    assert (ack.draining, ack.active_slots, ack.seq) == (False, 1, seq)

    server._on_lease_held(True)  # never said draining: the agent kept this share for it throughout
    assert adm.core.capacity == 6
    seq = await d1.report(5, 2)  # and the stream goes on
    ack = await d1.read()
    assert (ack.draining, ack.applied_epoch, ack.seq) == (False, 2, seq)
    await _until(lambda: adm.core.capacity == 5, "the new grant")
    lease.release()


async def test_a_prefill_stream_never_drains_for_a_lost_lease(
    master: tuple[MasterServer, grpc.aio.Channel],
) -> None:
    server, channel = master
    p1 = _Agent(channel, "p1")
    reg = pb.Register(node_id="p1", role=pb.PREFILL, endpoint="http://127.0.0.1:1/p1", running_max_req_size=6)
    reg.grant.CopyFrom(pb.Grant(capacity_share=6, capacity_epoch=1))
    await p1.call.write(pb.AgentMessage(register=reg))
    assert not (await p1.read()).draining
    server._on_lease_held(False)
    seq = await p1.report()
    ack = await p1.read()
    assert (ack.draining, ack.seq) == (False, seq)
    server._on_lease_held(True)
    seq = await p1.report()  # not closed
    assert (await p1.read()).seq == seq


async def test_a_graceful_drain_still_says_draining_with_leases_running(
    master: tuple[MasterServer, grpc.aio.Channel],
) -> None:
    server, channel = master
    d1 = _Agent(channel, "d1")
    await d1.register(6, 1)
    await _until(lambda: server.admission.core.capacity == 6, "the share in admission")
    lease = await server.admission.acquire_lease(1)
    server.lifecycle.start_draining()
    await d1.report()
    ack = await d1.read()
    assert (ack.draining, ack.active_slots) == (True, 1)
    lease.release()


# -- what the agent makes of those Acks ---------------------------------------------------------


def _two_masters() -> Slicer:
    s = Slicer("d1", 6, SharePolicy(policy="static"), probe=False, now=0.0)
    s.set_masters(["m1", "m2"], 0.0, 1)
    s.stream_up("m1", 0.0, 2)
    s.stream_up("m2", 0.0, 3)
    for m in ("m1", "m2"):
        s.on_ack(m, s.epoch, 0, 0, 0.1, 4)
    s.tick(0.2, 5)
    assert dict(s.shares) == {"m1": 3, "m2": 3}
    return s


def _ack(s: Slicer, m: str, active: int, now: float, draining: bool = False) -> None:
    s.on_ack(m, s.epoch, active, 0, now, int(now * 1e9) + 100, draining)


def test_an_idle_lost_master_saying_draining_hands_the_whole_node_on_at_once() -> None:
    s = _two_masters()
    _ack(s, "m2", 3, 1.0)
    _ack(s, "m1", 0, 1.0, draining=True)  # lease lost, nothing of it runs here
    _ack(s, "m2", 3, 1.01)
    assert dict(s.shares) == {"m2": 6}  # no orphan reserved, no engine sample needed
    s.set_masters(["m2"], 1.5, 10**10)  # then its key expires
    s.stream_down("m1", 1.5, 10**10 + 1)  # and the agent drops the stream
    assert dict(s.shares) == {"m2": 6} and s.snapshot()["orphans"] == {}


def test_a_lost_master_with_leases_running_keeps_them_reserved() -> None:
    s = _two_masters()
    _ack(s, "m1", 2, 1.0)  # lease lost, two of its leases still run here: no draining said
    _ack(s, "m2", 3, 1.0)
    assert dict(s.shares) == {"m1": 3, "m2": 3}
    s.set_masters(["m2"], 1.5, 10**10)  # its key expires before they end
    s.stream_down("m1", 1.5, 10**10 + 1)
    _ack(s, "m2", 3, 1.6)
    # reserved as the orphan of a master that may be alive (not set against acked counts)
    assert s.shares["m2"] + s.snapshot()["orphans"]["m1"] <= 6  # type: ignore[index]
    assert s.snapshot()["orphans"] == {"m1": 3}
