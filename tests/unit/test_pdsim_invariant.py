"""pdsim's over-capacity check: a decode request held (running or waiting for a batch slot with its KV
in) beyond ``running_max_req_size`` is counted in ``pdsim_over_capacity_total`` and the peak shows in
``pdsim_held_high_water``, in the legacy slot pool and in model mode, and on /metrics."""

from __future__ import annotations

import asyncio
import re

import aiohttp
from aiohttp.test_utils import TestServer

from pdsim.engine_model import EngineModel, ModelConfig, ModelRequest, Phase, StepCost
from pdsim.profiles import PROFILES
from pdsim.server import Config, Engine, ModelMode, Timing, build_app
from pdsim.slots import SlotPool

# ---- legacy slot pool ------------------------------------------------------------------------


async def test_pool_within_capacity_counts_nothing() -> None:
    pool = SlotPool(3)
    await pool.acquire(2)
    await pool.acquire(1)
    pool.release(1)
    await pool.acquire(1)
    assert pool.over_capacity_total == 0
    assert pool.held_high_water == 3
    assert pool.max_running == 3


async def test_pool_counts_a_request_held_beyond_capacity() -> None:
    pool = SlotPool(2)
    await pool.acquire(2)
    # The engine never runs a third sequence: it waits inside the engine, which is what the check sees.
    third = asyncio.create_task(pool.acquire(1))
    await asyncio.sleep(0)
    assert pool.running == 2 and pool.waiting_slots == 1
    assert pool.over_capacity_total == 1
    assert pool.held_high_water == 3
    gang = asyncio.create_task(pool.acquire(2))  # a gang of 2 beyond it: one more request counted
    await asyncio.sleep(0)
    assert pool.over_capacity_total == 2
    assert pool.held_high_water == 5
    pool.release(2)  # the third runs; the gang still waits (1 + 2 > 2)
    await third
    assert pool.running == 1 and pool.max_running == 2
    pool.release(1)
    await gang
    pool.release(2)
    assert pool.over_capacity_total == 2  # releases and grants are not new arrivals
    assert pool.max_running == 2


async def test_pool_ignores_a_cancelled_waiter_still_in_the_queue() -> None:
    pool = SlotPool(2)
    await pool.acquire(1)
    await pool.acquire(1)
    gone = asyncio.create_task(pool.acquire(1))
    await asyncio.sleep(0)
    assert pool.over_capacity_total == 1
    pool.release(1)  # grants `gone`...
    gone.cancel()  # ...whose client went away in the same tick: its slot comes back
    await asyncio.gather(gone, return_exceptions=True)
    assert pool.running == 1
    # A waiter cancelled but not yet run does not make the next arrival an overshoot.
    late = asyncio.create_task(pool.acquire(1))
    await asyncio.sleep(0)
    await late
    assert pool.over_capacity_total == 1
    blocked = asyncio.create_task(pool.acquire(1))
    await asyncio.sleep(0)
    assert pool.over_capacity_total == 2  # 2 running + this one
    blocked.cancel()
    arrival = asyncio.create_task(pool.acquire(1))  # same tick as the cancel: not counted again
    assert pool.over_capacity_total == 2
    arrival.cancel()
    await asyncio.gather(blocked, arrival, return_exceptions=True)


async def test_prefill_pool_is_not_checked() -> None:
    pool = SlotPool(1, check_capacity=False)
    await pool.acquire(1)
    waiter = asyncio.create_task(pool.acquire(1))
    await asyncio.sleep(0)
    assert pool.over_capacity_total == 0
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)


# ---- model mode (the pure scheduler) ---------------------------------------------------------


def _model(role: str = "decode", cap: int = 2) -> EngineModel:
    return EngineModel(
        ModelConfig(
            role="decode" if role == "decode" else "prefill",
            policy="sglang",
            cost=StepCost(0.005, 1e-5, 1e-3),
            max_total_tokens=100_000,
            max_running_seqs=cap,
            max_prefill_tokens=16384,
            max_queued_requests=None,
        )
    )


def _req(rid: int, *, n: int = 1, pd: bool = False) -> ModelRequest:
    return ModelRequest(
        rid=rid,
        seqs=n,
        prompt_tokens=10,
        prompt_kv=10 * n,
        prefill_tokens=0 if pd else 10,
        max_new_tokens=5,
        pd=pd,
    )


def _drain(m: EngineModel) -> None:
    while m.plan_step() is not None:
        m.finish_step()


def test_model_counts_arrivals_beyond_the_batch_cap() -> None:
    m = _model(cap=2)
    m.add(_req(1))
    m.add(_req(2))
    assert m.over_capacity_total == 0
    m.add(_req(3))
    assert m.over_capacity_total == 1 and m.held_high_water == 3
    m.plan_step()
    assert m.running_seqs == 2  # the engine itself never runs beyond the cap
    m.finish_step()
    _drain(m)
    assert m.max_running == 2 and m.over_capacity_total == 1


def test_model_pd_requests_are_held_once_their_kv_is_in() -> None:
    m = _model(cap=2)
    for rid in (1, 2, 3):
        m.add(_req(rid, pd=True))
    assert m.plan_step() is None  # preallocation only (SGLang lets up to 3 x cap preallocate)
    assert m.seqs(Phase.TRANSFER) == 3
    assert m.over_capacity_total == 0  # prealloc and transfer do not count
    m.transferred(1)
    m.transferred(2)
    assert m.over_capacity_total == 0
    m.transferred(3)
    assert m.over_capacity_total == 1 and m.held_high_water == 3


def test_model_retraction_is_not_a_new_arrival() -> None:
    # A pool so small that the running requests get retracted; they stay held, nothing is counted.
    m = EngineModel(
        ModelConfig(
            role="decode",
            policy="vllm",
            cost=StepCost(0.005, 1e-5, 1e-3),
            max_total_tokens=30,
            max_running_seqs=2,
            max_prefill_tokens=16384,
            max_queued_requests=None,
        )
    )
    m.add(ModelRequest(rid=1, seqs=1, prompt_tokens=10, prompt_kv=10, prefill_tokens=10, max_new_tokens=15))
    m.add(ModelRequest(rid=2, seqs=1, prompt_tokens=10, prompt_kv=10, prefill_tokens=10, max_new_tokens=15))
    _drain(m)
    assert m.preemptions > 0
    assert m.over_capacity_total == 0


def test_model_prefill_server_is_not_checked() -> None:
    m = _model(role="prefill", cap=1)
    m.add(_req(1))
    m.add(_req(2))
    assert m.over_capacity_total == 0


# ---- a real server: /metrics -----------------------------------------------------------------


def _config(cap: int, *, model_mode: ModelMode | None = None) -> Config:
    return Config(
        role="decode",
        host="127.0.0.1",
        advertise_host="127.0.0.1",
        model="pdsim-model",
        running_max_req_size=cap,
        max_n=64,
        context_length=32768,
        default_max_tokens=16,
        max_total_tokens=cap * 1024 if model_mode is None else 100_000,
        cache_blocks=8192,
        cache_block_tokens=16,
        prefill_parallel=1,
        kv_wait_timeout_s=5.0,
        kv_ttl_s=60.0,
        max_body_bytes=1 << 20,
        timing=Timing(1.0, 0.01, 20.0, 0.01),  # 20 ms per token: 10 tokens last 0.2 s
        model_mode=model_mode,
    )


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} not on /metrics"
    return float(found.group(1))


async def _over_admit(cfg: Config, requests: int) -> tuple[float, float, float, float]:
    engine = Engine(cfg)
    await engine.start()
    server = TestServer(build_app(engine), handler_cancellation=True)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            url = str(server.make_url("/generate"))

            async def one() -> int:
                body = {"text": "hello", "sampling_params": {"max_new_tokens": 10}}
                async with http.post(url, json=body) as r:
                    await r.read()
                    return r.status

            statuses = await asyncio.gather(*(one() for _ in range(requests)))
            assert statuses == [200] * requests
            async with http.get(str(server.make_url("/metrics"))) as r:
                text = await r.text()
    finally:
        await server.close()
        await engine.close()
    return (
        _metric(text, "pdsim_over_capacity_total"),
        _metric(text, "pdsim_held_high_water"),
        _metric(text, "pdsim_max_running"),
        _metric(text, "pdsim_capacity"),
    )


async def test_metrics_legacy_mode() -> None:
    over, high, max_running, cap = await _over_admit(_config(2), 2)
    assert (over, high, max_running, cap) == (0, 2, 2, 2)
    over, high, max_running, cap = await _over_admit(_config(2), 5)
    assert over == 3  # the 3rd, 4th and 5th arrived beyond 2
    assert high == 5
    assert max_running == 2  # pdsim queued them: nothing ran beyond the cap


async def test_metrics_model_mode() -> None:
    mm = ModelMode(profile=PROFILES["llama3-8b-h100"], time_scale=4.0)
    over, high, max_running, cap = await _over_admit(_config(2, model_mode=mm), 2)
    assert (over, high, max_running, cap) == (0, 2, 2, 2)
    over, high, max_running, cap = await _over_admit(_config(2, model_mode=mm), 4)
    assert over == 2 and high == 4 and max_running == 2
