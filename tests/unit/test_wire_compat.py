"""The wire contract against the frozen pre-share schema: old <-> new parse both ways."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "frozen"))

import coordination_v0_pb2 as old

from pdcoord.v1 import coordination_pb2 as new


def test_old_register_parses_as_new_without_grant() -> None:
    msg = old.AgentMessage(
        register=old.Register(
            node_id="d1",
            role=old.DECODE,
            endpoint="http://x:1",
            running_max_req_size=8,
            start_args={"a": "b"},
        )
    )
    parsed = new.AgentMessage.FromString(msg.SerializeToString())
    assert parsed.WhichOneof("msg") == "register"
    r = parsed.register
    assert (r.node_id, r.role, r.endpoint, r.running_max_req_size) == ("d1", new.DECODE, "http://x:1", 8)
    assert dict(r.start_args) == {"a": "b"}
    assert not r.HasField("grant")  # -> the master treats it as granting its full capacity


def test_new_messages_parse_in_old_schema_ignoring_grant_and_new_fields() -> None:
    reg = new.AgentMessage(
        register=new.Register(
            node_id="d1",
            role=new.PREFILL,
            endpoint="http://x:1",
            running_max_req_size=5,
            grant=new.Grant(capacity_share=2, capacity_epoch=99),
        )
    )
    o = old.AgentMessage.FromString(reg.SerializeToString())
    assert o.register.node_id == "d1" and o.register.running_max_req_size == 5
    rep = new.AgentMessage(
        report=new.Report(load=new.Load(running=3), grant=new.Grant(capacity_share=1), seq=7)
    )
    o2 = old.AgentMessage.FromString(rep.SerializeToString())
    assert o2.report.seq == 7 and o2.report.load.running == 3
    ack = new.MasterMessage(
        ack=new.Ack(
            master_id="m",
            applied_epoch=5,
            active_slots=2,
            wanted_slots=9,
            seq=3,
            draining=True,
            kept_slots=2,
            floor_slots=1,
        )
    )
    o3 = old.MasterMessage.FromString(ack.SerializeToString())
    assert (o3.ack.master_id, o3.ack.applied_epoch, o3.ack.active_slots) == ("m", 5, 2)


def test_old_ack_parses_as_new() -> None:
    ack = old.MasterMessage(ack=old.Ack(master_id="m", applied_epoch=1, active_slots=4))
    parsed = new.MasterMessage.FromString(ack.SerializeToString())
    assert parsed.ack.active_slots == 4 and parsed.ack.wanted_slots == 0
    assert parsed.ack.draining is False  # an older master never claims to drain
    assert not parsed.ack.HasField("kept_slots")  # nor says what it kept: its acked count stands in
    assert not parsed.ack.HasField("floor_slots")  # nor which floor it wants: --share-floor applies


def test_field_numbers_of_the_frozen_schema_are_unchanged() -> None:
    for name in ("Register", "Load", "Report", "Leaving", "AgentMessage", "Ack", "MasterMessage"):
        o = old.DESCRIPTOR.message_types_by_name[name]
        n = new.DESCRIPTOR.message_types_by_name[name]
        for f in o.fields:
            nf = n.fields_by_name.get(f.name)
            assert nf is not None, f"{name}.{f.name} removed"
            assert (nf.number, nf.type) == (f.number, f.type), f"{name}.{f.name} changed"
