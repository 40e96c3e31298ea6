"""The KV-token charge of a request (pdmaster/token_charge.py) and its wiring into a request's count."""

from __future__ import annotations

import json

import pytest

from pdmaster.pipeline import prompt_tokens_in, request_tokens
from pdmaster.token_charge import TokenCharge, TokenChargePolicy
from pdmaster.validation import Limits, parse_chat, parse_completion, parse_generate


def _j(body: object) -> bytes:
    return json.dumps(body).encode()


def test_worst_case_until_answers_are_seen() -> None:
    c = TokenCharge(TokenChargePolicy(min_samples=4))
    assert c.expected_output is None
    assert c.charge(1000, 300) == 1300
    assert c.charge(1000, None) == 1000 + 4096  # no max_tokens: SGLang's clip
    assert c.charge(1000, 10_000) == 1000 + 4096
    assert c.charge(1000, 300, sequences=3) == 3 * 1300
    assert c.charge(1000, 300, context_left=100) == 1100


def test_the_quantile_of_answers_replaces_the_worst_case() -> None:
    c = TokenCharge(TokenChargePolicy(min_samples=20, output_quantile=0.9, recompute_every=1))
    for k in range(1, 21):
        c.observe_output(10 * k)  # 10 .. 200
    assert c.expected_output == 180
    assert c.charge(500, 4096) == 500 + 180
    assert c.charge(500, 50) == 550  # never more than it asks for
    c.observe_output(-1)  # nonsense is ignored
    assert c.expected_output == 180


def test_text_prompts_follow_the_engines_count_and_stay_conservative() -> None:
    c = TokenCharge(TokenChargePolicy(chars_per_token=3.0))
    assert c.prompt_tokens(300) == 100
    assert c.prompt_tokens(300, token_ids=7) == 7
    for _ in range(50):
        c.observe_prompt(400, 100)  # the engine counts 4 characters a token
    assert 3.7 < c.chars_per_token < 4.0  # a little low: text is charged at least what it holds
    assert c.prompt_tokens(4000) >= 1000


def test_bad_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="chars_per_token"):
        TokenChargePolicy(chars_per_token=0)
    with pytest.raises(ValueError, match="output_quantile"):
        TokenChargePolicy(output_quantile=0)


def test_request_tokens_counts_every_prompt_and_choice() -> None:
    c = TokenCharge()
    limits = Limits()
    ids = parse_generate(
        _j({"input_ids": list(range(100)), "sampling_params": {"max_new_tokens": 20}}), limits
    )
    assert request_tokens(ids, c) == (100, 120)
    chat = parse_chat(
        _j({"model": "m", "messages": [{"role": "user", "content": "x" * 297}], "max_tokens": 10, "n": 2}),
        limits,
    )
    # "user: " + 297 characters + newline = 304 characters, 3 a token, rounded up: 102
    assert request_tokens(chat, c) == (102, 2 * (102 + 10))
    batch = parse_completion(_j({"model": "m", "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 5}), limits)
    assert request_tokens(batch, c) == (5, (3 + 5) + (2 + 5))


def test_the_engines_reserve_is_charged_per_sequence() -> None:
    c = TokenCharge(TokenChargePolicy(reserve_tokens=512))
    assert c.charge(1000, 300, sequences=2) == 2 * (1000 + 300 + 512)
    with pytest.raises(ValueError, match="reserve_tokens"):
        TokenChargePolicy(reserve_tokens=-1)


def test_the_engines_prompt_count_is_read_from_an_answer() -> None:
    assert prompt_tokens_in(b'{"usage": {"prompt_tokens": 1234, "completion_tokens": 5}}') == 1234
    assert prompt_tokens_in(b'data: {"meta_info": {"prompt_tokens":77}}\n\ndata: [DONE]\n\n') == 77
    assert prompt_tokens_in(b'data: {"choices": []}\n\n') is None
    assert prompt_tokens_in(b'{"prompt_tokens": "x"}') is None
