"""Choosing the engines for an admitted request.

The decode node is where the admission lease was placed (capacity is counted per decode node, so
there is no other choice to make). The prefill node is chosen by a :class:`PrefillPolicy`:
earliest first token (the default: the node with the fewest prompt tokens to compute before this
request's last one, its backlog plus the part of the prompt its cache does not hold; DESIGN §13),
cache-aware (the node whose approximate prefix cache holds the longest prefix of the prompt, unless
it is overloaded by request count; :func:`choose_prefill`, pure) or round-robin (for comparison).

A prefill node's backlog is the uncached prompt tokens this master sent it that have not produced
their first output yet, or what its engine reports queued (every master's requests, through its agent;
``Load.prefill_backlog_tokens``), whichever is larger: the report is up to a report interval old and
this master's own count is exact for its part. The router keeps the
prefix index in step with the node table: a prefill node that leaves the live set is dropped from
the index, so it can no longer make a request look like a probable cache hit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

from pdmaster.prefix_index import PrefixEstimate, PrefixIndex
from pdmaster.registry import PREFILL, Node, NodeRegistry

__all__ = [
    "POLICIES",
    "CacheAwarePrefill",
    "EarliestFirstToken",
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


def earliest(candidates: Sequence[NodeId], ahead: Sequence[int], tie_breaker: int = 0) -> NodeId:
    """The candidate with the fewest tokens ``ahead`` (same order); ties round-robin by ``tie_breaker``."""
    least = min(ahead)
    tied = [c for c, a in zip(candidates, ahead, strict=True) if a == least]
    return tied[tie_breaker % len(tied)]


class PrefillPolicy(Protocol):
    def choose(
        self,
        candidates: Sequence[Node],
        estimate: PrefixEstimate[str],
        in_flight: Mapping[str, int],
        ahead: Callable[[Node], int] | None = None,
    ) -> Node | None:
        """One of ``candidates`` (live prefill nodes sorted by id, never empty), or None. ``ahead``:
        the prompt tokens a node would compute before this request's first token."""
        ...


class EarliestFirstToken:
    """The node where the request's prefill would end first: fewest tokens ahead of its last one
    (the node's backlog plus the prompt's uncached part there). Cache hits count as the tokens they
    save; a hit node that is busy loses to an idle one once its backlog outweighs the hit."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self,
        candidates: Sequence[Node],
        estimate: PrefixEstimate[str],
        in_flight: Mapping[str, int],
        ahead: Callable[[Node], int] | None = None,
    ) -> Node | None:
        self._turn += 1
        if len(candidates) == 1:
            return candidates[0]
        if ahead is None:
            return candidates[self._turn % len(candidates)]
        return earliest(candidates, [ahead(n) for n in candidates], self._turn)


class CacheAwarePrefill:
    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self,
        candidates: Sequence[Node],
        estimate: PrefixEstimate[str],
        in_flight: Mapping[str, int],
        ahead: Callable[[Node], int] | None = None,
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
        self,
        candidates: Sequence[Node],
        estimate: PrefixEstimate[str],
        in_flight: Mapping[str, int],
        ahead: Callable[[Node], int] | None = None,
    ) -> Node | None:
        self._turn += 1
        return candidates[self._turn % len(candidates)]


POLICIES: dict[str, type[EarliestFirstToken] | type[CacheAwarePrefill] | type[RoundRobinPrefill]] = {
    "earliest-first-token": EarliestFirstToken,
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
        # Uncached prompt tokens this master sent each prefill node that have not produced their first
        # output yet (``routed`` .. ``prefill_tokens_done``).
        self.prefill_tokens: dict[str, int] = defaultdict(int)
        registry.on_node_left(self._node_left)

    def _node_left(self, node_id: str, role: str) -> None:
        if role == PREFILL:
            self.index.remove_node(node_id)

    def estimate(self, prompt: str | Sequence[int]) -> tuple[list[int], PrefixEstimate[str]]:
        """The prompt's block hashes and the cache estimate; made once per request and reused."""
        hashes = self.index.hashes(prompt)
        return hashes, self.index.estimate(hashes)

    def backlog(self, node: Node) -> int:
        """Prompt tokens ``node`` still has to compute: this master's, or its engine's word on every
        master's, whichever is larger."""
        reported = node.load.prefill_backlog_tokens if node.load.probe_ok else None
        own = self.prefill_tokens.get(node.node_id, 0)
        return own if reported is None or reported < own else reported

    @staticmethod
    def uncached(node: Node, estimate: PrefixEstimate[str], prompt_tokens: int) -> int:
        """The prompt tokens ``node``'s cache does not hold (as far as the prefix index knows)."""
        return prompt_tokens - int(prompt_tokens * estimate.ratio(node.node_id))

    def tokens_ahead(self, node: Node, estimate: PrefixEstimate[str], prompt_tokens: int) -> int:
        """Prompt tokens ``node`` computes before this request's first token: its backlog plus the
        request's uncached part there."""
        return self.backlog(node) + self.uncached(node, estimate, prompt_tokens)

    def least_ahead(self, estimate: PrefixEstimate[str], prompt_tokens: int) -> tuple[int, int] | None:
        """``tokens_ahead`` on the live prefill node where it is least, and of those the request's
        own uncached tokens there (None: no prefill node)."""
        best: tuple[int, int] | None = None
        for n in self.registry.live(PREFILL):
            own = self.uncached(n, estimate, prompt_tokens)
            ahead = self.backlog(n) + own
            if best is None or ahead < best[0]:
                best = (ahead, own)
        return best

    def prefill(
        self, estimate: PrefixEstimate[str], exclude: Collection[str] = (), prompt_tokens: int = 0
    ) -> Node | None:
        """A live prefill node (its engine usable), never one in ``exclude`` (it failed this request)."""
        candidates = self.registry.live(PREFILL)  # sorted by id, cached by the registry
        if exclude:
            candidates = [n for n in candidates if n.node_id not in exclude]
        if not candidates:
            return None

        def ahead(node: Node) -> int:
            return self.tokens_ahead(node, estimate, prompt_tokens)

        return self.policy.choose(candidates, estimate, self.prefill_in_flight, ahead)

    def decode(self, placement: str | None) -> Node | None:
        """The decode node of an admission lease (None when it has gone meanwhile)."""
        return self.registry.nodes.get(placement or "")

    def routed(self, prefill: Node, hashes: Sequence[int], tokens: int = 0) -> None:
        """The request goes to ``prefill``: its cache will hold the prompt; it has one more in flight,
        with ``tokens`` uncached prompt tokens (given back by ``prefill_tokens_done``)."""
        self.index.record(prefill.node_id, hashes)
        self.prefill_in_flight[prefill.node_id] += 1
        if tokens:
            self.prefill_tokens[prefill.node_id] += tokens

    def prefill_done(self, prefill: Node) -> None:
        self.prefill_in_flight[prefill.node_id] -= 1

    def prefill_tokens_done(self, node_id: str, tokens: int) -> None:
        """A request's prompt on ``node_id`` was computed (its first output came) or abandoned."""
        left = self.prefill_tokens.get(node_id, 0) - tokens
        if left > 0:
            self.prefill_tokens[node_id] = left
        else:
            self.prefill_tokens.pop(node_id, None)
