"""Parse and validate client requests (pure): every refusal names the offending field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any


class InvalidRequest(Exception):
    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code or ("model_not_found" if status == 404 else "invalid_request")


@dataclass(frozen=True)
class Limits:
    max_n: int = 16
    max_tokens: int = 32768
    model: str | None = None
    max_batch: int = 64  # prompts in one batch request


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion" | "generate"
    body: dict[str, Any]
    n: int
    stream: bool
    max_tokens: int | None
    prompt_text: str  # the (first) prompt, for the prefix estimate
    input_ids: list[int] | None
    prompts: list[str | list[int]] | None = None  # a batch: one entry per prompt

    @property
    def slots(self) -> int:
        """Decode slots the request needs at once: n per prompt."""
        return self.n * (len(self.prompts) if self.prompts is not None else 1)


def _int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise InvalidRequest(f"'{name}' must be an integer, got {type(value).__name__}", param=name)
    if not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return value


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> None:
    if name not in body or body[name] is None:
        return
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise InvalidRequest(f"'{name}' must be a number", param=name)
    if not lo <= v <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo:g} and {hi:g}, got {v}", param=name)


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise InvalidRequest(f"'{name}' must be a boolean", param=name)
    return v


def _token_ids(v: Any, name: str) -> list[int] | None:
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        if any(t < 0 or t >= 2**31 for t in v):
            raise InvalidRequest(f"'{name}' token ids must be in [0, 2^31)", param=name)
        return list(v)
    return None


def decode_json(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_model(body: dict[str, Any], limits: Limits, required: bool) -> None:
    model = body.get("model")
    if model is None:
        if required:
            raise InvalidRequest("'model' is required", param="model")
        return
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", param="model")
    if limits.model is not None and model != limits.model:
        raise InvalidRequest(
            f"The model '{model}' does not exist; this endpoint serves '{limits.model}'",
            param="model",
            status=404,
        )


def _common(body: dict[str, Any], limits: Limits) -> tuple[int, bool, int | None]:
    n = _int(body["n"], "n", 1, limits.max_n) if body.get("n") is not None else 1
    stream = _bool(body, "stream")
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None:
            max_tokens = _int(body[name], name, 1, limits.max_tokens)
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    if so is not None and not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return n, stream, max_tokens


def parse_chat(raw: bytes, limits: Limits) -> ParsedRequest:
    body = decode_json(raw)
    _check_model(body, limits, required=False)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    parts: list[str] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(
                f"'messages[{i}]' must be an object with a string 'role'", param=f"messages[{i}]"
            )
        content = m.get("content")
        if isinstance(content, str):
            parts.append(f"{m['role']}: {content}\n")
        elif isinstance(content, list):
            for j, c in enumerate(content):
                if not isinstance(c, dict) or not isinstance(c.get("type"), str):
                    raise InvalidRequest(
                        f"'messages[{i}].content[{j}]' must be an object with a 'type'",
                        param=f"messages[{i}].content",
                    )
                if c["type"] == "text":
                    if not isinstance(c.get("text"), str):
                        raise InvalidRequest(
                            f"'messages[{i}].content[{j}].text' must be a string",
                            param=f"messages[{i}].content",
                        )
                    parts.append(f"{m['role']}: {c['text']}\n")
        elif content is not None:
            raise InvalidRequest(
                f"'messages[{i}].content' must be a string or an array", param=f"messages[{i}]"
            )
    n, stream, max_tokens = _common(body, limits)
    return ParsedRequest("chat", body, n, stream, max_tokens, "".join(parts), None)


def _batch(items: list[Any], name: str, limits: Limits) -> list[str | list[int]]:
    """A list of prompts: strings or arrays of token ids."""
    if len(items) > limits.max_batch:
        raise InvalidRequest(
            f"'{name}' holds {len(items)} prompts, at most {limits.max_batch} per request", param=name
        )
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(item)
            continue
        ids = _token_ids(item, f"{name}[{i}]")
        if ids is None:
            raise InvalidRequest(
                f"'{name}[{i}]' must be a string or a non-empty array of token ids", param=name
            )
        out.append(ids)
    return out


def parse_completion(raw: bytes, limits: Limits) -> ParsedRequest:
    body = decode_json(raw)
    _check_model(body, limits, required=False)
    prompt = body.get("prompt")
    ids = _token_ids(prompt, "prompt")
    batch: list[str | list[int]] | None = None
    if ids is None:
        if isinstance(prompt, list) and len(prompt) == 1:
            ids = _token_ids(prompt[0], "prompt")
            prompt = prompt[0] if ids is None else prompt
        if isinstance(prompt, list) and len(prompt) > 1:
            batch = _batch(prompt, "prompt", limits)
            prompt = batch[0]
            ids = prompt if isinstance(prompt, list) else None
        if ids is None and not isinstance(prompt, str):
            raise InvalidRequest(
                "'prompt' must be a string, an array of token ids, or an array of those (a batch)",
                param="prompt",
            )
    n, stream, max_tokens = _common(body, limits)
    text = prompt if isinstance(prompt, str) else ""
    return ParsedRequest("completion", body, n, stream, max_tokens, text, ids, batch)


def parse_generate(raw: bytes, limits: Limits) -> ParsedRequest:
    body = decode_json(raw)
    text = body.get("text")
    raw_ids = body.get("input_ids")
    batch: list[str | list[int]] | None = None
    ids = _token_ids(raw_ids, "input_ids")
    if ids is None and isinstance(raw_ids, list) and raw_ids and all(isinstance(x, list) for x in raw_ids):
        batch = _batch(raw_ids, "input_ids", limits) if len(raw_ids) > 1 else None
        ids = _token_ids(raw_ids[0], "input_ids")
    if ids is None and raw_ids is not None:
        raise InvalidRequest("'input_ids' must be a non-empty array of token ids", param="input_ids")
    if ids is None and isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        batch = _batch(text, "text", limits) if len(text) > 1 else None
        text = text[0]
    if ids is None and not isinstance(text, str):
        raise InvalidRequest(
            "'text' (a string or an array of strings) or 'input_ids' is required", param="text"
        )
    sp = body.get("sampling_params", {})
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise InvalidRequest("'sampling_params' must be an object", param="sampling_params")
    n = _int(sp["n"], "sampling_params.n", 1, limits.max_n) if sp.get("n") is not None else 1
    max_tokens = None
    if sp.get("max_new_tokens") is not None:
        max_tokens = _int(sp["max_new_tokens"], "sampling_params.max_new_tokens", 1, limits.max_tokens)
    _number(sp, "temperature", 0.0, 100.0)
    stream = _bool(body, "stream")
    text = text if isinstance(text, str) else ""
    if batch is None and (isinstance(body.get("text"), list) or _nested(raw_ids)):
        # a batch of one: the engines get the plain form
        body = {**body, "text": text} if isinstance(body.get("text"), list) else {**body, "input_ids": ids}
    return ParsedRequest("generate", body, n, stream, max_tokens, text, ids, batch)


def _nested(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and isinstance(v[0], list)
