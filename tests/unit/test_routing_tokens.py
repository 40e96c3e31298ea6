"""Prefill in tokens (DESIGN §13): the prefill node where the request's first token comes earliest,
from each node's backlog (this master's and its engine's report) and the prompt's uncached part."""

from __future__ import annotations

from pdcoord.load import EngineLoad
from pdmaster.registry import DECODE, PREFILL
from pdmaster.routing import EarliestFirstToken, Router, earliest
from tests.unit.test_routing import PROMPT, registry_with


def test_earliest_takes_the_fewest_tokens_ahead_and_rotates_ties() -> None:
    assert earliest(["a", "b", "c"], [5, 3, 4]) == "b"
    assert {earliest(["a", "b", "c"], [1, 1, 4], k) for k in range(4)} == {"a", "b"}


def test_a_cache_hit_counts_as_the_tokens_it_saves() -> None:
    reg, _ = registry_with(("p1", PREFILL), ("p2", PREFILL), ("d1", DECODE))
    router = Router(reg, EarliestFirstToken())
    hashes, est = router.estimate(PROMPT)
    router.routed(reg.nodes["p1"], hashes, 100)  # p1 now caches the prompt and has 100 tokens queued
    _, est = router.estimate(PROMPT)
    p1, p2 = reg.nodes["p1"], reg.nodes["p2"]
    assert router.uncached(p1, est, 1000) == 0 and router.uncached(p2, est, 1000) == 1000
    assert router.tokens_ahead(p1, est, 1000) == 100
    assert router.prefill(est, prompt_tokens=1000) is p1  # 100 ahead against 1000
    assert router.least_ahead(est, 1000) == (100, 0)
    # once its backlog outweighs the hit, the idle node wins
    router.routed(p1, hashes, 2000)
    assert router.prefill(est, prompt_tokens=1000) is p2
    router.prefill_tokens_done("p1", 2100)
    assert router.backlog(p1) == 0 and "p1" not in router.prefill_tokens
    assert router.prefill(est, prompt_tokens=1000) is p1
    assert router.prefill(est, exclude={"p1"}, prompt_tokens=1000) is p2


def test_the_engines_word_on_its_backlog_counts_every_masters_prompts() -> None:
    reg, streams = registry_with(("p1", PREFILL), ("p2", PREFILL), ("d1", DECODE))
    router = Router(reg, EarliestFirstToken())
    _, est = router.estimate("an uncached prompt")
    p1 = reg.nodes["p1"]
    # another master filled p1: its engine says so through the agent
    reg.report_load("p1", streams["p1"], EngineLoad(probe_ok=True, prefill_backlog_tokens=5000))
    assert router.backlog(p1) == 5000
    assert router.prefill(est, prompt_tokens=10) is reg.nodes["p2"]
    # this master's own count is exact for its part: the larger of the two stands
    router.routed(p1, [], 7000)
    assert router.backlog(p1) == 7000
    # a stale sample says nothing
    reg.report_load("p1", streams["p1"], EngineLoad(probe_ok=False, prefill_backlog_tokens=99_999))
    assert router.backlog(p1) == 7000
