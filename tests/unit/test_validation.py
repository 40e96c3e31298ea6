"""pdmaster.validation, called directly: what each parser accepts and how each refusal reads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdmaster.validation import InvalidRequest, Limits, parse_chat, parse_completion, parse_generate

LIMITS = Limits(max_n=4, max_tokens=100)


def raw(body: Any) -> bytes:
    return json.dumps(body).encode()


def refusal(parse: Any, body: bytes, limits: Limits = LIMITS) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse(body, limits)
    return info.value


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

# ---------------------------------------------------------------------------- accepted bodies


def test_chat_defaults_and_prompt_text() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image_url"}]},
            {"role": "assistant", "content": None},
        ]
    }
    p = parse_chat(raw(body), LIMITS)
    assert (p.kind, p.n, p.stream, p.max_tokens, p.input_ids) == ("chat", 1, False, None, None)
    assert p.prompt_text == "system: be brief\nuser: hello\n"  # non-text parts and None content add nothing
    assert p.body == body


def test_chat_stream_n_and_max_tokens() -> None:
    p = parse_chat(raw({**CHAT, "stream": True, "n": 4, "max_tokens": 100, "stream_options": {}}), LIMITS)
    assert (p.stream, p.n, p.max_tokens) == (True, 4, 100)
    # max_completion_tokens is the newer name; a float that is an integer counts as one
    p = parse_chat(raw({**CHAT, "max_completion_tokens": 7.0, "stream": None, "n": None}), LIMITS)
    assert (p.stream, p.n, p.max_tokens) == (False, 1, 7)


def test_completion_text_and_token_ids() -> None:
    p = parse_completion(raw({"prompt": "once upon", "stream": True}), LIMITS)
    assert (p.kind, p.prompt_text, p.input_ids, p.stream) == ("completion", "once upon", None, True)
    p = parse_completion(raw({"prompt": [1, 2, 3]}), LIMITS)
    assert (p.prompt_text, p.input_ids) == ("", [1, 2, 3])
    # a batch of one prompt is that prompt
    assert parse_completion(raw({"prompt": ["solo"]}), LIMITS).prompt_text == "solo"
    assert parse_completion(raw({"prompt": [[5, 6]]}), LIMITS).input_ids == [5, 6]


def test_generate_text_input_ids_and_sampling_params() -> None:
    p = parse_generate(raw({"text": "hi", "sampling_params": {"n": 2, "max_new_tokens": 9}}), LIMITS)
    assert (p.kind, p.prompt_text, p.n, p.max_tokens, p.stream) == ("generate", "hi", 2, 9, False)
    p = parse_generate(raw({"input_ids": [7, 8], "stream": True, "sampling_params": None}), LIMITS)
    assert (p.input_ids, p.prompt_text, p.n, p.stream) == ([7, 8], "", 1, True)


def test_model_is_checked_only_when_the_limits_name_one() -> None:
    assert parse_chat(raw({**CHAT, "model": "anything"}), LIMITS).body["model"] == "anything"
    served = Limits(model="sim")
    assert parse_completion(raw({"model": "sim", "prompt": "x"}), served).prompt_text == "x"
    assert parse_completion(raw({"prompt": "x"}), served).prompt_text == "x"  # model is optional


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "empty"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
    ],
)
@pytest.mark.parametrize("parse", [parse_chat, parse_completion, parse_generate])
def test_body_must_be_a_json_object(parse: Any, body: bytes, message: str) -> None:
    err = refusal(parse, body)
    assert (err.status, err.code, err.param) == (400, "invalid_request", None)
    assert message in err.message


def test_unknown_model_is_a_404_naming_the_served_one() -> None:
    err = refusal(parse_chat, raw({**CHAT, "model": "gpt-x"}), Limits(model="sim"))
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert "'gpt-x'" in err.message and "'sim'" in err.message
    err = refusal(parse_completion, raw({"model": 3, "prompt": "x"}))
    assert (err.status, err.param) == (400, "model")


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        ("hi", "messages"),
        (["hi"], "messages[0]"),
        ([{"content": "no role"}], "messages[0]"),
        ([{"role": "user", "content": 5}], "messages[0]"),
        ([{"role": "user", "content": ["x"]}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content"),
        ([{"role": "user", "content": "ok"}, {"role": 2}], "messages[1]"),
    ],
)
def test_chat_messages_refusals_name_the_field(messages: Any, param: str) -> None:
    body = {"messages": messages} if messages is not None else {}
    err = refusal(parse_chat, raw(body))
    assert (err.status, err.code, err.param) == (400, "invalid_request", param)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", 0, "between 1 and 4"),
        ("n", 5, "between 1 and 4, got 5"),
        ("n", "2", "must be an integer, got str"),
        ("n", True, "must be an integer, got bool"),
        ("n", 1.5, "must be an integer, got float"),
        ("max_tokens", 101, "between 1 and 100, got 101"),
        ("max_tokens", 0, "between 1 and 100"),
        ("max_completion_tokens", 1000, "between 1 and 100"),
        ("temperature", 2.5, "between 0 and 2"),
        ("temperature", "hot", "must be a number"),
        ("top_p", -0.1, "between 0 and 1"),
        ("stream", "yes", "must be a boolean"),
        ("stream_options", [], "must be an object"),
        ("stream_options", {}, "only allowed when 'stream' is true"),
    ],
)
@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_common_limits(parse: Any, field: str, value: Any, message: str) -> None:
    base = CHAT if parse is parse_chat else {"prompt": "x"}
    err = refusal(parse, raw({**base, field: value}))
    assert (err.status, err.code, err.param) == (400, "invalid_request", field)
    assert message in err.message


def test_limits_are_the_callers() -> None:
    body = raw({**CHAT, "n": 16, "max_tokens": 32768})
    p = parse_chat(body, Limits())  # the defaults allow these
    assert (p.n, p.max_tokens) == (16, 32768)
    assert refusal(parse_chat, body, Limits(max_n=8)).param == "n"
    assert refusal(parse_chat, body, Limits(max_tokens=1024)).param == "max_tokens"


@pytest.mark.parametrize("prompt", [None, 5, [], [1, "a"], [True], {"text": "x"}, ["a", {"x": 1}], [[1], []]])
def test_completion_prompt_must_be_a_prompt_or_a_batch_of_them(prompt: Any) -> None:
    body = {"prompt": prompt} if prompt is not None else {}
    err = refusal(parse_completion, raw(body))
    assert (err.status, err.param) == (400, "prompt")
    assert "prompt" in err.message


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2, 3]], ["a", [4]]])
def test_a_list_of_prompts_is_a_batch(prompt: Any) -> None:
    p = parse_completion(raw({"prompt": prompt, "n": 2}), LIMITS)
    assert p.prompts == prompt and p.slots == 2 * len(prompt)
    assert refusal(parse_completion, raw({"prompt": prompt}), Limits(max_batch=1)).param == "prompt"


@pytest.mark.parametrize("ids", [[-1], [2**31]])
def test_token_ids_must_be_in_range(ids: list[int]) -> None:
    assert refusal(parse_completion, raw({"prompt": ids})).param == "prompt"
    err = refusal(parse_generate, raw({"input_ids": ids}))
    assert err.param == "input_ids" and "[0, 2^31)" in err.message


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "text", "'text' (a string or an array of strings) or 'input_ids' is required"),
        ({"text": 5}, "text", "is required"),
        ({"input_ids": []}, "input_ids", "non-empty array of token ids"),
        ({"input_ids": ["a"], "text": "x"}, "input_ids", "non-empty array"),
        ({"text": "x", "sampling_params": []}, "sampling_params", "must be an object"),
        ({"text": "x", "sampling_params": {"n": 5}}, "sampling_params.n", "between 1 and 4"),
        (
            {"text": "x", "sampling_params": {"max_new_tokens": 0}},
            "sampling_params.max_new_tokens",
            "between",
        ),
        ({"text": "x", "sampling_params": {"temperature": 101}}, "temperature", "between 0 and 100"),
        ({"text": "x", "stream": 1}, "stream", "must be a boolean"),
    ],
)
def test_generate_refusals(body: dict[str, Any], param: str, message: str) -> None:
    err = refusal(parse_generate, raw(body))
    assert (err.status, err.code, err.param) == (400, "invalid_request", param)
    assert message in err.message
