"""Approximate prefix index of the prefill nodes' KV caches (the choice it informs is in ``routing``).

Pure, synchronous, I/O-free. The prompt is cut into fixed-size blocks (characters of the text, or
token ids when the request carries ``input_ids``); block *i*'s key is a chained hash of key *i-1* and
the block, so one key stands for the whole prefix up to and including that block. Each node keeps an
LRU-bounded set of keys, which approximates what that node's engine still has cached.

Cost per request: :meth:`PrefixIndex.hashes` is O(prompt length) and is computed once; :meth:`match`
walks the chain from the root and drops a node at its first miss, so it is O(blocks * nodes holding
the prefix) and never scans the index; :meth:`record` is O(blocks). Memory is bounded by
``max_entries_per_node`` keys per node.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

NodeId = TypeVar("NodeId", bound=Hashable)

DEFAULT_BLOCK_CHARS = 64
DEFAULT_BLOCK_TOKENS = 16
DEFAULT_MAX_ENTRIES_PER_NODE = 65_536
DEFAULT_MAX_BLOCKS = 4096


def _order(node: object) -> tuple[str, str]:
    # A stable, type-tolerant order for tie-breaks (node ids are usually strings).
    return (type(node).__name__, str(node))


@dataclass(frozen=True, slots=True)
class PrefixEstimate(Generic[NodeId]):
    """Result of one lookup: blocks matched per node (only nodes with ≥ 1), and the best of them."""

    total_blocks: int
    matches: Mapping[NodeId, int] = field(default_factory=dict)
    best_node: NodeId | None = None
    best_blocks: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.best_blocks / self.total_blocks if self.total_blocks else 0.0

    def ratio(self, node: NodeId) -> float:
        return self.matches.get(node, 0) / self.total_blocks if self.total_blocks else 0.0


class PrefixIndex(Generic[NodeId]):
    def __init__(
        self,
        *,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        max_entries_per_node: int = DEFAULT_MAX_ENTRIES_PER_NODE,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        namespace: str = "",
    ) -> None:
        if min(block_chars, block_tokens, max_entries_per_node, max_blocks) <= 0:
            raise ValueError("block sizes, max_entries_per_node and max_blocks must be positive")
        self.block_chars = block_chars
        self.block_tokens = block_tokens
        self.max_entries_per_node = max_entries_per_node
        self.max_blocks = max_blocks
        # The namespace (e.g. the model name) seeds the chain, so different models never match.
        self._seed = hashlib.blake2b(namespace.encode(), digest_size=8).digest()
        self._lru: dict[NodeId, OrderedDict[int, None]] = {}
        self._holders: dict[int, set[NodeId]] = {}

    # ---- hashing ----------------------------------------------------------------------------

    def hashes(self, prompt: str | Sequence[int]) -> list[int]:
        """Chained block keys of ``prompt`` (at most ``max_blocks``; a partial last block counts)."""
        if isinstance(prompt, str):
            step = self.block_chars
            limit = min(len(prompt), step * self.max_blocks)
            chunks: Iterable[bytes] = (prompt[i : i + step].encode() for i in range(0, limit, step))
            tag = b"t"
        else:
            step = self.block_tokens
            limit = min(len(prompt), step * self.max_blocks)
            chunks = (",".join(map(str, prompt[i : i + step])).encode() for i in range(0, limit, step))
            tag = b"i"
        prev = self._seed + tag
        keys: list[int] = []
        for chunk in chunks:
            prev = hashlib.blake2b(prev + chunk, digest_size=8).digest()
            keys.append(int.from_bytes(prev, "big"))
        return keys

    # ---- queries ----------------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> dict[NodeId, int]:
        """Leading blocks of ``hashes`` each node holds, for the nodes holding at least one."""
        if not hashes:
            return {}
        alive = set(self._holders.get(hashes[0], ()))
        result: dict[NodeId, int] = dict.fromkeys(alive, 1)
        for depth, key in enumerate(hashes[1:], start=2):
            if not alive:
                break
            holders = self._holders.get(key)
            if not holders:
                break
            alive &= holders
            for node in alive:
                result[node] = depth
        return result

    def estimate(self, hashes: Sequence[int]) -> PrefixEstimate[NodeId]:
        matches = self.match(hashes)
        best, best_blocks = None, 0
        for node, blocks in matches.items():
            if (
                best is None
                or blocks > best_blocks
                or (blocks == best_blocks and _order(node) < _order(best))
            ):
                best, best_blocks = node, blocks
        return PrefixEstimate(
            total_blocks=len(hashes), matches=matches, best_node=best, best_blocks=best_blocks
        )

    # ---- updates ----------------------------------------------------------------------------

    def record(self, node: NodeId, hashes: Sequence[int]) -> None:
        """Note that ``node`` now caches the prefix ``hashes`` (call after routing the request there)."""
        lru = self._lru.get(node)
        if lru is None:
            lru = self._lru[node] = OrderedDict()
        # Deepest first, root last: the root becomes most recently used, so eviction trims chains
        # from the leaves and a node's keys stay prefix-closed (what match() relies on).
        for key in reversed(hashes):
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                self._holders.setdefault(key, set()).add(node)
        while len(lru) > self.max_entries_per_node:
            old, _ = lru.popitem(last=False)
            self._drop_holder(old, node)

    def remove_node(self, node: NodeId) -> None:
        lru = self._lru.pop(node, None)
        if lru is None:
            return
        for key in lru:
            self._drop_holder(key, node)

    def _drop_holder(self, key: int, node: NodeId) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(node)
            if not holders:
                del self._holders[key]

    # ---- introspection ----------------------------------------------------------------------

    def nodes(self) -> list[NodeId]:
        return list(self._lru)

    def entries(self, node: NodeId) -> int:
        lru = self._lru.get(node)
        return len(lru) if lru is not None else 0

    def total_entries(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def distinct_keys(self) -> int:
        return len(self._holders)
