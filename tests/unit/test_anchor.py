"""A master's anchor: the one decode node where it asks to keep a slot (Ack.floor_slots)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from pdcoord.v1 import coordination_pb2 as pb
from pdmaster.anchor import Anchor
from pdmaster.coordination import CoordinationService, _Stream
from pdmaster.lifecycle import Lifecycle
from pdmaster.metrics import MasterMetrics
from pdmaster.registry import NodeRegistry

NODES = [f"d{i}" for i in range(40)]


def test_the_anchor_is_one_node_stable_and_moves_only_when_it_goes() -> None:
    a = Anchor("m1", recheck_s=0.5)
    first = a.node(NODES, 0.0)
    assert first in NODES
    assert [a.floor_on(n, NODES, 0.0) for n in NODES].count(1) == 1
    # other nodes coming and going leave it where it is
    others = [n for n in NODES if n != first]
    assert a.node([first, *others[:5]], 1.0) == first
    assert a.node([*others[10:], first, "d99"], 2.0) == first
    # it goes: another one, and the same one for the same set (rendezvous hashing)
    moved = a.node(others, 3.0)
    assert moved in others and moved == Anchor("m1").node(reversed(others), 0.0)
    assert a.node([], 4.0) is None


def test_the_anchor_is_looked_at_again_only_every_recheck_s() -> None:
    a = Anchor("m1", recheck_s=0.5)
    first = a.node(NODES, 0.0)
    assert a.node([], 0.4) == first  # within recheck_s the choice stands (the look is O(nodes))
    assert a.node([], 0.5) is None
    a.node(NODES, 1.0)
    a.forget(first)  # a forgotten anchor is looked for again at once
    assert a.node([n for n in NODES if n != first], 1.1) != first


def test_masters_spread_their_anchors_over_the_fleet() -> None:
    anchors = [Anchor(f"master-{k}").node(NODES, 0.0) for k in range(200)]
    counts = {n: anchors.count(n) for n in NODES}
    assert len([n for n, c in counts.items() if c]) > 30  # 200 masters over 40 nodes, not a few
    assert max(counts.values()) < 20


def _metrics() -> MasterMetrics:
    return MasterMetrics(CollectorRegistry(), "m1")


def _service(floor: int) -> CoordinationService:
    return CoordinationService(
        "m1", NodeRegistry(), _metrics(), Lifecycle(), slots=lambda _n: (0, 0), floor=lambda _n: floor
    )


def _ack(svc: CoordinationService, decode: bool) -> pb.Ack:
    async def build() -> pb.Ack:  # the stream's inbox is an asyncio queue
        st = _Stream("d1", 1, decode)
        return svc._ack("d1", 7, 1, None, st)[0].ack

    return asyncio.run(build())


def test_a_decode_ack_carries_the_floor_and_none_while_the_master_admits_nothing() -> None:
    svc = _service(1)
    ack = _ack(svc, decode=True)
    assert ack.HasField("floor_slots") and ack.floor_slots == 1
    assert not _ack(svc, decode=False).HasField("floor_slots")  # a prefill share bounds no lease
    svc.lease_lost = True  # admission holds nothing: nothing to keep
    assert _ack(svc, decode=True).floor_slots == 0
    svc.lease_lost = False
    svc.lifecycle.draining = True
    assert _ack(svc, decode=True).floor_slots == 0
    # a master built without a floor provider sends none (as masters of earlier releases)
    plain = CoordinationService("m1", NodeRegistry(), _metrics(), Lifecycle())
    assert not _ack(plain, decode=True).HasField("floor_slots")
