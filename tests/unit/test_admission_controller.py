"""The asyncio admission adapter on a real event loop."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from pdcoord.config import EnvArgumentParser
from pdmaster.admission import (
    CLASS_ORDER,
    OUTCOMES,
    AdmissionPolicy,
    Reason,
    RequestClass,
    Ticket,
    TicketState,
)
from pdmaster.admission_controller import (
    HTTP_STATUS,
    MESSAGES,
    AdmissionController,
    AdmissionRejected,
    HandedOff,
    add_admission_flags,
    policy_from_args,
)
from pdmaster.metrics import AdmissionMetrics

CONT = RequestClass.CONTINUATION
COLD = RequestClass.COLD


def make(shares: dict[str, int], **policy: object) -> AdmissionController:
    ctl = AdmissionController(AdmissionPolicy(**policy), registry=CollectorRegistry(), master_id="m1")  # type: ignore[arg-type]
    ctl.set_shares(shares)
    return ctl


def sample(ctl: AdmissionController, name: str, **labels: str) -> float | None:
    return ctl.registry.get_sample_value(name, labels)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_acquire_places_on_a_node_and_releases_on_exit() -> None:
    ctl = make({"d1": 1, "d2": 2})
    async with ctl.acquire(slots=2, request_class=COLD) as lease:
        assert lease.node == "d2" and lease.ticket.slots == 2 and lease.wait_s == 0.0
        assert ctl.active_on("d2") == 2
    assert lease.ticket.released and ctl.core.active == 0
    lease.release()  # idempotent
    assert ctl.core.active == 0


async def test_waiter_is_woken_by_release_and_reports_its_wait() -> None:
    ctl = make({"d1": 1})
    holder = await ctl.acquire_lease()
    waiter = asyncio.create_task(ctl.acquire_lease(request_class=CONT))
    await settle()
    assert ctl.snapshot()["queued_requests"] == 1 and not waiter.done()
    await asyncio.sleep(0.02)
    holder.release()
    lease = await asyncio.wait_for(waiter, 1)
    assert lease.node == "d1" and lease.wait_s >= 0.015
    lease.release()
    assert sample(ctl, "pdcoord_admission_wait_seconds_count", **{"class": "continuation"}) == 1


async def test_cancel_while_queued_removes_the_ticket() -> None:
    ctl = make({"d1": 1})
    holder = await ctl.acquire_lease()

    async def use() -> None:
        async with ctl.acquire():
            raise AssertionError("must not run")

    task = asyncio.create_task(use())
    await settle()
    assert ctl.snapshot()["queued_requests"] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ctl.snapshot()["queued_requests"] == 0 and ctl.snapshot()["waiters"] == 0
    holder.release()
    assert ctl.core.active == 0
    assert sample(ctl, "pdcoord_admission_outcomes_total", **{"class": "cold", "outcome": "cancelled"}) == 1


async def test_cancel_right_after_grant_releases() -> None:
    ctl = make({"d1": 1})
    holder = await ctl.acquire_lease()
    task = asyncio.create_task(ctl.acquire_lease())
    await settle()
    holder.release()  # grants the waiter's ticket and resolves its future ...
    assert ctl.core.active == 1
    task.cancel()  # ... but the task is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ctl.core.active == 0 and ctl.snapshot()["waiters"] == 0


async def test_exception_inside_the_block_releases() -> None:
    ctl = make({"d1": 1})
    with pytest.raises(RuntimeError):
        async with ctl.acquire():
            assert ctl.core.active == 1
            raise RuntimeError("dispatch failed")
    assert ctl.core.active == 0
    async with ctl.acquire() as lease:  # the slot is usable again
        assert lease.node == "d1"


async def test_timeout_raises_with_retry_hint_and_uses_one_timer() -> None:
    waits = {RequestClass.CONTINUATION: 0.3, RequestClass.PROBABLE_CACHE_HIT: 0.2, RequestClass.COLD: 0.1}
    ctl = make({"d1": 1}, max_wait_s=waits, queue_waves=50)
    holder = await ctl.acquire_lease()
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    tasks = [asyncio.create_task(ctl.acquire_lease(request_class=COLD)) for _ in range(20)]
    tasks.append(asyncio.create_task(ctl.acquire_lease(request_class=CONT)))
    await settle()
    timers = [h for h in loop._scheduled if h._callback == ctl._on_timer and not h.cancelled()]  # type: ignore[attr-defined]
    assert len(timers) == 1
    results = await asyncio.gather(*tasks, return_exceptions=True)
    elapsed = time.monotonic() - started
    assert all(isinstance(r, AdmissionRejected) for r in results)
    r0 = results[0]
    assert isinstance(r0, AdmissionRejected)
    assert r0.code == "timeout" and r0.http_status == 429 and r0.retry_after_header() is not None
    assert elapsed >= 0.25  # the CONT waiter ran its full 0.3 s (no upper bound: the machine may be busy)
    assert sample(ctl, "pdcoord_admission_outcomes_total", **{"class": "cold", "outcome": "timeout"}) == 20
    assert ctl.snapshot()["queued_requests"] == 0
    await asyncio.sleep(0.35)  # a timer armed for a deadline that went away fires harmlessly
    assert ctl._timer is None
    holder.release()


async def test_immediate_rejections_raise() -> None:
    ctl = make({})
    with pytest.raises(AdmissionRejected) as exc:
        async with ctl.acquire():
            pass
    assert exc.value.code == "no_capacity" and exc.value.http_status == 503
    ctl.set_shares({"d1": 2})
    with pytest.raises(AdmissionRejected) as exc:
        await ctl.acquire_lease(slots=3)
    assert exc.value.http_status == 400 and exc.value.retry_after_header() is None


def test_outcome_codes_map_to_http_status_and_message() -> None:
    for code in OUTCOMES:
        if code != "granted":
            assert MESSAGES[code] and HTTP_STATUS.get(code, 429) in (400, 429, 503)
    t = Ticket(1, 1, COLD, None, 0.0)
    t.state, t.reason = TicketState.EVICTED, Reason("evicted", 2.5)
    exc = AdmissionRejected.from_ticket(t)
    assert (exc.code, exc.status, exc.http_status, exc.retry_after) == ("evicted", 429, 429, 2.5)
    assert exc.message == MESSAGES["evicted"] and exc.retry_after_header() == "3"
    t.reason = Reason("unsatisfiable", None)
    exc = AdmissionRejected.from_ticket(t)
    assert exc.status == 400 and exc.retry_after_header() is None


async def test_instruments_can_be_shared_through_a_given_metrics_object() -> None:
    reg = CollectorRegistry()
    ctl = AdmissionController(
        AdmissionPolicy(), metrics=AdmissionMetrics(reg, CLASS_ORDER, OUTCOMES), master_id="m1"
    )
    assert ctl.registry is reg
    ctl.set_shares({"d1": 2})
    lease = await ctl.acquire_lease(request_class=CONT)
    await settle()
    assert reg.get_sample_value("pdcoord_admission_active_slots") == 1
    assert reg.get_sample_value("pdcoord_admission_capacity_slots") == 2
    labels = {"class": "continuation", "outcome": "granted"}
    assert reg.get_sample_value("pdcoord_admission_outcomes_total", labels) == 1
    assert reg.get_sample_value("pdcoord_admission_wait_seconds_count", {"class": "continuation"}) == 1
    lease.release()
    ctl.close()


async def test_gauges_coalesce_per_tick_and_skip_unchanged_values() -> None:
    ctl = make({"d1": 64})
    await settle()
    base = ctl.publish_count
    leases = await asyncio.gather(*(ctl.acquire_lease() for _ in range(40)))
    await settle()
    assert ctl.publish_count - base <= 2  # 40 grants, at most a couple of publications
    assert sample(ctl, "pdcoord_admission_active_slots") == 40
    assert sample(ctl, "pdcoord_admission_capacity_slots") == 64
    n = ctl.publish_count
    for lease in leases:
        lease.release()
    assert ctl.publish_count == n  # nothing published synchronously inside the tick
    await settle()
    assert ctl.publish_count == n + 1 and sample(ctl, "pdcoord_admission_active_slots") == 0
    # acquire and release within one tick: the values end where they were, nothing is published
    lease = await ctl.acquire_lease()
    lease.release()
    await settle()
    assert ctl.publish_count == n + 1


async def test_queue_gauges_and_growth_wakes_waiters() -> None:
    ctl = make({"d1": 1}, queue_waves=10)
    holder = await ctl.acquire_lease()
    tasks = [asyncio.create_task(ctl.acquire_lease(slots=1)) for _ in range(3)]
    await settle()
    assert sample(ctl, "pdcoord_admission_queued_requests") == 3
    assert sample(ctl, "pdcoord_admission_queued_slots") == 3
    ctl.set_shares({"d1": 1, "d2": 3})
    leases = await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert {lease.node for lease in leases} == {"d2"}
    await settle()
    assert sample(ctl, "pdcoord_admission_queued_requests") == 0
    for lease in [*leases, holder]:
        lease.release()


async def test_observe_output_promotes_waiters() -> None:
    ctl = make({"d1": 1}, queue_waves=10)
    holder = await ctl.acquire_lease(session_id="other")
    cold = asyncio.create_task(ctl.acquire_lease(request_class=RequestClass.PROBABLE_CACHE_HIT))
    await settle()
    sess = asyncio.create_task(ctl.acquire_lease(request_class=COLD, session_id="s"))
    await settle()
    assert ctl.classify("s") is COLD
    ctl.observe_output("s")
    assert ctl.classify("s") is CONT
    holder.release()
    lease = await asyncio.wait_for(sess, 1)
    assert lease.ticket.request_class is CONT and not cold.done()
    lease.release()
    (await asyncio.wait_for(cold, 1)).release()


async def test_bypass_and_two_controllers_in_one_process() -> None:
    a = AdmissionController(AdmissionPolicy(bypass=True))
    b = AdmissionController(AdmissionPolicy(bypass=True))
    a.set_shares({"d1": 1})
    leases = [await a.acquire_lease(slots=2) for _ in range(3)]
    assert a.core.active == 6 and b.core.active == 0
    for lease in leases:
        lease.release()
    assert a.core.active == 0
    a.close()
    b.close()


def test_cli_flags_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = EnvArgumentParser(prog="pdmaster", env_prefix="PDMASTER")
    add_admission_flags(parser)
    p = policy_from_args(parser.parse_args(["--disable_pd_master_decode_capacity_limit"]))
    assert p.bypass
    p = policy_from_args(parser.parse_args(["--admission-weights", "4:2:1", "--admission-queue-waves", "2"]))
    assert not p.bypass and p.weights[CONT] == 4 and p.queue_waves == 2 and p.max_wait_s[COLD] == 5
    monkeypatch.setenv("PDMASTER_DISABLE_DECODE_CAPACITY_LIMIT", "true")
    parser = EnvArgumentParser(prog="pdmaster", env_prefix="PDMASTER")
    add_admission_flags(parser)
    assert policy_from_args(parser.parse_args([])).bypass
    with pytest.raises(SystemExit):
        parser.parse_args(["--admission-weights", "8:3"])


async def test_a_waiter_due_before_the_armed_timer_brings_it_forward() -> None:
    ctl = make(
        {"d1": 1}, queue_waves=10, max_wait_s={CONT: 30, RequestClass.PROBABLE_CACHE_HIT: 30, COLD: 0.05}
    )
    holder = await ctl.acquire_lease()
    cont = asyncio.create_task(ctl.acquire_lease(request_class=CONT))
    await settle()
    armed = ctl._timer_at
    cold = asyncio.create_task(ctl.acquire_lease(request_class=COLD))
    await settle()
    assert armed is not None and ctl._timer_at is not None and ctl._timer_at < armed
    with pytest.raises(AdmissionRejected) as exc:
        await cold
    assert exc.value.code == "timeout" and not cont.done()
    cont.cancel()
    holder.release()


async def test_a_retry_avoids_the_failed_node_waits_and_keeps_its_deadline_and_class() -> None:
    waits = {RequestClass.CONTINUATION: 30.0, RequestClass.PROBABLE_CACHE_HIT: 15.0, RequestClass.COLD: 5.0}
    ctl = make({"d1": 1, "d2": 1}, max_wait_s=waits, queue_waves=5)
    first = await ctl.acquire_lease(request_class=CONT)
    other = await ctl.acquire_lease()
    assert first.deadline == pytest.approx(first.ticket.enqueued_at + 30.0)  # granted at once
    failed = first.node
    assert failed is not None
    first.release()  # its engine failed: room on the failed node only
    newer = asyncio.create_task(ctl.acquire_lease(request_class=CONT))
    await settle()
    assert newer.done()  # a first-time request may use the failed node
    newer_lease = newer.result()
    assert newer_lease.node == failed
    newer_lease.release()
    retry = asyncio.create_task(
        ctl.acquire_lease(request_class=CONT, avoid=frozenset({failed}), deadline=first.deadline)
    )
    await settle()
    assert not retry.done()  # only the node that failed it has room
    newest = asyncio.create_task(ctl.acquire_lease(request_class=CONT))
    await settle()
    assert newest.done() and newest.result().node == failed  # not held up by the waiting retry
    queued = asyncio.create_task(ctl.acquire_lease(request_class=CONT))  # newer, same class
    await settle()
    assert not queued.done()
    other.release()  # room elsewhere: the retry, not the newer waiter, gets it
    lease = await asyncio.wait_for(retry, 5)
    assert lease.node != failed and lease.ticket.request_class is CONT
    assert lease.deadline == first.deadline  # a second retry would keep it too
    await settle()
    assert not queued.done()
    lease.release()
    (await asyncio.wait_for(queued, 5)).release()
    newest.result().release()


async def test_a_retry_times_out_at_the_first_deadline() -> None:
    waits = {RequestClass.CONTINUATION: 30.0, RequestClass.PROBABLE_CACHE_HIT: 15.0, RequestClass.COLD: 30.0}
    ctl = make({"d1": 1, "d2": 1}, max_wait_s=waits)
    holder = await ctl.acquire_lease()
    # the first lease's deadline, 0.2 s from now (not a fresh 30 s wait)
    free_node = ({"d1", "d2"} - {holder.node}).pop()
    deadline = time.monotonic() + 0.2
    retry = asyncio.create_task(ctl.acquire_lease(avoid=frozenset({free_node}), deadline=deadline))
    with pytest.raises(AdmissionRejected) as exc:
        await asyncio.wait_for(retry, 10)
    assert exc.value.code == "timeout"
    holder.release()


async def test_after_a_pause_the_queue_moves_when_the_hold_ends_without_another_event() -> None:
    """The hold's end is a deadline of its own: nothing else happens, yet the waiter is placed."""
    ctl = make({"d1": 1}, queue_waves=5)
    resumed = [float("-inf")]
    ctl.watch_pauses(lambda now: resumed[0], hold_s=0.3)
    far = asyncio.create_task(ctl.acquire_lease(request_class=CONT))  # arms the timer far ahead
    await settle()
    far_lease = far.result()
    blocked = asyncio.create_task(ctl.acquire_lease(request_class=CONT))
    await settle()
    assert ctl._timer_at is not None
    resumed[0] = time.monotonic()
    far_lease.release()  # the first call after the pause: frees d1 but places nothing
    await settle()
    assert not blocked.done() and ctl.snapshot()["pauses"] == 1
    lease = await asyncio.wait_for(blocked, 5)
    assert lease.node == "d1" and lease.wait_s >= 0.25
    lease.release()
    ctl.close()


async def test_a_lease_abandoned_after_its_decode_went_out_is_remembered_per_node() -> None:
    """A master names a lost stream released only if no request it abandoned there may still run in
    the engine (pdmaster.server.RELEASE_ABORT_MARGIN_S): a lease released by the ``async with``
    without its answer read whole, once its decode request had gone out, is remembered per node; one
    whose answer the relay read whole (``release()``), or whose decode never went out, is not."""
    now = [100.0]
    ctl = AdmissionController(AdmissionPolicy(), registry=CollectorRegistry(), clock=lambda: now[0])
    ctl.set_shares({"d1": 2})
    async with ctl.acquire() as lease:  # the relay read the answer whole
        lease.decode_sent()
        lease.release()
    async with ctl.acquire() as lease:  # failed before its decode request went out
        pass
    assert ctl.unfinished_end_at("d1") == float("-inf")
    now[0] = 105.0
    with pytest.raises(RuntimeError):
        async with ctl.acquire() as lease:
            lease.decode_sent()
            raise RuntimeError("the client went away")
    assert ctl.unfinished_end_at("d1") == 105.0 and ctl.core.active == 0
    ctl.forget_node("d1")
    assert ctl.unfinished_end_at("d1") == float("-inf")


async def test_a_waiter_handed_to_a_peer_leaves_and_comes_back_first_by_its_deadline() -> None:
    """``hand_off`` (pdmaster/spill.py): the oldest waiter that fits the peer's room leaves the queue
    with HandedOff (the peer, its deadline, its wait); resubmitted with that deadline when the peer
    had filled meanwhile, it goes before the waiters that stayed."""
    ctl = make({"d1": 1}, queue_waves=20)
    holder = await ctl.acquire_lease()
    first = asyncio.create_task(ctl.acquire_lease(request_class=COLD, session_id="s1"))
    await settle()
    second = asyncio.create_task(ctl.acquire_lease(request_class=COLD, session_id="s2"))
    await settle()
    assert ctl.has_handoffs() and ctl.free_now() == 0
    assert ctl.hand_off("m2", 0) == 0
    assert ctl.hand_off("m2", 1) == 1
    with pytest.raises(HandedOff) as info:
        await asyncio.wait_for(first, 1)
    exc = info.value
    assert exc.peer == "m2" and exc.code == "handed_off" and exc.request_class is COLD
    assert exc.deadline > time.monotonic() and exc.waited_s >= 0.0
    assert sample(ctl, "pdcoord_admission_outcomes_total", **{"class": "cold", "outcome": "handed_off"}) == 1
    assert not second.done() and ctl.snapshot()["queued_requests"] == 1
    back = asyncio.create_task(ctl.acquire_lease(request_class=COLD, deadline=exc.deadline))
    await settle()
    holder.release()
    lease = await asyncio.wait_for(back, 1)
    assert not second.done()
    lease.release()
    (await asyncio.wait_for(second, 1)).release()
    assert not ctl.has_handoffs() and ctl.free_now() == 1 and not ctl._handed
