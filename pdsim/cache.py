"""Pseudo-tokenization and the prefill server's bounded prefix cache (pure, synchronous).

Tokenization is deterministic and model-free: a text prompt of ``L`` characters is ``ceil(L / 4)``
tokens (four characters per token, roughly what BPE tokenizers give on English text); an ``input_ids``
prompt is its own token list. The cache works on fixed-size blocks of ``block_tokens`` tokens
(``4 * block_tokens`` characters for text). Only full blocks are cached, as in a paged KV cache. Each
block's key is a chained hash, so one key identifies the whole prefix up to and including that block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

CHARS_PER_TOKEN = 4


def count_tokens(prompt: str | Sequence[int]) -> int:
    if isinstance(prompt, str):
        return -(-len(prompt) // CHARS_PER_TOKEN)
    return len(prompt)


def block_keys(prompt: str | Sequence[int], block_tokens: int) -> list[int]:
    """Chained keys of the full blocks of ``prompt`` (a partial tail block is not cacheable)."""
    if isinstance(prompt, str):
        step = block_tokens * CHARS_PER_TOKEN
        chunks = [prompt[i : i + step].encode() for i in range(0, len(prompt) - step + 1, step)]
        prev = b"text"
    else:
        chunks = [
            ",".join(map(str, prompt[i : i + block_tokens])).encode()
            for i in range(0, len(prompt) - block_tokens + 1, block_tokens)
        ]
        prev = b"ids"
    keys: list[int] = []
    for chunk in chunks:
        prev = hashlib.blake2b(prev + b"\x00" + chunk, digest_size=8).digest()
        keys.append(int.from_bytes(prev, "big"))
    return keys


@dataclass(frozen=True, slots=True)
class CacheLookup:
    prompt_tokens: int
    cached_tokens: int

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class PrefixCache:
    """LRU set of block keys, at most ``capacity_blocks`` entries."""

    def __init__(self, capacity_blocks: int, block_tokens: int) -> None:
        if capacity_blocks < 0 or block_tokens <= 0:
            raise ValueError("capacity_blocks must be >= 0 and block_tokens > 0")
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def lookup_and_insert(self, prompt: str | Sequence[int]) -> CacheLookup:
        """Count the cached prefix of ``prompt`` and then cache all its full blocks."""
        keys = block_keys(prompt, self.block_tokens)
        matched = 0
        for key in keys:
            if key not in self._lru:
                break
            matched += 1
        # Insert deepest block first so the root is most recently used: eviction then trims
        # chains from the leaves, keeping every cached chain a contiguous prefix.
        for key in reversed(keys):
            self._lru[key] = None
            self._lru.move_to_end(key)
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)
        total = count_tokens(prompt)
        return CacheLookup(prompt_tokens=total, cached_tokens=min(total, matched * self.block_tokens))
