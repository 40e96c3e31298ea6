"""Choosing the engines for an admitted request.

The decode node is where the admission lease was placed (capacity is counted per decode node, so
there is no other choice to make). The prefill node is chosen by a :class:`PrefillPolicy`:
cache-aware (the node whose approximate prefix cache holds the longest prefix of the prompt, unless
it is overloaded; :func:`choose_prefill`, pure) or round-robin (for comparison). The router keeps the
prefix index in step with the node table: a prefill node that leaves the live set is dropped from
the index, so it can no longer make a request look like a probable cache hit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from pdmaster.prefix_index import PrefixEstimate, PrefixIndex
from pdmaster.registry import PREFILL, Node, NodeRegistry

__all__ = [
    "POLICIES",
    "CacheAwarePrefill",
    "PrefillChoice",
    "PrefillPolicy",
    "RoundRobinPrefill",
    "Router",
    "choose_prefill",
]

NodeId = TypeVar("NodeId", bound=Hashable)


@dataclass(frozen=True, slots=True)
class PrefillChoice(Generic[NodeId]):
    node: NodeId
    reason: Literal["cache_hit", "least_loaded"]
    matched_blocks: int
    hit_ratio: float


def choose_prefill(
    estimate: PrefixEstimate[NodeId] | None,
    loads: Mapping[NodeId, float],
    candidates: Sequence[NodeId],
    *,
    threshold: float = 0.5,
    slack: float = 1.0,
    min_hit_ratio: float = 0.0,
    tie_breaker: int = 0,
) -> PrefillChoice[NodeId] | None:
    """Pick the prefill node: the node with the longest cached prefix, unless it is overloaded.

    The hit node (most matched blocks among ``candidates``; ties to the lower load, then candidate
    order) wins when its ratio exceeds ``min_hit_ratio`` and
    ``load(hit) <= least_load * (1 + threshold) + slack`` — the relative threshold, plus an absolute
    ``slack`` so that one in-flight request on an otherwise idle fleet does not count as overload.
    Otherwise the least-loaded candidate wins; ties go round-robin by ``tie_breaker`` (the caller
    passes a counter it increments per request). A node missing from ``loads`` counts as load 0.
    Returns None when there are no candidates.
    """
    if not candidates:
        return None
    least_load = min(loads.get(c, 0.0) for c in candidates)
    if estimate is not None and estimate.total_blocks:
        hit: NodeId | None = None
        best_key: tuple[int, float, int] | None = None
        for pos, c in enumerate(candidates):
            blocks = estimate.matches.get(c, 0)
            if blocks <= 0:
                continue
            key = (blocks, -loads.get(c, 0.0), -pos)
            if best_key is None or key > best_key:
                hit, best_key = c, key
        if hit is not None and best_key is not None:
            ratio = best_key[0] / estimate.total_blocks
            if ratio > min_hit_ratio and loads.get(hit, 0.0) <= least_load * (1.0 + threshold) + slack:
                return PrefillChoice(hit, "cache_hit", best_key[0], ratio)
    tied = [c for c in candidates if loads.get(c, 0.0) == least_load]
    node = tied[tie_breaker % len(tied)]
    matched = estimate.matches.get(node, 0) if estimate is not None else 0
    ratio = estimate.ratio(node) if estimate is not None else 0.0
    return PrefillChoice(node, "least_loaded", matched, ratio)


class PrefillPolicy(Protocol):
    def choose(
        self, candidates: Sequence[Node], estimate: PrefixEstimate[str], in_flight: Mapping[str, int]
    ) -> Node | None:
        """One of ``candidates`` (live prefill nodes sorted by id, never empty), or None."""
        ...


class CacheAwarePrefill:
    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self, candidates: Sequence[Node], estimate: PrefixEstimate[str], in_flight: Mapping[str, int]
    ) -> Node | None:
        self._turn += 1
        if len(candidates) == 1:
            return candidates[0]  # what choose_prefill would answer, without building its inputs
        by_id = {n.node_id: n for n in candidates}
        loads = {nid: float(in_flight.get(nid, 0)) for nid in by_id}
        chosen = choose_prefill(estimate, loads, list(by_id), tie_breaker=self._turn)
        return by_id[chosen.node] if chosen is not None else None


class RoundRobinPrefill:
    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self, candidates: Sequence[Node], estimate: PrefixEstimate[str], in_flight: Mapping[str, int]
    ) -> Node | None:
        self._turn += 1
        return candidates[self._turn % len(candidates)]


POLICIES: dict[str, type[CacheAwarePrefill] | type[RoundRobinPrefill]] = {
    "cache-aware": CacheAwarePrefill,
    "round-robin": RoundRobinPrefill,
}


class Router:
    """The engines for one request, from the node table, the prefix index and a prefill policy."""

    def __init__(self, registry: NodeRegistry, policy: PrefillPolicy | None = None) -> None:
        self.registry = registry
        self.policy: PrefillPolicy = policy if policy is not None else CacheAwarePrefill()
        self.index: PrefixIndex[str] = PrefixIndex()
        self.prefill_in_flight: dict[str, int] = defaultdict(int)
        registry.on_node_left(self._node_left)

    def _node_left(self, node_id: str, role: str) -> None:
        if role == PREFILL:
            self.index.remove_node(node_id)

    def estimate(self, prompt: str | Sequence[int]) -> tuple[list[int], PrefixEstimate[str]]:
        """The prompt's block hashes and the cache estimate; made once per request and reused."""
        hashes = self.index.hashes(prompt)
        return hashes, self.index.estimate(hashes)

    def prefill(self, estimate: PrefixEstimate[str], exclude: Collection[str] = ()) -> Node | None:
        """A live prefill node (its engine usable), never one in ``exclude`` (it failed this request)."""
        candidates = self.registry.live(PREFILL)  # sorted by id, cached by the registry
        if exclude:
            candidates = [n for n in candidates if n.node_id not in exclude]
        if not candidates:
            return None
        return self.policy.choose(candidates, estimate, self.prefill_in_flight)

    def decode(self, placement: str | None) -> Node | None:
        """The decode node of an admission lease (None when it has gone meanwhile)."""
        return self.registry.nodes.get(placement or "")

    def routed(self, prefill: Node, hashes: Sequence[int]) -> None:
        """The request goes to ``prefill``: its cache will hold the prompt; it has one more in flight."""
        self.index.record(prefill.node_id, hashes)
        self.prefill_in_flight[prefill.node_id] += 1

    def prefill_done(self, prefill: Node) -> None:
        self.prefill_in_flight[prefill.node_id] -= 1
