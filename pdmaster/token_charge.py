"""What a lease charges against a decode node's KV pool (DESIGN §13): pure, no I/O.

A request holds, at the end of its answer, its prompt's KV plus one token per generated token, per
sequence. The master cannot know the answer's length; what it charges is

    n x (prompt tokens + min(max_tokens, expected output) + the engine's reserve)

* **prompt tokens**: exact for token-id prompts; for text, the length divided by a characters-per-token
  ratio. The ratio starts at a conservative value (``--chars-per-token``; English text under Llama-3's
  tokenizer runs about 4, so 3 overestimates) and follows what the engines count for the prompts sent
  to them (``observe_prompt``), taken slightly low so that a text prompt is charged at least what it
  holds.
* **expected output**: until enough answers have ended, the whole ``max_tokens`` (clipped at
  ``clip_tokens`` as SGLang clips its estimate, and at most the context left): a worst case that never
  overruns the pool. Then a high quantile (``output_quantile``) of the lengths of recent answers,
  never more than the request's ``max_tokens``. Clients that ask for 4 096 tokens and get 300 would
  otherwise idle most of the pool (the engines themselves bet the same way: SGLang's decode server
  keeps a fixed 512 tokens per request free and retracts when answers outgrow the pool, vLLM
  allocates the prompt alone and preempts). An answer longer than its charge still fits while others
  are shorter; where the engine still runs out (it retracts or preempts), the registry charges less
  of that node's share (``pdmaster.registry.token_feedback``).
* **the engine's reserve**: what the engine keeps free for each active sequence beyond its KV.
  SGLang's decode server preallocates a request only while, after its prompt, 512 tokens per active
  request stay allocatable (``SGLANG_NUM_RESERVED_DECODE_TOKENS``, ``disaggregation/decode.py``); a
  charge without them would let the masters fill what SGLang keeps back, and requests would wait in
  its preallocation queue. vLLM keeps nothing back (0).

Every call is O(1) amortised: the quantile is recomputed from a bounded window every few answers.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

__all__ = ["TokenCharge", "TokenChargePolicy"]


@dataclass(frozen=True, slots=True)
class TokenChargePolicy:
    chars_per_token: float = 3.0  # for text prompts until the engines' counts are seen
    clip_tokens: int = 4096  # SGLang's CLIP_MAX_NEW_TOKENS: the most one answer is expected to need
    output_quantile: float = 0.95
    min_samples: int = 32  # answers seen before the quantile replaces the worst case
    window: int = 512  # recent answers the quantile is taken over
    recompute_every: int = 16
    ratio_margin: float = 0.95  # the learned chars-per-token ratio is taken this much low
    reserve_tokens: int = 0  # the engine's free KV per active sequence (SGLang's PD decode: 512)

    def __post_init__(self) -> None:
        if not (self.chars_per_token > 0 and math.isfinite(self.chars_per_token)):
            raise ValueError("chars_per_token must be a positive number")
        if self.clip_tokens < 1:
            raise ValueError("clip_tokens must be >= 1")
        if self.reserve_tokens < 0:
            raise ValueError("reserve_tokens must be >= 0")
        if not 0 < self.output_quantile <= 1:
            raise ValueError("output_quantile must be in (0, 1]")


class TokenCharge:
    """The charge of a request, learned from the answers the engines give."""

    def __init__(self, policy: TokenChargePolicy | None = None) -> None:
        self.policy = policy or TokenChargePolicy()
        self._outputs: deque[int] = deque(maxlen=self.policy.window)
        self._since = 0
        self._expected: int | None = None  # None: not enough answers yet (charge the worst case)
        # characters per token of text prompts, as the engines count them (decayed sums)
        self._chars = 0.0
        self._tokens = 0.0

    @property
    def chars_per_token(self) -> float:
        if self._tokens < 1:
            return self.policy.chars_per_token
        return self.policy.ratio_margin * self._chars / self._tokens

    @property
    def expected_output(self) -> int | None:
        return self._expected

    def prompt_tokens(self, text_chars: int, token_ids: int | None = None) -> int:
        """Tokens of one prompt: ``token_ids`` when it came as ids, else estimated from ``text_chars``."""
        if token_ids is not None:
            return token_ids
        return math.ceil(text_chars / self.chars_per_token)

    def output_tokens(self, max_tokens: int | None, context_left: int | None = None) -> int:
        """The output tokens charged for one sequence asking for ``max_tokens`` (None: up to the
        context; ``context_left``: what the model's context leaves after the prompt, if known)."""
        cap = self.policy.clip_tokens if max_tokens is None else max_tokens
        if context_left is not None:
            cap = min(cap, max(context_left, 0))
        cap = min(cap, self.policy.clip_tokens)
        expected = self._expected
        return cap if expected is None else min(cap, expected)

    def charge(
        self,
        prompt_tokens: int,
        max_tokens: int | None,
        sequences: int = 1,
        context_left: int | None = None,
    ) -> int:
        """KV tokens a request of ``sequences`` sequences over a prompt of ``prompt_tokens`` holds."""
        output = self.output_tokens(max_tokens, context_left)
        return sequences * (prompt_tokens + output + self.policy.reserve_tokens)

    # -- learning -------------------------------------------------------------------------------
    def observe_output(self, tokens: int) -> None:
        """An answer (one sequence) ended after ``tokens`` generated tokens."""
        if tokens < 0:
            return
        self._outputs.append(tokens)
        self._since += 1
        n = len(self._outputs)
        if n >= self.policy.min_samples and (
            self._expected is None or self._since >= self.policy.recompute_every
        ):
            self._since = 0
            ordered = sorted(self._outputs)
            self._expected = max(1, ordered[min(n - 1, math.ceil(self.policy.output_quantile * n) - 1)])

    def observe_prompt(self, chars: int, tokens: int) -> None:
        """An engine counted ``tokens`` for a text prompt of ``chars`` characters."""
        if chars <= 0 or tokens <= 0:
            return
        decay = 0.99  # about the last hundred prompts
        self._chars = self._chars * decay + chars
        self._tokens = self._tokens * decay + tokens

    def snapshot(self) -> dict[str, object]:
        return {
            "chars_per_token": round(self.chars_per_token, 3),
            "expected_output_tokens": self._expected,
            "output_samples": len(self._outputs),
            "output_quantile": self.policy.output_quantile,
            "reserve_tokens": self.policy.reserve_tokens,
        }
