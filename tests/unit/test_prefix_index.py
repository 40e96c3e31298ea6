"""The prefix index core against a naive model, plus the cache-aware prefill selection rule."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdmaster.prefix_index import PrefixEstimate, PrefixIndex
from pdmaster.routing import choose_prefill

NODES = ["p0", "p1", "p2"]
# Short blocks over a tiny alphabet so that shared prefixes, repeats and evictions are common.
prompts = st.text(alphabet="ab", min_size=0, max_size=24)
token_prompts = st.lists(st.integers(min_value=0, max_value=2), max_size=12)


class NaiveIndex:
    """Per node a recency-ordered list of keys; the same record order as the real index."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.keys: dict[str, list[int]] = {}

    def record(self, node: str, hashes: list[int]) -> None:
        lst = self.keys.setdefault(node, [])
        for key in reversed(hashes):
            if key in lst:
                lst.remove(key)
            lst.append(key)
        del lst[: max(0, len(lst) - self.max_entries)]

    def remove(self, node: str) -> None:
        self.keys.pop(node, None)

    def match(self, hashes: list[int]) -> dict[str, int]:
        out = {}
        for node, lst in self.keys.items():
            k = 0
            while k < len(hashes) and hashes[k] in lst:
                k += 1
            if k:
                out[node] = k
        return out


ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.sampled_from(NODES), st.one_of(prompts, token_prompts)),
        st.tuples(st.just("remove"), st.sampled_from(NODES), st.just("")),
        st.tuples(st.just("match"), st.just(""), st.one_of(prompts, token_prompts)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, max_entries=st.integers(min_value=1, max_value=8))
def test_match_agrees_with_naive_model_and_memory_is_bounded(
    ops: list[tuple[str, str, str | list[int]]], max_entries: int
) -> None:
    index: PrefixIndex[str] = PrefixIndex(block_chars=4, block_tokens=2, max_entries_per_node=max_entries)
    naive = NaiveIndex(max_entries)
    for op, node, prompt in ops:
        if op == "record":
            h = index.hashes(prompt)
            index.record(node, h)
            naive.record(node, h)
        elif op == "remove":
            index.remove_node(node)
            naive.remove(node)
        else:
            h = index.hashes(prompt)
            assert index.match(h) == naive.match(h)
            est = index.estimate(h)
            assert est.best_blocks == max(naive.match(h).values(), default=0)
            assert 0.0 <= est.hit_ratio <= 1.0
        for n in NODES:
            assert index.entries(n) <= max_entries
            assert index.entries(n) == len(naive.keys.get(n, []))
        # No key is held by nobody: memory is only what the per-node LRUs hold.
        assert index.distinct_keys() <= index.total_entries() <= max_entries * len(NODES)
    for n in NODES:
        index.remove_node(n)
    assert index.distinct_keys() == 0 and index.total_entries() == 0


@settings(max_examples=200, deadline=None)
@given(a=prompts, b=prompts)
def test_hashes_are_deterministic_and_chained(a: str, b: str) -> None:
    i1: PrefixIndex[str] = PrefixIndex(block_chars=4)
    i2: PrefixIndex[str] = PrefixIndex(block_chars=4)
    assert i1.hashes(a) == i2.hashes(a)
    assert len(i1.hashes(a)) == -(-len(a) // 4)
    # A key names the whole prefix: full blocks of a shared prefix give the same keys...
    full = a[: len(a) - len(a) % 4]
    assert i1.hashes(full + b)[: len(full) // 4] == i1.hashes(full)
    # ...and a different block anywhere before changes every later key.
    if len(full) >= 4 and b:
        changed = ("b" if full[0] == "a" else "a") + full[1:]
        assert not set(i1.hashes(changed + b)) & set(i1.hashes(full + b))


def test_hash_domains_are_separate() -> None:
    idx: PrefixIndex[str] = PrefixIndex()
    assert idx.hashes("1,2,3") != idx.hashes([1, 2, 3])
    assert PrefixIndex[str](namespace="m1").hashes("x" * 100) != PrefixIndex[str](namespace="m2").hashes(
        "x" * 100
    )
    assert idx.hashes("") == [] and idx.hashes([]) == []
    capped: PrefixIndex[str] = PrefixIndex(block_chars=4, max_blocks=3)
    assert len(capped.hashes("x" * 100)) == 3


def test_shared_prefix_estimate() -> None:
    idx: PrefixIndex[str] = PrefixIndex(block_chars=64)
    system = "You are a helpful assistant. " * 10  # 290 chars -> 4 full blocks shared
    idx.record("p1", idx.hashes(system + "question one"))
    est = idx.estimate(idx.hashes(system + "question two, which is different"))
    assert est.best_node == "p1"
    assert est.best_blocks == 4 and est.total_blocks == 6  # 322 chars
    assert est.hit_ratio == pytest.approx(4 / 6)
    assert idx.estimate(idx.hashes("unrelated " * 30)).best_node is None


def test_lru_evicts_leaves_before_the_shared_root() -> None:
    idx: PrefixIndex[str] = PrefixIndex(block_chars=4, max_entries_per_node=3)
    idx.record("p0", idx.hashes("rootAAAA"))
    idx.record("p0", idx.hashes("rootBBBB"))
    idx.record("p0", idx.hashes("rootCCCC"))  # 4 distinct keys, room for 3
    assert idx.entries("p0") == 3
    assert idx.match(idx.hashes("rootCCCC")) == {"p0": 2}
    assert idx.match(idx.hashes("rootAAAA")) == {"p0": 1}  # its leaf went first, the root stayed


# ---- selection ---------------------------------------------------------------------------------


def est(total: int, **matches: int) -> PrefixEstimate[str]:
    best = max(matches, key=lambda k: matches[k]) if matches else None
    return PrefixEstimate(total, matches, best, matches.get(best, 0) if best else 0)


def test_prefers_hit_node_within_threshold() -> None:
    c = choose_prefill(est(10, p1=8), {"p0": 4, "p1": 6, "p2": 5}, ["p0", "p1", "p2"], threshold=0.5)
    assert c is not None and c.node == "p1" and c.reason == "cache_hit" and c.matched_blocks == 8
    assert c.hit_ratio == pytest.approx(0.8)


def test_overloaded_hit_node_falls_back_to_least_loaded() -> None:
    c = choose_prefill(est(10, p1=8), {"p0": 4, "p1": 7.1, "p2": 5}, ["p0", "p1", "p2"], threshold=0.5)
    assert c is not None and c.node == "p0" and c.reason == "least_loaded"
    # The absolute slack keeps one request in flight on an idle fleet from counting as overload.
    c = choose_prefill(est(10, p1=8), {"p0": 0, "p1": 1}, ["p0", "p1"])
    assert c is not None and c.node == "p1"
    c = choose_prefill(est(10, p1=8), {"p0": 0, "p1": 2}, ["p0", "p1"])
    assert c is not None and c.node == "p0"


def test_hit_node_must_be_a_candidate_and_longest_match_wins() -> None:
    loads = {"p0": 1.0, "p1": 1.0, "p2": 1.0}
    c = choose_prefill(est(10, p1=9, p2=3), loads, ["p0", "p2"])
    assert c is not None and c.node == "p2" and c.reason == "cache_hit"
    c = choose_prefill(est(10, p1=3, p2=3), {"p1": 2.0, "p2": 1.0}, ["p1", "p2"])
    assert c is not None and c.node == "p2"  # equal match: the less-loaded one
    assert choose_prefill(est(10, p1=3), loads, []) is None


def test_min_hit_ratio() -> None:
    c = choose_prefill(est(10, p1=2), {"p0": 0, "p1": 0.5}, ["p0", "p1"], min_hit_ratio=0.5)
    assert c is not None and c.node == "p0" and c.reason == "least_loaded"


def test_ties_rotate_round_robin() -> None:
    cands = ["p0", "p1", "p2"]
    picked = [choose_prefill(None, {}, cands, tie_breaker=i) for i in range(6)]
    assert [p.node for p in picked if p] == ["p0", "p1", "p2", "p0", "p1", "p2"]
    picked = [choose_prefill(est(4), {"p0": 1, "p1": 0, "p2": 0}, cands, tie_breaker=i) for i in range(4)]
    assert [p.node for p in picked if p] == ["p1", "p2", "p1", "p2"]


@settings(max_examples=500, deadline=None)
@given(
    matches=st.dictionaries(st.sampled_from(NODES), st.integers(min_value=1, max_value=10)),
    loads=st.dictionaries(st.sampled_from(NODES), st.floats(min_value=0, max_value=100)),
    cands=st.lists(st.sampled_from(NODES), min_size=1, max_size=3, unique=True),
    threshold=st.floats(min_value=0, max_value=2),
    tie=st.integers(min_value=0, max_value=10),
)
def test_selection_rule_property(
    matches: dict[str, int], loads: dict[str, float], cands: list[str], threshold: float, tie: int
) -> None:
    e = est(10, **matches)
    c = choose_prefill(e, loads, cands, threshold=threshold, tie_breaker=tie)
    assert c is not None and c.node in cands
    least = min(loads.get(x, 0.0) for x in cands)
    hits = [x for x in cands if matches.get(x, 0) > 0]
    if c.reason == "cache_hit":
        assert c.matched_blocks == max(matches[x] for x in hits) == matches[c.node]
        assert loads.get(c.node, 0.0) <= least * (1 + threshold) + 1.0
    else:
        assert loads.get(c.node, 0.0) == least
        if hits:
            best = max(matches[x] for x in hits)
            best_nodes = [x for x in hits if matches[x] == best]
            best_load = min(loads.get(x, 0.0) for x in best_nodes)
            assert best_load > least * (1 + threshold) + 1.0
    # Same inputs, same answer.
    assert choose_prefill(e, loads, cands, threshold=threshold, tie_breaker=tie) == c


def test_match_cost_does_not_depend_on_index_size() -> None:
    idx: PrefixIndex[str] = PrefixIndex(block_chars=8, max_entries_per_node=1_000_000)
    for i in range(2000):
        idx.record(f"p{i % 4}", idx.hashes(f"unrelated prompt number {i} " * 3))
    probe = idx.hashes("a prompt nobody has sent " * 4)
    # match() looks up only the probe's own keys: a miss on the first block ends it.
    lookups = itertools.count()
    real = idx._holders

    class Counting(dict[int, set[str]]):
        def get(self, key: int, default: object = None) -> object:  # type: ignore[override]
            next(lookups)
            return real.get(key, default)

    idx._holders = Counting()
    assert idx.match(probe) == {}
    assert next(lookups) == 1
