"""Two-stage admission: gate passes over capacity + lookahead, exact decode leases after the prefill."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from pdcoord.config import EnvArgumentParser, EtcdSettings
from pdmaster.admission import AdmissionPolicy, RequestClass
from pdmaster.admission_controller import (
    AdmissionController,
    AdmissionRejected,
    add_admission_flags,
    policy_from_args,
)
from pdmaster.config import ConfigError, MasterConfig
from pdmaster.staged_admission import GATE_NODE, GatePass, StagedAdmission, make_admission

CONT = RequestClass.CONTINUATION
COLD = RequestClass.COLD


def make(shares: dict[str, int], lookahead: float = 0.5, **policy: object) -> StagedAdmission:
    adm = StagedAdmission(
        AdmissionPolicy(prefill_lookahead=lookahead, **policy),  # type: ignore[arg-type]
        registry=CollectorRegistry(),
        master_id="m1",
    )
    adm.set_shares(shares)
    return adm


def sample(adm: AdmissionController, name: str, **labels: str) -> float | None:
    return adm.registry.get_sample_value(name, labels)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_the_gate_admits_capacity_plus_lookahead_and_decode_stays_exact() -> None:
    adm = make({"d1": 2, "d2": 2}, lookahead=0.5)  # C = 4, L = 2
    assert adm.gate is not None and adm.gate.core.capacity == 6
    passes = [await adm.acquire_pass(1, COLD) for _ in range(6)]
    assert all(isinstance(p, GatePass) and p.node == GATE_NODE for p in passes)
    seventh = asyncio.ensure_future(adm.acquire_pass(1, COLD))
    await settle()
    assert not seventh.done()  # the gate is full: it queues
    leases = [await adm.acquire_decode(p, 1, COLD) for p in passes[:4]]
    assert {lease.node for lease in leases} == {"d1", "d2"} and adm.core.active == 4
    fifth = asyncio.ensure_future(adm.acquire_decode(passes[4], 1, COLD))
    await settle()
    assert not fifth.done() and adm.core.active == 4  # never beyond the shares
    leases[0].release()  # the decode lease and its pass
    lease5 = await asyncio.wait_for(fifth, 5)
    assert lease5.node == leases[0].node and adm.core.active == 4
    p7 = await asyncio.wait_for(seventh, 5)  # the released pass let the seventh through the gate
    assert isinstance(p7, GatePass)
    for p in [*passes[1:], p7]:
        p.release()
    assert adm.core.active == 0 and adm.gate.core.active == 0


async def test_releasing_the_pass_releases_its_decode_lease_idempotently() -> None:
    adm = make({"d1": 1})
    gate_pass = await adm.acquire_pass(1, COLD)
    lease = await adm.acquire_decode(gate_pass, 1, COLD)
    assert adm.active_on("d1") == 1
    gate_pass.release()  # the pipeline's async with ends both on every path
    assert adm.active_on("d1") == 0 and lease.ticket.released and gate_pass.ticket.released
    lease.release()
    gate_pass.release()
    assert adm.core.active == 0
    assert adm.gate is not None and adm.gate.core.active == 0
    with pytest.raises(ValueError, match="gate pass"):
        await adm.acquire_decode(gate_pass, 1, COLD)  # one decode lease per pass


async def test_async_with_acquire_hands_out_a_pass_and_ends_both() -> None:
    adm = make({"d1": 2})
    async with adm.acquire(slots=1, request_class=COLD) as gate_pass:
        lease = await adm.acquire_decode(gate_pass, 1, COLD)
        assert lease.node == "d1" and adm.core.active == 1
    assert adm.core.active == 0 and lease.ticket.released


@pytest.mark.parametrize(
    ("shares", "caps", "slots", "code", "status"),
    [
        ({"d1": 0}, {"d1": 8}, 1, "no_capacity", 503),
        ({"d1": 4}, {"d1": 8}, 9, "unsatisfiable", 400),  # more than any node has: never fits
        ({"d1": 4}, {"d1": 8}, 6, "cannot_fit_now", 429),  # more than this master's share there
    ],
)
async def test_what_the_decode_stage_would_refuse_is_refused_before_the_prefill(
    shares: dict[str, int], caps: dict[str, int], slots: int, code: str, status: int
) -> None:
    adm = make({})
    adm.set_shares(shares, caps)
    with pytest.raises(AdmissionRejected) as info:
        await adm.acquire_pass(slots, COLD)
    assert info.value.code == code and info.value.status == status
    assert adm.gate is not None and adm.gate.core.active == 0
    assert sample(adm, "pdcoord_admission_outcomes_total", **{"class": "cold", "outcome": code}) == 1


async def test_the_gate_closes_with_the_decode_capacity_and_follows_it() -> None:
    adm = make({"d1": 4}, lookahead=0.25)
    assert adm.gate is not None and adm.gate.core.capacity == 5  # 4 + ceil(1)
    held = await adm.acquire_pass(1, COLD)
    adm.set_shares({"d1": 0})
    assert adm.gate.core.capacity == 0
    with pytest.raises(AdmissionRejected) as info:
        await adm.acquire_pass(1, COLD)
    assert info.value.code == "no_capacity"
    adm.update_shares({"d1": 8})
    assert adm.gate.core.capacity == 10
    held.release()


async def test_metrics_count_each_request_once_and_show_the_decode_slots() -> None:
    adm = make({"d1": 1}, lookahead=1.0)  # gate 2
    p1 = await adm.acquire_pass(1, COLD)
    p2 = await adm.acquire_pass(1, COLD)
    waiting = asyncio.ensure_future(adm.acquire_pass(1, COLD))
    await adm.acquire_decode(p1, 1, COLD)
    decode_wait = asyncio.ensure_future(adm.acquire_decode(p2, 1, COLD))
    await settle()
    await asyncio.sleep(0.01)  # gauges are published once per loop tick
    assert sample(adm, "pdcoord_admission_outcomes_total", **{"class": "cold", "outcome": "granted"}) == 2
    assert sample(adm, "pdcoord_admission_active_slots") == 1  # the decode slots, not the passes
    assert sample(adm, "pdcoord_admission_capacity_slots") == 1
    assert sample(adm, "pdcoord_admission_queued_requests") == 2  # one at the gate, one prefilled
    assert adm.wanted_slots() == 2
    snap = adm.snapshot()
    assert snap["gate"]["capacity"] == 2 and snap["prefill_lookahead"] == 1.0
    p1.release()
    await asyncio.wait_for(decode_wait, 5)
    p3 = await asyncio.wait_for(waiting, 5)
    assert sample(adm, "pdcoord_admission_outcomes_total", **{"class": "cold", "outcome": "granted"}) == 3
    p2.release()
    p3.release()


async def test_a_prefilled_request_that_waits_too_long_times_out_with_a_clear_reason() -> None:
    adm = make({"d1": 1}, max_wait_s={CONT: 30.0, RequestClass.PROBABLE_CACHE_HIT: 15.0, COLD: 0.05})
    p1 = await adm.acquire_pass(1, COLD)
    await adm.acquire_decode(p1, 1, COLD)
    p2 = await adm.acquire_pass(1, COLD)  # the lookahead's pass: its prefill runs
    with pytest.raises(AdmissionRejected) as info:
        await asyncio.wait_for(adm.acquire_decode(p2, 1, COLD), 5)
    assert info.value.code == "timeout"
    assert sample(adm, "pdcoord_admission_outcomes_total", **{"class": "cold", "outcome": "timeout"}) == 1
    p2.release()
    p1.release()
    assert adm.core.active == 0


async def test_sessions_and_classes_live_in_the_gate() -> None:
    adm = make({"d1": 1})
    assert adm.classify("s1") is COLD
    adm.observe_output("s1")
    assert adm.classify("s1") is CONT
    gate_pass = await adm.acquire_pass(1, CONT, "s1")
    second = asyncio.ensure_future(adm.acquire_pass(1, CONT, "s1"))  # serial per session
    await settle()
    assert not second.done()
    gate_pass.release()
    (await asyncio.wait_for(second, 5)).release()


def test_make_admission_and_the_flag() -> None:
    parser = EnvArgumentParser(prog="pdmaster", env_prefix="PDMASTER")
    add_admission_flags(parser)
    policy = policy_from_args(parser.parse_args(["--prefill-lookahead", "0.25"]))
    assert policy.prefill_lookahead == 0.25
    assert isinstance(make_admission(policy), StagedAdmission)
    assert type(make_admission(policy_from_args(parser.parse_args([])))) is AdmissionController
    bypass = policy_from_args(
        parser.parse_args(["--prefill-lookahead", "0.25", "--disable-decode-capacity-limit"])
    )
    assert type(make_admission(bypass)) is AdmissionController
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill-lookahead", "1.5"])
    with pytest.raises(ValueError, match="prefill_lookahead"):
        AdmissionPolicy(prefill_lookahead=-0.1)


def test_the_master_refuses_a_lookahead_it_cannot_use() -> None:
    etcd = EtcdSettings(["127.0.0.1:2379"], "c", None, 5)
    staged = AdmissionPolicy(prefill_lookahead=0.25)
    assert (
        MasterConfig("m1", etcd, engine_protocol="vllm", admission=staged).admission.prefill_lookahead == 0.25
    )
    with pytest.raises(ConfigError, match="--prefill-lookahead needs --engine-protocol vllm"):
        MasterConfig("m1", etcd, engine_protocol="sglang", admission=staged)
    bypass = AdmissionPolicy(prefill_lookahead=0.25, bypass=True)
    with pytest.raises(ConfigError, match="--disable-decode-capacity-limit"):
        MasterConfig("m1", etcd, engine_protocol="vllm", admission=bypass)


async def test_the_gate_hears_the_decode_stage_s_wait() -> None:
    adm = make({"d1": 1}, lookahead=1.0)
    assert adm.gate is not None and adm.gate.core.later_wait_s == 0.0
    p1 = await adm.acquire_pass(1, COLD)
    first = await adm.acquire_decode(p1, 1, COLD)
    p2 = await adm.acquire_pass(1, COLD)
    second = asyncio.ensure_future(adm.acquire_decode(p2, 1, COLD))
    await asyncio.sleep(0.2)  # the prefilled request waits for the decode slot
    first.release()
    await asyncio.wait_for(second, 5)
    assert adm.gate.core.later_wait_s > 0.01  # a running mean of the decode-stage waits
    assert adm.snapshot()["decode_wait_mean_s"] == pytest.approx(adm.gate.core.later_wait_s, abs=1e-3)
    p2.release()


async def _cycles(prefill_s: float, hold_s: float, cycles: int = 4) -> StagedAdmission:
    """Eight requests at a time on a fake clock: pass, prefill_s, decode lease, hold_s, release."""
    now = [0.0]
    adm = StagedAdmission(
        AdmissionPolicy(prefill_lookahead=1.0), clock=lambda: now[0], registry=CollectorRegistry()
    )
    adm.set_shares({"d1": 8})
    for _ in range(cycles):
        passes = [await adm.acquire_pass(1, COLD) for _ in range(8)]
        now[0] += prefill_s
        leases = [await adm.acquire_decode(p, 1, COLD) for p in passes]
        now[0] += hold_s
        for lease in leases:
            lease.release()
    return adm


async def test_the_lookahead_follows_the_prefill_time_times_the_completion_rate() -> None:
    adm = make({"d1": 8}, lookahead=1.0)
    assert adm.lookahead_slots() == 8  # nothing measured yet: the flag's ceiling
    # Short prefills against long decodes: one request prefilling ahead keeps the slots busy.
    short = await _cycles(prefill_s=0.05, hold_s=0.95)
    assert short.prefill_mean_s == pytest.approx(0.05)
    assert short.lookahead_slots() == 1
    assert short.gate is not None and short.gate.core.capacity == 8 + 1
    # Prefills as long as the decodes: about half the slots' worth prefills ahead.
    even = await _cycles(prefill_s=0.5, hold_s=0.5)
    assert 3 <= even.lookahead_slots() <= 6
    # Long prefills: the ceiling (lookahead 1.0: C more).
    long = await _cycles(prefill_s=0.95, hold_s=0.05)
    assert long.lookahead_slots() == 8
    snap = long.snapshot()
    assert snap["lookahead_slots"] == 8 and snap["gate"]["capacity"] == 16
    assert snap["prefill_mean_s"] == pytest.approx(0.95)


async def test_the_room_a_two_stage_master_reports_to_peers_is_its_gate_s() -> None:
    """A peer's request is admitted at the gate (at once), so the room it reports is the gate's:
    capacity plus lookahead, not the decode stage's free slots."""
    adm = make({"d1": 2, "d2": 2}, lookahead=0.5)  # gate: one node of 6
    assert adm.free_now() == 6 and adm.core.free_now() == 2
    passes = [await adm.acquire_pass(1, COLD) for _ in range(4)]
    assert adm.free_now() == 2
    assert adm.load().free == 2 and adm.load().capacity == 6  # the load it reports is the gate's too
    for p in passes:
        p.release()
    assert adm.free_now() == 6
