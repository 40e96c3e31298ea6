"""A hostile gRPC client against a real master process: garbage bytes, wrong message order, huge maps,
absurd numbers and floods. Every one gets a clear status; none crashes the master or touches the
entry of the legitimate node."""

from __future__ import annotations

import math
import os
import random
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdcoord.dev.cluster import LocalCluster, Master, http_json
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.v1 import coordination_pb2 as pb
from tests.conftest import EtcdEndpoint

pytestmark = pytest.mark.cluster

CONNECT = "/pdcoord.v1.NodeCoordination/Connect"
LIMITS = {
    "max_node_capacity": 16,
    "max_nodes": 12,
    "max_reports_per_s": 5,
    "max_start_args": 4,
    "max_start_arg_bytes": 64,
}


class Hostile:
    def __init__(self, cluster: LocalCluster, master: Master) -> None:
        self.cluster = cluster
        self.master = master
        self.addr = f"127.0.0.1:{master.grpc_port}"
        self.channel = grpc.insecure_channel(self.addr)
        self.baseline: dict[str, Any] = {}

    def raw_stream(
        self, payloads: Iterable[bytes], hold: float = 0.0, timeout: float = 10
    ) -> grpc.RpcError | None:
        """Send serialized (or garbage) messages; None if the stream ended without an error."""
        call = self.channel.stream_stream(CONNECT, request_serializer=None, response_deserializer=None)

        def gen() -> Iterator[bytes]:
            yield from payloads
            time.sleep(hold)

        try:
            for _ in call(gen(), timeout=timeout):
                pass
        except grpc.RpcError as exc:
            return exc
        return None

    def stream(self, msgs: Iterable[pb.AgentMessage], hold: float = 0.0) -> grpc.RpcError | None:
        return self.raw_stream((m.SerializeToString() for m in msgs), hold)

    def refused(self, msgs: Iterable[pb.AgentMessage], code: grpc.StatusCode, words: str) -> None:
        err = self.stream(msgs)
        assert err is not None, f"expected {code.name}, the stream was accepted"
        assert err.code() == code, (err.code(), err.details())
        assert words in (err.details() or ""), err.details()
        self.check_unharmed()

    def legit(self) -> dict[str, Any]:
        nodes = {n["node_id"]: n for n in http_json(self.master.url + "/admission")["nodes"]}
        n = nodes["legit"]
        return {k: n[k] for k in ("role", "endpoint", "running_max_req_size", "share", "effective_share",
                                  "epoch", "connected", "start_args")}  # fmt: skip

    def check_unharmed(self) -> None:
        assert self.master.proc.alive, self.master.proc.tail(40)
        assert http_json(self.master.url + "/health")["status"] == "ok"
        assert self.legit() == self.baseline
        # only the legitimate node counts: refused or finished hostile streams hold no capacity
        assert http_json(self.master.url + "/admission")["capacity"] == 4


@pytest.fixture(scope="module")
def hostile(etcd: EtcdEndpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hostile]:
    base = tmp_path_factory.mktemp("hostile")
    group = ProcessGroup(base / "logs", handle_signals=False)
    try:
        cluster = LocalCluster(group, etcd.endpoint, f"hostile-{os.getpid()}-{random.randrange(1 << 30)}")
        master = cluster.start_master("m1", **LIMITS)
        cluster.start_agent("legit", "decode", capacity=4, start_arg="model=tiny", no_load_probe=True)
        h = Hostile(cluster, master)
        cluster.wait_for(lambda: h.legit()["effective_share"] == 4, timeout=15)
        h.baseline = h.legit()
        yield h
        h.channel.close()
        log = Path(master.proc.log_path).read_text(errors="replace")
        assert "Traceback" not in log, log[-4000:]
    finally:
        group.close()


def register(
    node: str, *, cap: int = 4, share: int | None = 2, epoch: int = 100, **kw: Any
) -> pb.AgentMessage:
    reg = pb.Register(
        node_id=node, role=pb.DECODE, endpoint="http://127.0.0.1:9", running_max_req_size=cap, **kw
    )
    if share is not None:
        reg.grant.CopyFrom(pb.Grant(capacity_share=share, capacity_epoch=epoch))
    return pb.AgentMessage(register=reg)


def report(share: int = 2, epoch: int = 100, seq: int = 1, kv: float = 0.0) -> pb.AgentMessage:
    return pb.AgentMessage(
        report=pb.Report(
            load=pb.Load(kv_usage=kv), grant=pb.Grant(capacity_share=share, capacity_epoch=epoch), seq=seq
        )
    )


INVALID = grpc.StatusCode.INVALID_ARGUMENT


def test_wrong_message_order(hostile: Hostile) -> None:
    hostile.refused([report()], INVALID, "first message must be Register")
    hostile.refused([pb.AgentMessage(leaving=pb.Leaving())], INVALID, "first message must be Register")
    hostile.refused([pb.AgentMessage()], INVALID, "first message must be Register, got an empty message")
    hostile.refused([register("twice"), register("twice")], INVALID, "Register sent twice")
    assert hostile.stream([]) is None  # nothing sent: nothing registered
    hostile.check_unharmed()


def test_identity_attacks(hostile: Hostile) -> None:
    hostile.refused(
        [register("legit")], grpc.StatusCode.ALREADY_EXISTS, "already held by another live stream"
    )
    hostile.refused([register("")], INVALID, "node_id must be 1-253 characters")
    hostile.refused([register("x" * 300)], INVALID, "node_id must be 1-253 characters")
    hostile.refused([register("evil\nnode")], INVALID, "printable, without whitespace")
    bad_endpoint = register("ep")
    bad_endpoint.register.endpoint = "http://" + "a" * 5000
    hostile.refused([bad_endpoint], INVALID, "at most 2048")
    hostile.refused([register("ver", agent_version="v" * 1000)], INVALID, "agent_version longer")
    no_role = register("norole")
    no_role.register.role = pb.ROLE_UNSPECIFIED
    hostile.refused([no_role], INVALID, "role must be PREFILL or DECODE")


def test_huge_maps_and_messages(hostile: Hostile) -> None:
    many = {f"k{i}": "v" for i in range(5000)}
    hostile.refused([register("map", start_args=many)], INVALID, "at most 4 (--max-start-args)")
    hostile.refused([register("key", start_args={"k" * 65: "v"})], INVALID, "--max-start-arg-bytes")
    hostile.refused([register("val", start_args={"k": "v" * 65})], INVALID, "--max-start-arg-bytes")
    hostile.refused([register("empty-key", start_args={"": "v"})], INVALID, "empty key")
    # beyond grpc.max_receive_message_length (1 MiB): refused by the transport with a clear status
    big = {f"{i:04d}": "x" * 60_000 for i in range(40)}
    hostile.refused([register("big", start_args=big)], grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")


def test_absurd_numbers(hostile: Hostile) -> None:
    hostile.refused([register("cap", cap=2**32 - 1)], grpc.StatusCode.OUT_OF_RANGE, "--max-node-capacity")
    hostile.refused([register("zero", cap=0)], INVALID, "must be positive")
    hostile.refused([register("share", share=2**32 - 1)], INVALID, "outside 0..4")
    hostile.refused([register("s2"), report(share=5, epoch=101)], INVALID, "outside 0..4")
    hostile.refused(
        [register("s3"), report(share=3, epoch=100)], grpc.StatusCode.FAILED_PRECONDITION, "epoch 100"
    )
    for bad in (math.nan, math.inf, -math.inf, -1.0):
        hostile.refused([register("kv"), report(kv=bad)], INVALID, "kv_usage must be a finite number")
    # the largest epoch is legal; the stream works and, once gone, holds nothing
    assert hostile.stream([register("maxepoch", epoch=2**64 - 1), report(epoch=2**64 - 1)]) is None
    hostile.check_unharmed()


def test_floods_are_cut_off(hostile: Hostile) -> None:
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    hostile.refused(
        [register("flood")] + [report(seq=i) for i in range(200)], exhausted, "messages per second"
    )
    hostile.refused([register("flood2")] + [pb.AgentMessage()] * 200, exhausted, "--max-reports-per-s")
    # at the allowed rate a stream is never cut off
    paced = [register("paced")]

    def slow() -> Iterator[pb.AgentMessage]:
        yield from paced
        for i in range(6):
            time.sleep(0.25)
            yield report(seq=i)

    assert hostile.stream(slow()) is None
    hostile.check_unharmed()


def test_undecodable_messages(hostile: Hostile) -> None:
    for garbage in (b"\x00", b"\xff" * 10, register("ok").SerializeToString()[:-3]):
        err = hostile.raw_stream([garbage])
        assert err is not None and err.code() == INVALID, (garbage, err)
        assert "undecodable AgentMessage" in (err.details() or "")
    # garbage after a good Register ends that stream only
    err = hostile.raw_stream([register("then-garbage").SerializeToString(), b"\x0a\xff\xff"])
    assert err is not None and err.code() == INVALID
    hostile.check_unharmed()


def test_garbage_bytes_on_the_socket(hostile: Hostile) -> None:
    rng = random.Random(7)
    port = hostile.master.grpc_port
    for size in (0, 1, 9, 24, 100, 4096, 70_000):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(bytes(rng.randrange(256) for _ in range(size)))
            s.settimeout(2)
            try:
                while s.recv(65536):
                    pass
            except (TimeoutError, ConnectionResetError):
                pass
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(2)
        try:
            s.recv(1024)
        except (TimeoutError, ConnectionResetError):
            pass
    hostile.check_unharmed()


@settings(
    max_examples=200 if os.environ.get("CI") else 40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=4))
def test_fuzz_random_payloads(hostile: Hostile, payloads: list[bytes]) -> None:
    err = hostile.raw_stream(payloads, timeout=10)
    if err is not None:
        # undecodable bytes or an invalid message: a status, never a crash
        assert err.code() != grpc.StatusCode.UNKNOWN, err.details()
    hostile.check_unharmed()


def test_node_table_limit(hostile: Hostile) -> None:
    before = {n["node_id"] for n in http_json(hostile.master.url + "/admission")["nodes"]}
    err = None
    for i in range(LIMITS["max_nodes"] + 1):
        err = hostile.stream([register(f"filler-{i}")])
        if err is not None:
            break
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert "already tracks 12 nodes" in (err.details() or "")
    after = {n["node_id"] for n in http_json(hostile.master.url + "/admission")["nodes"]}
    assert before <= after and len(after) == LIMITS["max_nodes"]
    hostile.check_unharmed()
    # a known node may still come back when the table is full
    assert hostile.stream([register("filler-0", epoch=200)]) is None
    hostile.check_unharmed()
