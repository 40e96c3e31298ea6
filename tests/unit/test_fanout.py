"""Splitting requests the engines cannot take whole, and merging the answers (pure)."""

from __future__ import annotations

import json

from pdmaster.fanout import StreamMerger, merge_bodies, split
from pdmaster.validation import Limits, parse_chat, parse_completion, parse_generate

LIMITS = Limits()


def completion(**body: object) -> bytes:
    return json.dumps({"model": "m", **body}).encode()


def test_single_requests_are_not_split() -> None:
    parsed = parse_completion(completion(prompt="hi"), LIMITS)
    assert split(parsed, split_samples=True) is None
    parsed = parse_completion(completion(prompt="hi", n=3), LIMITS)
    assert split(parsed, split_samples=False) is None  # vLLM takes n > 1 whole


def test_sglang_splits_samples_and_batches_into_single_requests() -> None:
    parsed = parse_completion(completion(prompt=["a", "b"], n=2), LIMITS)
    assert parsed.slots == 4
    parts = split(parsed, split_samples=True)
    assert parts is not None
    assert [(p.body["prompt"], p.body["n"], p.base, p.counts_prompt) for p in parts] == [
        ("a", 1, 0, True),
        ("a", 1, 1, False),
        ("b", 1, 2, True),
        ("b", 1, 3, False),
    ]


def test_vllm_splits_a_batch_per_prompt_and_keeps_n() -> None:
    parts = split(parse_completion(completion(prompt=[[1, 2], [3]], n=2), LIMITS), split_samples=False)
    assert parts is not None
    assert [(p.body["prompt"], p.body["n"], p.base) for p in parts] == [([1, 2], 2, 0), ([3], 2, 2)]


def test_generate_batches_and_samples() -> None:
    parsed = parse_generate(json.dumps({"text": ["x", "y"], "sampling_params": {"n": 2}}).encode(), LIMITS)
    parts = split(parsed, split_samples=True)
    assert parts is not None and len(parts) == 4
    assert parts[3].body["text"] == "y" and parts[3].body["sampling_params"]["n"] == 1
    ids = parse_generate(json.dumps({"input_ids": [[1], [2, 3]]}).encode(), LIMITS)
    assert ids.prompts == [[1], [2, 3]] and ids.slots == 2


def test_chat_with_n_splits_into_samples() -> None:
    parsed = parse_chat(json.dumps({"messages": [{"role": "user", "content": "q"}], "n": 3}).encode(), LIMITS)
    parts = split(parsed, split_samples=True)
    assert parts is not None and [p.base for p in parts] == [0, 1, 2]
    assert all(p.body["n"] == 1 and p.body["messages"] == parsed.body["messages"] for p in parts)


def test_merge_renumbers_choices_and_adds_usage() -> None:
    parts = split(parse_completion(completion(prompt=["a", "b"], n=2), LIMITS), split_samples=True)
    assert parts is not None
    bodies = [
        json.dumps(
            {
                "id": f"c{i}",
                "object": "text_completion",
                "choices": [{"index": 0, "text": f"t{i}"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
            }
        ).encode()
        for i in range(4)
    ]
    merged = json.loads(merge_bodies("completion", parts, bodies))
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "t0"),
        (1, "t1"),
        (2, "t2"),
        (3, "t3"),
    ]
    assert merged["usage"] == {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18}


def test_merge_generate_answers_into_a_list() -> None:
    parts = split(
        parse_generate(json.dumps({"text": "x", "sampling_params": {"n": 2}}).encode(), LIMITS),
        split_samples=True,
    )
    assert parts is not None
    merged = json.loads(merge_bodies("generate", parts, [b'{"text": "a"}', b'{"text": "b"}']))
    assert merged == [{"text": "a", "index": 0}, {"text": "b", "index": 1}]


def test_stream_merger_offsets_indexes_and_keeps_one_done() -> None:
    parts = split(parse_completion(completion(prompt="p", n=2, stream=True), LIMITS), split_samples=True)
    assert parts is not None
    m = StreamMerger("completion", parts)
    ev = b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
    out = m.feed(1, ev[:10]) + m.feed(1, ev[10:] + b"data: [DONE]\n\n") + m.feed(0, ev + b"data: [DONE]\n\n")
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert [e["choices"][0]["index"] for e in events] == [1, 0]
    assert b"[DONE]" not in out and m.finish() == b"data: [DONE]\n\n"


def test_stream_merger_merges_usage_chunks() -> None:
    parts = split(parse_chat(json.dumps({"messages": [{"role": "user", "content": "q"}], "n": 2,
                                         "stream": True}).encode(), LIMITS), split_samples=True)  # fmt: skip
    assert parts is not None
    m = StreamMerger("chat", parts)
    usage = b'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}\n\n'
    assert m.feed(0, usage) == b"" and m.feed(1, usage) == b""
    tail = m.finish()
    first = json.loads(tail.split(b"\n\n")[0][6:])
    assert first["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    assert tail.endswith(b"data: [DONE]\n\n")


def test_batch_limits_are_checked() -> None:
    import pytest

    from pdmaster.validation import InvalidRequest

    with pytest.raises(InvalidRequest, match="at most 2"):
        parse_completion(completion(prompt=["a", "b", "c"]), Limits(max_batch=2))
    with pytest.raises(InvalidRequest):
        parse_completion(completion(prompt=["a", {"x": 1}]), LIMITS)
