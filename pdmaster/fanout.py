"""Requests the engines cannot take whole, split into parts and merged back (pure).

* SGLang cannot serve n > 1 in PD mode: its tokenizer manager sends every sample of a prompt with the
  prompt's one ``bootstrap_room``, so the samples collide on the KV transfer (the n > 1 hangs of its
  issue tracker). Each sample becomes a request of its own, with its own room.
* A batch (a list of prompts) becomes one request per prompt (per sample, for SGLang), so every part
  has one prompt and one room, on either protocol.

All parts of a request go to the same prefill and decode node: the admission lease holds the slots of
the whole gang on that decode node. The answers are merged in order: choice ``index`` of part *p* is
offset by the number of outputs before it (OpenAI numbers a batch's choices prompt by prompt), usage
adds up (a prompt's tokens counted once), a streamed answer keeps one ``[DONE]`` at its end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdmaster.validation import ParsedRequest

__all__ = ["Part", "StreamMerger", "merge_bodies", "split"]


@dataclass(frozen=True, slots=True)
class Part:
    body: dict[str, Any]
    base: int  # global index of this part's first output
    counts_prompt: bool  # the first part of its prompt: its usage.prompt_tokens count


def _with_prompt(kind: str, body: dict[str, Any], prompt: str | list[int] | None) -> dict[str, Any]:
    out = dict(body)
    if prompt is None:
        return out
    if kind == "completion":
        out["prompt"] = prompt
    elif isinstance(prompt, str):  # generate
        out["text"] = prompt
        out.pop("input_ids", None)
    else:
        out["input_ids"] = prompt
        out.pop("text", None)
    return out


def _with_n(kind: str, body: dict[str, Any], n: int) -> dict[str, Any]:
    if kind == "generate":
        body["sampling_params"] = {**(body.get("sampling_params") or {}), "n": n}
    else:
        body["n"] = n
    return body


def split(parsed: ParsedRequest, *, split_samples: bool) -> list[Part] | None:
    """The parts of a request, or None when it goes to the engines whole."""
    prompts: list[str | list[int] | None] = list(parsed.prompts) if parsed.prompts is not None else [None]
    n = parsed.n
    if len(prompts) == 1 and prompts[0] is None and (n == 1 or not split_samples):
        return None
    samples = n if split_samples else 1
    parts: list[Part] = []
    for i, prompt in enumerate(prompts):
        for j in range(samples):
            body = _with_n(parsed.kind, _with_prompt(parsed.kind, parsed.body, prompt), n // samples)
            parts.append(Part(body, i * n + j, j == 0))
    return parts


def _reindex(kind: str, obj: Any, base: int) -> None:
    if kind == "generate":
        if isinstance(obj, dict):
            obj["index"] = base + int(obj.get("index") or 0)
        return
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict):
            choice["index"] = base + int(choice.get("index") or 0)


def _add_usage(total: dict[str, int], usage: Any, counts_prompt: bool) -> None:
    if not isinstance(usage, dict):
        return
    if counts_prompt:
        total["prompt_tokens"] = total.get("prompt_tokens", 0) + int(usage.get("prompt_tokens") or 0)
    total["completion_tokens"] = total.get("completion_tokens", 0) + int(usage.get("completion_tokens") or 0)
    total["total_tokens"] = total.get("prompt_tokens", 0) + total["completion_tokens"]


def merge_bodies(kind: str, parts: list[Part], bodies: list[bytes]) -> bytes:
    """One answer from the parts' whole (non-streamed) answers. ValueError: a part is not JSON."""
    answers = [json.loads(b) for b in bodies]
    if kind == "generate":
        merged_list: list[Any] = []
        for part, ans in zip(parts, answers, strict=True):
            for k, item in enumerate(ans if isinstance(ans, list) else [ans]):
                _reindex(kind, item, part.base + k)
                merged_list.append(item)
        return json.dumps(merged_list).encode()
    merged: dict[str, Any] = dict(answers[0])
    choices: list[Any] = []
    usage: dict[str, int] = {}
    for part, ans in zip(parts, answers, strict=True):
        _reindex(kind, ans, part.base)
        choices += ans.get("choices") or []
        _add_usage(usage, ans.get("usage"), part.counts_prompt)
    merged["choices"] = choices
    if usage:
        merged["usage"] = usage
    return json.dumps(merged).encode()


class StreamMerger:
    """Rewrites the parts' SSE streams into one: ``feed(part, bytes)`` returns the complete events of
    that part with their indexes offset (held back: each part's ``[DONE]`` and usage-only chunks);
    ``finish()`` returns the merged usage chunk, if any, and the one ``[DONE]``."""

    def __init__(self, kind: str, parts: list[Part]) -> None:
        self.kind = kind
        self.parts = parts
        self._buf = [b""] * len(parts)
        self._usage: dict[str, int] = {}
        self._last: dict[str, Any] | None = None

    def feed(self, index: int, data: bytes) -> bytes:
        buf = self._buf[index] + data
        *events, rest = buf.split(b"\n\n")
        self._buf[index] = rest
        out: list[bytes] = []
        for event in events:
            line = event.strip()
            if not line.startswith(b"data:"):
                if line:
                    out.append(event + b"\n\n")
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                out.append(event + b"\n\n")
                continue
            part = self.parts[index]
            if (
                self.kind != "generate"
                and isinstance(obj, dict)
                and not obj.get("choices")
                and "usage" in obj
            ):
                _add_usage(self._usage, obj.get("usage"), part.counts_prompt)
                self._last = obj
                continue
            _reindex(self.kind, obj, part.base)
            out.append(b"data: " + json.dumps(obj).encode() + b"\n\n")
        return b"".join(out)

    def finish(self) -> bytes:
        tail = b""
        if self._last is not None and self._usage:
            tail = b"data: " + json.dumps({**self._last, "usage": self._usage}).encode() + b"\n\n"
        return tail + b"data: [DONE]\n\n"
