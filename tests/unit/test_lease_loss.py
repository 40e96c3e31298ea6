"""A master that can no longer prove its etcd lease alive stops admitting before etcd could expire it.

The rule (``LeaseClock``) is pure and tested on plain numbers; the keeper and the registration on a
fake clock and a fake etcd (no etcd: what is checked is when they stop and start counting on the
lease); the master's reaction on its admission controller and HTTP API without any network.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdcoord.config import EtcdSettings
from pdcoord.etcd import EtcdUnavailable, KeyValue
from pdcoord.registration import MAX_LEASE_MARGIN_S, LeaseClock, LeaseKeeper, Registration, lease_margin
from pdmaster.admission_controller import AdmissionRejected
from pdmaster.config import MasterConfig
from pdmaster.registry import DECODE, PREFILL
from pdmaster.server import MasterServer

# -- the rule ---------------------------------------------------------------------------------------


def test_the_lease_is_counted_on_until_ttl_minus_margin_after_the_last_confirmed_send() -> None:
    c = LeaseClock(ttl=5.0, margin=0.5)
    assert c.expires_at == -math.inf and not c.held(0.0)  # nothing confirmed yet
    c.confirm(100.0)  # the grant, sent at 100
    assert c.expires_at == 105.0 and c.held_until == 104.5
    assert c.held(104.49) and not c.held(104.5)
    c.confirm(101.7, ttl=5)  # a renewal sent at 101.7 was answered
    assert c.held_until == pytest.approx(106.2)


def test_an_older_confirmation_never_moves_the_deadline_back() -> None:
    c = LeaseClock(ttl=5.0, margin=0.5)
    c.confirm(110.0, ttl=5)
    c.confirm(108.0, ttl=5)  # the answer to an earlier renewal, late
    assert c.confirmed_at == 110.0 and c.held_until == 114.5


def test_the_smaller_of_the_asked_and_the_answered_ttl_counts() -> None:
    c = LeaseClock(ttl=5.0, margin=0.5)
    c.confirm(0.0, ttl=3)
    assert c.expires_at == 3.0
    c.confirm(1.0, ttl=10)  # etcd's minimum TTL may be more than asked: never counted beyond the ask
    assert c.expires_at == 6.0
    c.confirm(2.0, ttl=0)  # not an answer that confirms anything; the last TTL stays
    assert c.expires_at == 7.0


def test_margin_defaults_and_bad_values() -> None:
    assert lease_margin(5) == MAX_LEASE_MARGIN_S == 0.5
    assert lease_margin(1) == 0.25  # a quarter of a short TTL: renewals every TTL/3 still fit
    with pytest.raises(ValueError):
        LeaseClock(ttl=0, margin=0)
    with pytest.raises(ValueError):
        LeaseClock(ttl=1, margin=1)
    with pytest.raises(ValueError):
        LeaseClock(ttl=1, margin=-0.1)


# -- the keeper on a fake clock ------------------------------------------------------------------


class _Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class _Renewer:
    """Answers a renewal with ``ttl`` when the test lets it (``answer``); hangs otherwise (etcd
    silent). Counts the renewals asked."""

    def __init__(self) -> None:
        self.ttl = 5
        self.silent = False
        self.asked = 0
        self._wake = asyncio.Event()

    async def renew(self) -> int:
        self.asked += 1
        while self.silent:
            self._wake.clear()
            await self._wake.wait()
        return self.ttl

    def answer(self, ttl: int = 5) -> None:
        self.ttl, self.silent = ttl, False
        self._wake.set()

    def close(self) -> None:
        pass


class _FakeEtcd:
    """The few calls Registration makes, in memory."""

    def __init__(self) -> None:
        self.kv: dict[str, KeyValue] = {}
        self.next_lease = 0x10
        self.renewers: dict[int, _Renewer] = {}
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise EtcdUnavailable("etcd unreachable (fake)")

    async def get(self, key: str) -> KeyValue | None:
        self._check()
        return self.kv.get(key)

    async def grant_lease(self, ttl: int) -> int:
        self._check()
        self.next_lease += 1
        self.renewers[self.next_lease] = _Renewer()
        return self.next_lease

    async def create_if_absent(self, key: str, value: bytes, *, lease: int) -> tuple[bool, KeyValue]:
        self._check()
        if key in self.kv:
            return False, self.kv[key]
        kv = self.kv[key] = KeyValue(key, value, 1, 1, 1, lease)
        return True, kv

    async def revoke_lease(self, lease: int) -> None:
        self._check()
        self.expire(lease)

    def expire(self, lease: int) -> None:
        for key in [k for k, v in self.kv.items() if v.lease == lease]:
            del self.kv[key]

    def renewer(self, lease: int) -> _Renewer:
        return self.renewers[lease]


async def _until(cond: Any, what: str, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_the_keeper_stops_counting_on_a_lease_etcd_does_not_answer_for() -> None:
    clock = _Clock()
    renewer = _Renewer()
    etcd = _FakeEtcd()
    etcd.renewers[7] = renewer
    told: list[bool] = []
    keeper = LeaseKeeper(
        etcd,  # type: ignore[arg-type]
        7,
        ttl=6,
        interval=3600,  # one renewal at the start, then the test drives
        on_held=told.append,
        confirmed_at=clock.now - 1,  # the grant was sent a second ago
        clock=clock,
    )
    assert keeper.lease_clock.held_until == clock.now - 1 + 6 - 0.5
    renewer.silent = True  # etcd stops answering: the first renewal hangs
    keeper.start()
    try:
        await _until(lambda: renewer.asked == 1, "the first renewal")
        assert keeper.held
        clock.now += 4.4  # 5.4 s after the grant was sent: 0.1 s of the margin left
        keeper._check_held()  # what the watchdog's timer does
        assert keeper.held and told == []
        clock.now += 0.1  # ttl - margin after the last confirmed send
        assert not keeper.held  # read at any moment, not only when the timer fires
        keeper._check_held()
        assert told == [False] and keeper.alive and keeper.unconfirmed_spells == 1
        keeper._check_held()
        assert told == [False]  # told once per spell
        renewer.answer(6)  # etcd answers: the lease is alive, counted from the send of that renewal
        await _until(lambda: told == [False, True], "the lease counted on again")
        assert keeper.held and keeper.alive
    finally:
        await keeper.stop()


async def test_the_watchdog_fires_on_time_without_a_renewal() -> None:
    # a real event loop, a real (short) deadline: the timer, not a later renewal, turns held off
    loop = asyncio.get_running_loop()
    renewer = _Renewer()
    renewer.silent = True
    etcd = _FakeEtcd()
    etcd.renewers[9] = renewer
    told: list[tuple[bool, float]] = []
    sent = loop.time()
    keeper = LeaseKeeper(
        etcd,  # type: ignore[arg-type]
        9,
        ttl=1,
        on_held=lambda held: told.append((held, loop.time())),
        confirmed_at=sent,
        clock=loop.time,
    ).start()
    try:
        await _until(lambda: told, "the watchdog")
        held, at = told[0]
        assert not held and at >= sent + 1 - lease_margin(1)
        assert at < sent + 1  # before etcd could expire the lease (generous: the loop is idle)
    finally:
        await keeper.stop()


async def test_a_lease_etcd_says_is_gone_is_lost() -> None:
    renewer = _Renewer()
    etcd = _FakeEtcd()
    etcd.renewers[3] = renewer
    lost: list[bool] = []
    renewer.ttl = 0  # the first answer: gone
    keeper = LeaseKeeper(etcd, 3, ttl=5, on_lost=lambda: lost.append(True)).start()  # type: ignore[arg-type]
    await _until(lambda: lost, "on_lost")
    assert not keeper.alive and not keeper.held and not keeper.running


# -- the registration -------------------------------------------------------------------------------


async def test_registration_reports_held_flips_and_re_registers_after_etcd_says_gone() -> None:
    clock = _Clock()
    etcd = _FakeEtcd()
    told: list[bool] = []
    reg = Registration(etcd, "/p/c/masters/m1", b"m1", ttl=6, on_held=told.append, clock=clock)  # type: ignore[arg-type]
    await reg.start()
    try:
        first = reg.lease_id
        assert reg.held and reg.alive and told == []  # the start is no flip
        keeper = reg.keeper
        assert keeper is not None
        await _until(lambda: etcd.renewers[first].asked >= 1, "a renewal")
        etcd.renewers[first].silent = True
        await _until(lambda: etcd.renewers[first].asked >= 2 or keeper.renewals >= 1, "renewals")
        # cut off: time runs past the margin with nothing confirmed
        clock.now += 6.0
        keeper._check_held()
        assert told == [False] and not reg.held and reg.alive  # etcd never said it is gone
        # etcd comes back and the lease has expired meanwhile: its key is gone, the answer says so
        etcd.expire(first)
        etcd.renewers[first].answer(0)
        await _until(lambda: told == [False, True], "re-registered")
        assert reg.held and reg.lease_id not in (0, first) and reg.reregistrations == 1
        assert etcd.kv["/p/c/masters/m1"].lease == reg.lease_id
    finally:
        await reg.stop()
    assert told == [False, True]  # a stop is no flip


async def test_a_stopped_registration_tells_nothing() -> None:
    clock = _Clock()
    etcd = _FakeEtcd()
    told: list[bool] = []
    reg = Registration(etcd, "/p/c/masters/m2", b"m2", ttl=6, on_held=told.append, clock=clock)  # type: ignore[arg-type]
    await reg.start()
    keeper = reg.keeper
    assert keeper is not None
    await reg.stop()
    clock.now += 60
    keeper._check_held()
    assert told == [] and not reg.held


# -- the master ---------------------------------------------------------------------------------------


def _server() -> MasterServer:
    cfg = MasterConfig(master_id="m1", etcd=EtcdSettings(["http://127.0.0.1:9"], "unit"))
    return MasterServer(cfg)


def _connect(server: MasterServer, node_id: str, role: str, share: int, epoch: int = 1) -> int:
    _, stream = server.registry.register(
        node_id=node_id,
        role=role,
        endpoint=f"http://127.0.0.1:1/{node_id}",
        running_max_req_size=8,
        grant=(share, epoch),
    )
    return stream


async def test_the_master_admits_only_while_it_holds_its_lease() -> None:
    server = _server()
    adm = server.admission
    stream = _connect(server, "d1", DECODE, 4)
    await asyncio.sleep(0)  # share changes reach admission once per loop tick
    assert adm.core.capacity == 0  # not registered yet: nothing to count on
    server._on_lease_held(True)
    assert adm.core.capacity == 4
    assert server.metrics.lease_held._value.get() == 1

    running = await adm.acquire_lease(2)  # a request running on d1
    queued = asyncio.create_task(adm.acquire_lease(4))
    await asyncio.sleep(0)
    assert adm.core.queued_requests == 1

    server._on_lease_held(False)  # no renewal confirmed in time
    assert adm.core.capacity == 0
    with pytest.raises(AdmissionRejected) as refused:
        await queued
    assert refused.value.status == 503  # the queue is refused, clients retry elsewhere
    assert running.node == "d1" and adm.core.active == 2  # running requests finish
    with pytest.raises(AdmissionRejected):
        await adm.acquire_lease(1)
    assert server.metrics.lease_losses._value.get() == 1

    # meanwhile the agent hands part of the share on (its key went): the registry follows, admission
    # keeps holding nothing
    server.registry.apply_grant("d1", stream, 1, 2)
    await asyncio.sleep(0)
    assert adm.core.capacity == 0 and server.registry.capacity == 1

    running.release()
    server._on_lease_held(True)  # etcd confirms the lease again (or the key was re-created)
    assert adm.core.capacity == 1  # what the agent grants now, not what it granted before
    lease = await adm.acquire_lease(1)
    lease.release()
    server._on_lease_held(True)  # no flip: nothing happens
    assert server.metrics.lease_losses._value.get() == 1


async def test_while_the_lease_is_lost_the_api_refuses_and_readiness_fails() -> None:
    server = _server()
    _connect(server, "p1", PREFILL, 8)
    _connect(server, "d1", DECODE, 8)
    lost = False
    server.lifecycle.registered_while(lambda: not lost)
    server.lifecycle.lease_lost_while(lambda: lost)
    async with TestClient(TestServer(server.build_app())) as client:
        resp = await client.get("/readiness")
        assert resp.status == 200, await resp.text()
        lost = True
        resp = await client.get("/readiness")
        body = await resp.json()
        assert resp.status == 503 and "lease" in body["reason"]
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
        body = await resp.json()
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert body["error"]["code"] == "etcd_lease_lost"
        assert body["error"]["type"] == "service_unavailable" and "another master" in body["error"]["message"]
        resp = await client.get("/health")  # liveness stays: the process is fine, it re-registers
        assert resp.status == 200 and (await resp.json())["registered"] is False
