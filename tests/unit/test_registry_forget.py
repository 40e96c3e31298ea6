"""A master forgets a node that is gone (its agent said Leaving, or its etcd key is gone) once nothing
of its own runs there: the registry's rule, the metric series, and the master's pass over the nodes
whose stream is down."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdcoord.config import EtcdSettings
from pdcoord.etcd import EtcdUnavailable, KeyValue
from pdmaster import server as server_module
from pdmaster.config import MasterConfig
from pdmaster.metrics import MasterMetrics
from pdmaster.registry import DECODE, PREFILL, NodeRegistry, ProtocolError
from pdmaster.server import MasterServer


def reg(r: NodeRegistry, node: str = "d1", grant: tuple[int, int] = (4, 10), role: str = DECODE) -> int:
    _, stream = r.register(
        node_id=node, role=role, endpoint="http://127.0.0.1:1", running_max_req_size=8, grant=grant
    )
    return stream


# -- the registry ---------------------------------------------------------------------------------


def test_a_node_that_left_is_forgotten_once_its_stream_is_down_and_nothing_runs_there() -> None:
    r = NodeRegistry()
    s = reg(r, "d1")
    r.mark_leaving("d1", s)
    assert r.nodes["d1"].leaving and not r.forgettable("d1", 0)  # its stream is still up
    r.disconnect("d1", s)
    assert r.disconnected() == ["d1"]
    assert not r.forgettable("d1", 2)  # two slots of this master's still run there
    assert r.forgettable("d1", 0)
    node = r.forget("d1")
    assert node is not None and node.node_id == "d1"
    assert "d1" not in r.nodes and r.snapshot() == [] and r.disconnected() == []
    assert r.forget("d1") is None and r.forgotten_total == 1


def test_a_disconnected_node_is_kept_until_it_is_known_gone() -> None:
    r = NodeRegistry()
    s = reg(r, "d1")
    r.disconnect("d1", s)
    assert not r.forgettable("d1", 0)  # cut from this master only, perhaps: kept, alerting
    assert r.mark_key_gone("d1") and not r.mark_key_gone("d1")
    assert r.nodes["d1"].as_json()["key_gone"] is True
    assert r.forgettable("d1", 0)


def test_a_live_stream_is_never_forgotten_nor_marked_key_gone() -> None:
    r = NodeRegistry()
    reg(r, "d1")
    assert not r.mark_key_gone("d1")  # its key may be gone (agent cut from etcd): the stream counts
    assert r.forget("d1") is None and "d1" in r.nodes
    assert not r.forgettable("unknown", 0) and r.forget("unknown") is None


def test_leaving_on_an_old_stream_does_not_mark_the_new_one() -> None:
    r = NodeRegistry()
    s1 = reg(r, "d1", (4, 10))
    r.disconnect("d1", s1)
    reg(r, "d1", (4, 11))  # reconnected
    r.mark_leaving("d1", s1)
    assert not r.nodes["d1"].leaving


def test_a_node_that_comes_back_is_registered_anew() -> None:
    r = NodeRegistry()
    s = reg(r, "d1", (4, 20))
    r.set_breaker("d1", "open", "refused")
    r.mark_leaving("d1", s)
    r.disconnect("d1", s)
    r.forget("d1")
    # a new entry: no memory of the epoch, the breaker or the Leaving
    node, _ = r.register(
        node_id="d1", role=DECODE, endpoint="http://127.0.0.1:2", running_max_req_size=8, grant=(3, 5)
    )
    assert node.epoch == 5 and node.share == 3 and not node.leaving and node.breaker_state == "closed"
    assert r.capacity == 3 and r.disconnected() == []


def test_forgetting_frees_room_under_max_nodes() -> None:
    r = NodeRegistry(max_nodes=2)
    for i in range(2):
        s = reg(r, f"old{i}")
        r.mark_leaving(f"old{i}", s)
        r.disconnect(f"old{i}", s)
    with pytest.raises(ProtocolError) as exc:
        reg(r, "new")
    assert exc.value.code == "RESOURCE_EXHAUSTED"
    r.forget("old0")
    reg(r, "new")
    assert sorted(r.nodes) == ["new", "old1"]


def test_decode_shares_lists_every_share_held() -> None:
    r = NodeRegistry()
    reg(r, "d1", (4, 1))
    s2 = reg(r, "d2", (3, 1))
    reg(r, "p1", (8, 1), role=PREFILL)
    assert r.decode_shares() == {"d1": (4, 8), "d2": (3, 8)}
    r.disconnect("d2", s2)
    assert r.decode_shares() == {"d1": (4, 8)}


# -- the metric series ------------------------------------------------------------------------------


def test_forget_node_removes_every_series_of_the_node() -> None:
    cr = CollectorRegistry()
    m = MasterMetrics(cr, "m1")
    r = NodeRegistry()
    s = reg(r, "d1")
    reg(r, "d2")
    for n in ("d1", "d2"):
        m.observe_node(r, n)
    m.breaker_open.labels(node="d1").set(1)
    m.engine_failed("d1", "refused")
    m.engine_failed("d1", "timeout")
    m.engine_failed("d2", "refused")
    r.disconnect("d1", s)
    m.observe_node(r, "d1")
    assert 'pdcoord_node_connected{node="d1"} 0.0' in generate_latest(cr).decode()
    r.mark_key_gone("d1")
    r.forget("d1")
    m.forget_node("d1")
    m.observe_node(r, "d1")  # a late observation of a forgotten node adds nothing back
    text = generate_latest(cr).decode()
    assert 'node="d1"' not in text
    assert 'pdcoord_node_connected{node="d2"} 1.0' in text and 'kind="refused",node="d2"' in text
    assert "pdcoord_nodes_forgotten_total 1.0" in text
    m.forget_node("d1")  # twice: nothing left to remove, no error


def test_a_node_back_under_another_role_keeps_no_series_of_the_old_one() -> None:
    cr = CollectorRegistry()
    m = MasterMetrics(cr, "m1")
    r = NodeRegistry()
    s = reg(r, "n1", role=PREFILL)
    m.observe_node(r, "n1")
    r.disconnect("n1", s)
    reg(r, "n1", (2, 11), role=DECODE)
    m.observe_node(r, "n1")
    text = generate_latest(cr).decode()
    assert 'role="prefill"' not in text and 'pdcoord_node_share_slots{node="n1",role="decode"} 2.0' in text


# -- the master -------------------------------------------------------------------------------------


def _server() -> MasterServer:
    cfg = MasterConfig(master_id="m1", etcd=EtcdSettings(["http://127.0.0.1:9"], "unit"))
    server = MasterServer(cfg)
    server._on_lease_held(True)
    return server


def _connect(server: MasterServer, node_id: str, role: str = DECODE) -> int:
    _, stream = server.registry.register(
        node_id=node_id, role=role, endpoint="http://127.0.0.1:1", running_max_req_size=8, grant=(4, 1)
    )
    server.metrics.observe_node(server.registry, node_id)
    return stream


def _drop(server: MasterServer, node_id: str, stream: int) -> None:
    """What the gRPC service does when a stream ends."""
    server.registry.disconnect(node_id, stream)
    server.metrics.observe_node(server.registry, node_id)
    server._node_closed(node_id)


def _series(server: MasterServer, node_id: str) -> bool:
    return f'node="{node_id}"' in generate_latest(server.metrics_registry).decode()


async def test_the_master_forgets_a_node_that_left_when_its_last_lease_ends() -> None:
    server = _server()
    s = _connect(server, "d1")
    await asyncio.sleep(0)
    lease = await server.admission.acquire_lease(1)
    assert lease.node == "d1"
    server.registry.mark_leaving("d1", s)
    _drop(server, "d1", s)
    assert "d1" in server.registry.nodes and _series(server, "d1")  # its lease still runs
    lease.release()
    await server._forget_pass()
    assert "d1" not in server.registry.nodes and not _series(server, "d1")
    assert "d1" not in server.breakers.breakers


async def test_the_master_forgets_a_node_that_left_at_once_when_nothing_runs_there() -> None:
    server = _server()
    s = _connect(server, "p1", PREFILL)
    server.pipeline.router.index.record("p1", [1, 2, 3])
    server.registry.mark_leaving("p1", s)
    _drop(server, "p1", s)
    assert "p1" not in server.registry.nodes and not _series(server, "p1")
    assert server.pipeline.router.index.nodes() == []


async def test_a_prefill_in_flight_keeps_the_node_until_it_is_done() -> None:
    server = _server()
    s = _connect(server, "p1", PREFILL)
    router = server.pipeline.router
    node = server.registry.nodes["p1"]
    router.routed(node, [1])
    server.registry.mark_leaving("p1", s)
    _drop(server, "p1", s)
    assert "p1" in server.registry.nodes
    router.prefill_done(node)
    await server._forget_pass()
    assert "p1" not in server.registry.nodes and "p1" not in router.prefill_in_flight


async def test_a_disconnected_node_whose_etcd_key_is_gone_is_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = _server()
    monkeypatch.setattr(server_module, "KEY_CHECK_S", 0.0)
    keys: dict[str, KeyValue] = {}
    asked: list[str] = []

    async def get(key: str) -> KeyValue | None:
        asked.append(key)
        return keys.get(key)

    monkeypatch.setattr(server.etcd, "get", get)
    s1 = _connect(server, "d1")
    s2 = _connect(server, "d2")
    _connect(server, "d3")
    keys[server.keys.node("d2")] = KeyValue(server.keys.node("d2"), b"{}", 1, 1, 1, 7)
    _drop(server, "d1", s1)  # killed: no Leaving, its key goes with its lease
    _drop(server, "d2", s2)  # cut from this master only: its key stays
    assert "d1" in server.registry.nodes  # nothing known yet
    await server._forget_pass()  # the first look is due one period after the drop (0 here)
    assert "d1" not in server.registry.nodes and not _series(server, "d1")
    assert "d2" in server.registry.nodes and not server.registry.nodes["d2"].gone
    assert server.keys.node("d3") not in asked  # a live stream is never looked up


async def test_many_keys_due_are_read_in_one_range(monkeypatch: pytest.MonkeyPatch) -> None:
    server = _server()
    monkeypatch.setattr(server_module, "KEY_CHECK_S", 0.0)
    present = {"d0", "d5"}

    async def get(key: str) -> KeyValue | None:
        raise AssertionError("one range read, not a read per key")

    async def get_prefix(prefix: str) -> tuple[list[KeyValue], int]:
        assert prefix == server.keys.nodes_prefix
        kvs = [KeyValue(server.keys.node(n), b"{}", 1, 1, 1, 7) for n in present]
        kvs.append(KeyValue(prefix + "stray/key", b"", 1, 1, 1, 0))
        return kvs, 1

    monkeypatch.setattr(server.etcd, "get", get)
    monkeypatch.setattr(server.etcd, "get_prefix", get_prefix)
    n = server_module.KEY_CHECK_MAX_GETS + 4
    for i in range(n):
        _drop(server, f"d{i}", _connect(server, f"d{i}"))
    await server._forget_pass()
    assert sorted(server.registry.nodes) == ["d0", "d5"]


async def test_etcd_unreachable_forgets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    server = _server()
    monkeypatch.setattr(server_module, "KEY_CHECK_S", 0.0)

    async def get(key: str) -> KeyValue | None:
        raise EtcdUnavailable("down")

    monkeypatch.setattr(server.etcd, "get", get)
    _drop(server, "d1", _connect(server, "d1"))
    with pytest.raises(EtcdUnavailable):
        await server._forget_pass()  # the loop logs it and tries again later
    assert "d1" in server.registry.nodes and not server.registry.nodes["d1"].gone


async def test_a_node_that_reconnects_is_no_longer_looked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    server = _server()
    monkeypatch.setattr(server_module, "KEY_CHECK_S", 3600.0)
    s = _connect(server, "d1")
    _drop(server, "d1", s)
    await server._forget_pass()
    assert "d1" in server._key_check_at
    _connect(server, "d1")
    await server._forget_pass()
    assert server._key_check_at == {}
