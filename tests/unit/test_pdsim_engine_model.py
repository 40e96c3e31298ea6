"""The model-mode engine scheduler (pure): step times, chunked prefill, KV admission, retraction,
preemption, queue cap, cancellation, PD preallocation."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from pdsim.batch_runner import BatchRunner
from pdsim.engine_model import (
    EngineModel,
    ModelConfig,
    ModelRequest,
    Phase,
    Policy,
    QueueFull,
    Role,
    StepCost,
    StepEvents,
)
from pdsim.profiles import PROFILES, transfer_time_s

COST = StepCost(base_s=0.005, per_prefill_token_s=1e-5, per_decode_seq_s=1e-3)


def model(
    *,
    role: Role = "decode",
    policy: Policy = "sglang",
    kv: int = 100_000,
    cap: int = 8,
    max_prefill: int = 16384,
    max_queued: int | None = None,
    init_ratio: float = 0.7,
    priority: bool = False,
    low_first: bool = False,
    reserved: int = 512,
) -> EngineModel:
    return EngineModel(
        ModelConfig(
            role=role,
            policy=policy,
            cost=COST,
            max_total_tokens=kv,
            max_running_seqs=cap,
            max_prefill_tokens=max_prefill,
            max_queued_requests=max_queued,
            init_new_token_ratio=init_ratio,
            priority_scheduling=priority,
            low_priority_first=low_first,
            num_reserved_decode_tokens=reserved,
        )
    )


def req(
    rid: Hashable,
    prompt: int = 10,
    max_new: int = 5,
    *,
    n: int = 1,
    pd: bool = False,
    uncached: int | None = None,
    priority: int = 0,
) -> ModelRequest:
    return ModelRequest(
        rid=rid,
        seqs=n,
        prompt_tokens=prompt,
        prompt_kv=n * prompt,
        prefill_tokens=0 if pd else (prompt if uncached is None else uncached),
        max_new_tokens=max_new,
        pd=pd,
        priority=priority,
    )


def step(m: EngineModel) -> tuple[float | None, StepEvents]:
    d = m.plan_step()
    pre = m.take_events()
    if d is None:
        return None, pre
    ev = m.finish_step()
    ev.allocated[:0] = pre.allocated
    ev.retracted[:0] = pre.retracted
    return d, ev


def run_until_idle(m: EngineModel, limit: int = 10_000) -> list[StepEvents]:
    out: list[StepEvents] = []
    for _ in range(limit):
        d, ev = step(m)
        if d is None:
            return out
        out.append(ev)
    raise AssertionError("engine never went idle")


def test_decode_step_time_is_base_plus_per_sequence() -> None:
    m = model()
    # PD requests need no prefill: every step is a pure decode step.
    for i in range(3):
        m.add(req(i, pd=True))
    m.plan_step()
    assert set(m.take_events().allocated) == {0, 1, 2}
    assert m.plan_step() is None  # nothing runs while the KV is in transfer
    for i in range(3):
        m.transferred(i)
    d = m.plan_step()
    assert d == pytest.approx(COST.base_s + 3 * COST.per_decode_seq_s)
    ev = m.finish_step()
    assert ev.tokens == {0: 1, 1: 1, 2: 1}


def test_step_time_grows_with_batch_and_profile_numbers() -> None:
    p = PROFILES["llama3-8b-h100"]
    cost = StepCost(p.step_base_s, p.per_prefill_token_s, p.per_decode_seq_s)
    assert cost.duration(0, 1) == pytest.approx(5.7587e-3)
    assert cost.duration(0, 256) == pytest.approx(5.7527e-3 + 256 * 6e-6)
    assert cost.duration(2048, 0) == pytest.approx(5.7527e-3 + 2048 * 17.25e-6)  # ~41 ms, as the note says
    assert p.kv_bytes_per_token == 128 * 1024
    assert p.default_max_total_tokens == int((80e9 * 0.9 - 16e9) // (128 * 1024))
    p70 = PROFILES["llama3-70b-h100-tp4"]
    assert p70.kv_bytes_per_token == 320 * 1024
    assert p70.default_max_total_tokens == int((320e9 * 0.9 - 140e9) // (320 * 1024))


def test_core_returns_unscaled_engine_time() -> None:
    # The time scale is the adapter's business: the core's durations are the profile's own.
    m = model()
    m.add(req("a", prompt=100, max_new=1))
    assert m.plan_step() == pytest.approx(COST.base_s + 100 * COST.per_prefill_token_s)


def test_adapter_scales_engine_time() -> None:
    # --time-scale K (and the slow fault) stretch every engine second into K wall seconds.
    runner = BatchRunner(model(), time_scale=4.0, slow=lambda: 1.5)
    assert runner.engine_time(0.01) == pytest.approx(0.06)
    with pytest.raises(ValueError):
        BatchRunner(model(), time_scale=0.0, slow=lambda: 1.0)


def test_transfer_time() -> None:
    # 4096 tokens of 8B KV (0.54 GB) at 25 GB/s: 21.5 ms (research note §3), plus the 1 ms bootstrap.
    assert transfer_time_s(4096, 128 * 1024, 25.0, 0.001) == pytest.approx(0.001 + 0.02147, abs=1e-4)


def test_chunked_prefill_splits_by_max_prefill_tokens() -> None:
    m = model(role="prefill", max_prefill=1000)
    m.add(req("a", prompt=2500))
    m.add(req("b", prompt=300))
    durations, prefilled = [], []
    for ev in iter(lambda: step(m), (None, StepEvents())):
        durations.append(ev[0])
        prefilled.extend(ev[1].prefilled)
    toks = [round(((d or 0.0) - COST.base_s) / COST.per_prefill_token_s) for d in durations]
    assert toks == [1000, 1000, 800]  # a: 1000, 1000, 500 + b: 300 in the same step
    assert prefilled == ["a", "b"]
    assert m.kv_used == 0


def test_prefill_uses_uncached_tokens_only() -> None:
    m = model(role="prefill")
    m.add(req("a", prompt=1000, uncached=200))
    assert m.plan_step() == pytest.approx(COST.base_s + 200 * COST.per_prefill_token_s)
    assert m.finish_step().prefilled == ["a"]
    m.add(req("b", prompt=1000, uncached=0))  # fully cached: the last token is still computed
    assert m.plan_step() == pytest.approx(COST.base_s + COST.per_prefill_token_s)


def test_local_request_on_decode_prefills_then_decodes_in_mixed_steps() -> None:
    m = model(max_prefill=64)
    m.add(req("a", prompt=100, max_new=3))
    events = run_until_idle(m)
    # 64 + 36 prefill tokens (the first token comes with the last chunk), then two decode steps.
    assert [e.tokens.get("a") for e in events] == [None, 1, 2, 3]
    assert events[-1].finished == ["a"]
    assert m.kv_used == 0 and m.running_seqs == 0


def test_n_samples_are_n_sequences() -> None:
    m = model()
    m.add(req("a", prompt=10, max_new=2, n=3, pd=True))
    m.plan_step()
    m.take_events()
    assert m.kv_used == 30  # the prompt's KV once per sample
    m.transferred("a")
    d = m.plan_step()
    assert d == pytest.approx(COST.base_s + 3 * COST.per_decode_seq_s)
    assert m.running_seqs == 3


def test_batch_cap_and_queued_count() -> None:
    m = model(cap=2)
    for i in range(3):
        m.add(req(i, pd=True))
    m.plan_step()
    # SGLang preallocates up to 3x the cap when the cap is <= 32: all three get KV.
    assert m.take_events().allocated == [0, 1, 2]
    for i in range(3):
        m.transferred(i)
    m.plan_step()
    assert m.running_seqs == 2 and m.waiting_seqs == 1
    assert m.queued_total == 1  # only the one left waiting for batch room
    m.finish_step()


def test_never_waiting_requests_are_not_queued() -> None:
    m = model(cap=4)
    for i in range(4):
        m.add(req(i, prompt=10, max_new=3))
        step(m)
    run_until_idle(m)
    assert m.queued_total == 0 and m.max_running <= 4


def test_queue_cap_refuses_new_arrivals() -> None:
    m = model(cap=1, max_queued=2)
    m.add(req("a"))
    m.add(req("b"))
    with pytest.raises(QueueFull, match=r"The request queue is full\."):
        m.add(req("c"))
    m.plan_step()  # a is admitted: one waiting left, room for one more
    m.add(req("c"))
    with pytest.raises(QueueFull):
        m.add(req("d"))
    assert m.get("d") is None


def test_cancel_frees_kv_and_slot_at_once() -> None:
    m = model(cap=1)
    m.add(req("a", prompt=50, max_new=100))
    m.add(req("b", prompt=20, max_new=3))
    step(m)
    assert m.kv_used == 50 and m.running_seqs == 1
    d = m.plan_step()
    assert d is not None
    assert m.cancel("a")
    assert m.kv_used == 0 and m.running_seqs == 0
    ev = m.finish_step()
    assert "a" not in ev.tokens  # cancelled mid-step: nothing more for it
    assert not m.cancel("a")
    step(m)
    assert m.running_seqs == 1 and m.kv_used == 20
    assert m.cancel("b") and m.kv_used == 0
    # Cancelling a queued or preallocated request frees its KV too.
    m.add(req("p", prompt=30, pd=True))
    m.plan_step()
    assert m.take_events().allocated == ["p"] and m.kv_used == 30
    assert m.cancel("p") and m.kv_used == 0
    assert m.seqs(Phase.TRANSFER) == 0


def test_sglang_admission_reserves_for_running_requests() -> None:
    # 1000 tokens of KV; a runs with 500 future tokens, reserved at ratio 0.7 = 350.
    m = model(kv=1000)
    m.add(req("a", prompt=100, max_new=500))
    step(m)
    assert m.running_seqs == 1 and m.kv_used == 100
    # b needs 100 input + 500 future = 600 > 1000 - 100 (a's KV) - 499 x 0.7 (a's reserve): it waits.
    m.add(req("b", prompt=100, max_new=500))
    step(m)
    assert m.get("b") is not None and m.get("b").phase is Phase.WAITING  # type: ignore[union-attr]
    # A vLLM engine admits it at once: only its own input must fit.
    v = model(kv=1000, policy="vllm")
    v.add(req("a", prompt=100, max_new=500))
    step(v)
    v.add(req("b", prompt=100, max_new=500))
    step(v)
    assert v.running_seqs == 2


def test_new_token_ratio_decays_linearly_to_its_floor_and_resets_when_idle() -> None:
    m = model()
    m.add(req("a", prompt=1, max_new=1000, pd=True))
    m.plan_step()
    m.take_events()
    m.transferred("a")
    ratios = []
    for _ in range(700):
        m.plan_step()
        m.finish_step()
        ratios.append(m.new_token_ratio)
    decay = (0.7 - 0.7 * 0.14) / 600
    assert ratios[0] == pytest.approx(0.7 - decay)
    assert ratios[299] == pytest.approx(0.7 - 300 * decay)
    assert ratios[650] == pytest.approx(0.7 * 0.14)
    m.cancel("a")
    assert m.plan_step() is None
    assert m.new_token_ratio == pytest.approx(0.7)


def _fill(m: EngineModel, specs: list[tuple[str, int, int]], steps_each: dict[str, int]) -> None:
    """Start requests (rid, prompt, max_new) as PD arrivals and decode each for its number of steps."""
    for rid, prompt, max_new in specs:
        m.add(req(rid, prompt=prompt, max_new=max_new, pd=True))
    m.plan_step()
    m.take_events()
    # Stagger: each request joins once the previous ones have made their steps.
    order = sorted(specs, key=lambda s: -steps_each[s[0]])
    done_steps = 0
    for i, (rid, _, _) in enumerate(order):
        m.transferred(rid)
        nxt = steps_each[order[i + 1][0]] if i + 1 < len(order) else 0
        for _ in range(steps_each[rid] - nxt):
            m.plan_step()
            m.finish_step()
            done_steps += 1


def test_sglang_retracts_fewest_output_then_longest_input_and_recomputes() -> None:
    # No reserve (ratio 0, no reserved decode tokens) so that everything gets in and the pool runs out.
    m = model(kv=700, cap=8, init_ratio=0.0, reserved=0)
    specs = [("old", 100, 150), ("mid_short", 100, 150), ("mid_long", 200, 150), ("new", 100, 150)]
    _fill(m, specs, {"old": 60, "mid_short": 30, "mid_long": 30, "new": 10})
    # Generated tokens so far: old 60, mid_short 30, mid_long 30, new 10 (KV = prompt + generated - 1).
    assert m.get("new").generated == 10  # type: ignore[union-attr]
    retracted: list[Hashable] = []
    for _ in range(100):
        d = m.plan_step()
        retracted.extend(m.take_events().retracted)
        if d is not None:
            m.finish_step()
        if len(retracted) >= 2:
            break
    # Fewest output first (new), then among equal outputs the longest input (mid_long before mid_short).
    assert retracted[:2] == ["new", "mid_long"]
    assert m.retracted_requests == len(retracted)
    assert m.retracted_input_tokens >= 100 + 200
    assert m.retracted_output_tokens >= 10 + 30
    r = m.get("new")
    assert r is not None and r.phase is Phase.WAITING and r.kv == 0
    # Readmitted, it prefills its input and the tokens it had generated again.
    assert r.prefill_tokens == 100 + r.generated
    assert m.new_token_ratio > 0.0
    run_until_idle(m)
    assert m.recomputed_tokens >= 100 + 10 + 200 + 30
    assert m.kv_used == 0 and m.running_seqs == 0


def test_retraction_frees_enough_for_twenty_steps_and_raises_the_ratio() -> None:
    m = model(kv=250, cap=8, init_ratio=0.0, reserved=0)
    specs = [(f"r{i}", 10, 100) for i in range(4)]
    _fill(m, specs, {"r0": 40, "r1": 39, "r2": 38, "r3": 37})
    # KV: 4 x 10 prompt + 39 + 38 + 37 + 36 = 190; next steps need 4 tokens each until 250.
    while not m.retracted_requests:
        m.plan_step()
        m.take_events()
        m.finish_step()
    # Measured before this step's own tokens (one per running sequence) were allocated.
    free, running = m.free_kv + m.running_seqs, m.running_seqs
    assert free >= 20 * running or running == 1
    rest = [m.get(f"r{i}") for i in range(4)]
    live = [r for r in rest if r is not None and r.phase is Phase.RUNNING]
    # The ratio was set at the retraction, one token before the step that followed it.
    decoded = sum(r.generated - 1 for r in live)
    expected = min(1.0, (decoded + 20 * len(live)) / sum(r.max_new_tokens for r in live))
    assert m.new_token_ratio == pytest.approx(expected)
    assert m.retracted_output_tokens > 0


def _until_displaced(m: EngineModel) -> list[Hashable]:
    """Step until a step retracts or preempts; the requests it displaced."""
    displaced: list[Hashable] = []
    while not displaced:
        d = m.plan_step()
        displaced.extend(m.take_events().retracted)
        if d is not None:
            m.finish_step()
    return displaced


def test_vllm_preempts_newest_first_by_recompute() -> None:
    m = model(kv=260, cap=8, policy="vllm")
    specs = [("a", 50, 200), ("b", 50, 200), ("c", 50, 200)]
    _fill(m, specs, {"a": 30, "b": 20, "c": 10})
    preempted = _until_displaced(m)
    assert preempted == ["c"]  # the last admitted
    assert m.preemptions == 1 and m.retracted_requests == 0
    c = m.get("c")
    assert c is not None and c.phase is Phase.WAITING and c.computed == 0
    assert c.prefill_tokens == 50 + c.generated


def test_prealloc_waits_for_kv_then_transfer_then_runs() -> None:
    m = model(kv=300, cap=8, reserved=50)
    m.add(req("big", prompt=200, max_new=10, pd=True))
    m.plan_step()
    assert m.take_events().allocated == ["big"]
    # The second does not fit next to the first's KV and reserve: it stays in the prealloc queue.
    m.add(req("next", prompt=100, max_new=10, pd=True))
    m.plan_step()
    assert m.take_events().allocated == []
    assert m.seqs(Phase.PREALLOC) == 1 and m.seqs(Phase.TRANSFER) == 1
    assert m.queued_total == 1 and m.max_waiting == 2
    m.transferred("big")
    allocated: list[Hashable] = []
    for _ in range(20):
        d = m.plan_step()
        allocated.extend(m.take_events().allocated)
        if d is None:
            break
        m.finish_step()
    assert allocated == ["next"]  # only once big finished and freed its KV


def test_vllm_prealloc_has_no_reserve_and_no_slot_bound() -> None:
    m = model(kv=300, cap=1, policy="vllm")
    for i in range(3):
        m.add(req(i, prompt=100, max_new=50, pd=True))
    m.plan_step()
    assert m.take_events().allocated == [0, 1, 2]


def test_requests_that_can_never_fit_are_refused() -> None:
    m = model(kv=100, cap=2)
    assert not m.fits(50, 1, 60)
    with pytest.raises(ValueError):
        m.add(req("a", prompt=50, max_new=60))
    with pytest.raises(ValueError):
        m.add(req("b", n=3))
    with pytest.raises(ValueError):
        m.add(req("c"))
        m.add(req("c"))


def test_many_steps_keep_the_books_balanced() -> None:
    policies: tuple[Policy, ...] = ("sglang", "vllm")
    for policy in policies:
        m = model(kv=2000, cap=6, policy=policy, max_prefill=128)
        for i in range(40):
            m.add(req(i, prompt=50 + 7 * i % 90, max_new=20 + 13 * i % 60, n=1 + i % 2, pd=i % 3 == 0))
        finished: set[Hashable] = set()
        tokens: dict[Hashable, int] = {}
        for _ in range(5000):
            d = m.plan_step()
            pre = m.take_events()
            for rid in pre.allocated:
                m.transferred(rid)
            if d is None:
                if m.pending_seqs == m.seqs(Phase.TRANSFER) == m.running_seqs == 0:
                    break
                continue
            ev = m.finish_step()
            for rid, k in ev.tokens.items():
                assert k == tokens.get(rid, 0) + 1  # one token per step, none repeated after a recompute
                tokens[rid] = k
            finished.update(ev.finished)
            assert 0 <= m.kv_used <= 2000
            assert m.running_seqs <= 6
        assert finished == set(range(40)), policy
        assert m.kv_used == 0 and m.pending_seqs == 0


def _prefill_order(m: EngineModel) -> list[Hashable]:
    done: list[Hashable] = []
    for _, ev in iter(lambda: step(m), (None, StepEvents())):
        done.extend(ev.prefilled)
    return done


def test_prefill_without_priority_scheduling_is_first_come_first_served() -> None:
    m = model(role="prefill", max_prefill=1000, cap=1)
    m.add(req("cold", prompt=3000, priority=0))
    m.add(req("cold2", prompt=3000, priority=0))
    m.add(req("cont", prompt=3000, priority=5))
    assert _prefill_order(m) == ["cold", "cold2", "cont"]


def test_priority_scheduling_serves_higher_values_first_then_arrival() -> None:
    # cap 1: one prefill at a time, the rest wait (SGLang's waiting queue, sorted every step).
    m = model(role="prefill", max_prefill=1000, cap=1, priority=True)
    m.add(req("cold", prompt=3000, priority=0))
    step(m)  # "cold" is under way: it is not displaced by what comes later
    m.add(req("cold2", prompt=3000, priority=0))
    m.add(req("hit", prompt=3000, priority=1))
    m.add(req("cont", prompt=3000, priority=2))
    m.add(req("cont2", prompt=3000, priority=2))
    assert _prefill_order(m) == ["cold", "cont", "cont2", "hit", "cold2"]


def test_priority_scheduling_orders_the_chunks_of_admitted_prefills() -> None:
    # A prefill engine admits several prompts at once; a step's chunk budget goes to the prefill
    # under way first (SGLang continues its chunked request), then by priority, not by arrival.
    m = model(role="prefill", max_prefill=1000, cap=8, priority=True)
    m.add(req("a", prompt=1500, priority=0))
    m.add(req("b", prompt=1500, priority=0))
    _, ev = step(m)  # 1000 of a's tokens
    m.add(req("c", prompt=400, priority=3))
    m.add(req("d", prompt=400, priority=3))
    _, ev = step(m)  # a's last 500, then c and d before b
    assert ev.prefilled == ["a", "c"]
    assert _prefill_order(m) == ["d", "b"]


def test_low_priority_values_first_reverses_the_order() -> None:
    m = model(role="prefill", max_prefill=1000, cap=1, priority=True, low_first=True)
    m.add(req("x", prompt=10, priority=0))
    m.add(req("late", prompt=10, priority=3))
    m.add(req("early", prompt=10, priority=-1))
    assert _prefill_order(m) == ["early", "x", "late"]


def test_vllm_priority_preempts_the_lowest_priority_then_newest() -> None:
    m = model(kv=260, cap=8, policy="vllm", priority=True, low_first=True)
    for rid, prio in (("a", 1), ("b", 0), ("c", 0)):
        m.add(req(rid, prompt=50, max_new=200, pd=True, priority=prio))
    m.plan_step()
    m.take_events()
    for rid in ("a", "b", "c"):
        m.transferred(rid)
    preempted = _until_displaced(m)
    assert preempted == ["a"]  # the lowest priority (vLLM: the highest value), though not the newest


def test_an_answer_ends_at_its_own_length_but_admission_reserves_max_tokens() -> None:
    # SGLang's admission: input + clipped max_new_tokens must fit beside the reserve. The pool holds
    # one request asking 100 tokens at a time even though each answer is only 5 tokens long.
    m = model(kv=150, cap=8, init_ratio=1.0)
    m.add(ModelRequest("a", 1, 10, 10, 10, 100, answer_tokens=5))
    m.add(ModelRequest("b", 1, 10, 10, 10, 100, answer_tokens=5))
    m.plan_step()
    assert m.running_seqs == 1  # b waits: 10 + 100 does not fit beside a's 10 + 100 x 1.0
    m.finish_step()
    finished: list[Hashable] = []
    for _ in range(40):
        if m.plan_step() is None:
            break
        ev = m.finish_step()
        finished += ev.finished
    assert finished == ["a", "b"]
    assert m.queued_total == 1 and m.kv_used == 0


def test_answer_longer_than_max_tokens_stops_at_max_tokens() -> None:
    m = model()
    m.add(ModelRequest("a", 1, 10, 10, 10, 3, answer_tokens=50))
    run_until_idle(m)
    assert m.steps == 3


def test_sglang_prealloc_keeps_reserved_decode_tokens_per_active_request() -> None:
    # SGLang decode.py: a prealloc needs prompt + 512 within free KV less 512 per active request.
    m = model(kv=2000, cap=8)
    m.add(req("a", prompt=400, max_new=10, pd=True))  # 400 + 512 <= 2000
    m.add(req("b", prompt=400, max_new=10, pd=True))  # 400 + 512 <= 2000 - 400 - 512 x 1
    m.add(req("c", prompt=100, max_new=10, pd=True))  # 100 + 512 > 1200 - 512 x 2
    m.plan_step()
    assert m.take_events().allocated == ["a", "b"]
    assert m.kv_used == 800  # the prompts only: the answers' KV grows step by step
    assert m.seqs(Phase.PREALLOC) == 1


def test_sglang_prealloc_needs_room_for_its_own_max_new_tokens() -> None:
    # SGLang decode.py: prompt + min(max_new_tokens, 4096) less what the running requests could give
    # back must fit; a request in transfer gives nothing back.
    for max_new, allocated in ((450, []), (350, ["b"])):
        m = model(kv=1000, cap=8, reserved=0)
        m.add(req("a", prompt=500, max_new=10, pd=True))
        m.plan_step()
        assert m.take_events().allocated == ["a"]
        m.add(req("b", prompt=100, max_new=max_new, pd=True))
        m.plan_step()
        assert m.take_events().allocated == allocated, max_new


def test_engine_default_max_running_requests() -> None:
    from pdsim.profiles import engine_default_max_running, vllm_pool_tokens

    p8 = PROFILES["llama3-8b-h100"]
    pool = p8.default_max_total_tokens
    # SGLang: min(pool // 2, clamp(pool / context x 512, 2048, 4096)).
    assert engine_default_max_running("sglang", p8, pool, 131072) == 2048
    assert engine_default_max_running("sglang", p8, pool, 32768) == 4096
    assert engine_default_max_running("sglang", p8, 3000, 131072) == 1500
    # vLLM on an H100 (>= 70 GiB, not an A100): max_num_seqs 1024.
    assert engine_default_max_running("vllm", p8, pool, 131072) == 1024
    assert vllm_pool_tokens(pool) % 16 == 0 and pool - vllm_pool_tokens(pool) < 16
