"""Request parsing/validation and response shapes of the three generation APIs (pure, no I/O).

``/generate`` follows SGLang's native API; ``/v1/completions`` and ``/v1/chat/completions`` follow
OpenAI's (as vLLM and SGLang serve them). Both PD protocols ride on top-level body fields:
SGLang's ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` and vLLM's ``kv_transfer_params``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

Api = Literal["generate", "completions", "chat"]
# Which engine's request rules apply: "both" is lenient (either router shape works); "sglang" and
# "vllm" add the checks that engine makes, so a router sending the other engine's shape fails.
Flavor = Literal["both", "sglang", "vllm"]

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
# A top-level request field only pdsim reads: the answer's length (tokens per sequence) when the
# model would stop before max_tokens. vLLM's OpenAI request models ignore unknown top-level fields
# and log them (``OpenAIBaseModel``); SGLang's OpenAI request models are pydantic models, which
# ignore them by default. Routers that append to the client's JSON text forward it.
ANSWER_FIELD = "pdsim_answer_tokens"
# The same at the end of the prompt text (the last message's content), for routers that rebuild
# the body and pass no header on either: ``<pdsim-answer-tokens=N>``. To an engine it is text.
ANSWER_MARKER = re.compile(r"<pdsim-answer-tokens=([1-9][0-9]{0,8})>")


def answer_in_prompt(prompt: str) -> int | None:
    """The answer length a prompt's text ends with (``<pdsim-answer-tokens=N>`` in its last 96
    characters: a chat prompt's rendering ends with the assistant's turn), else None."""
    found = ANSWER_MARKER.findall(prompt, max(0, len(prompt) - 96))
    return int(found[-1]) if found else None


# The same as a header, for routers that rebuild the request body from their own model and drop
# fields they do not know (sglang-router) but pass headers on.
ANSWER_HEADER = "X-Pdsim-Answer-Tokens"
# What an answer that stops at its end "matched" in SGLang's meta_info (Llama 3's <|eot_id|>).
EOS_TOKEN_ID = 128009


class BadRequest(Exception):
    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def error_body(message: str, *, err_type: str, code: str | None, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "code": code, "param": param}}


@dataclass(frozen=True, slots=True)
class Limits:
    max_n: int
    context_length: int
    default_max_tokens: int


@dataclass(frozen=True, slots=True)
class GenRequest:
    api: Api
    prompt: str | list[int]
    n: int
    max_tokens: int
    stream: bool
    include_usage: bool
    model: str | None
    rid: str | None
    bootstrap_host: str | None
    bootstrap_port: int | None
    bootstrap_room: int | None
    kv_transfer_params: dict[str, Any] | None
    # The KV rooms this request's prefill fills and its decode pulls: one shared room for an integer
    # bootstrap_room, one per sample for a list of rooms, none without PD fields.
    bootstrap_rooms: tuple[int, ...] = ()
    min_tokens: int = 0
    # A batch of prompts; empty for the usual single ``prompt``.
    prompts: tuple[str | list[int], ...] = ()
    # The request's scheduling priority (SGLang's and vLLM's top-level ``priority``; 0 when absent):
    # orders the waiting queue of an engine that schedules by priority.
    priority: int = 0
    # pdsim's own top-level ``pdsim_answer_tokens``: the length of the answer the model would give
    # (per sequence). The answer ends there with finish_reason "stop", as at an EOS, when it is
    # shorter than ``max_tokens``; the engine's reservations still see only ``max_tokens``.
    answer_tokens: int | None = None

    @property
    def output_tokens(self) -> int:
        """Tokens each sequence generates: ``max_tokens``, or the answer when that ends first."""
        if self.answer_tokens is None:
            return self.max_tokens
        return min(self.max_tokens, self.answer_tokens)

    def finish_reason(self, total: int) -> str:
        """OpenAI's finish_reason of an answer of ``total`` tokens: "stop" when it ended at its
        own end (the answer) before ``max_tokens``, else "length"."""
        if self.answer_tokens is not None and self.answer_tokens <= total < self.max_tokens:
            return "stop"
        return "length"

    @property
    def all_prompts(self) -> tuple[str | list[int], ...]:
        return self.prompts or (self.prompt,)

    @property
    def choices(self) -> int:
        """Sequences this request generates: n per prompt, numbered prompt-major (prompt i, sample j
        is choice ``i * n + j``), as SGLang and OpenAI number a batch's outputs."""
        return self.n * len(self.all_prompts)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _opt_int(body: dict[str, Any], key: str, param: str | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise BadRequest(f"'{param or key}' must be an integer", param=param or key, code="invalid_type")
    return int(v)


def _opt_bool(body: dict[str, Any], key: str, param: str | None = None) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise BadRequest(f"'{param or key}' must be a boolean", param=param or key, code="invalid_type")
    return v


def _check_numbers(body: dict[str, Any], keys: tuple[str, ...], prefix: str = "") -> None:
    for key in keys:
        v = body.get(key)
        if v is not None and not _is_number(v):
            raise BadRequest(f"'{prefix}{key}' must be a number", param=prefix + key, code="invalid_type")


def _token_ids(v: object, param: str) -> list[int] | None:
    if isinstance(v, list) and all(_is_int(x) for x in v):
        if any(x < 0 for x in v):
            raise BadRequest(f"'{param}' token ids must be >= 0", param=param)
        return list(v)
    return None


def _n(value: int | None, limits: Limits, param: str) -> int:
    n = 1 if value is None else value
    if not 1 <= n <= limits.max_n:
        raise BadRequest(f"'{param}' must be between 1 and {limits.max_n}, got {n}", param=param)
    return n


def _max_tokens(value: int | None, limits: Limits, param: str, minimum: int) -> int:
    mt = limits.default_max_tokens if value is None else value
    if mt < minimum:
        raise BadRequest(f"'{param}' must be >= {minimum}, got {mt}", param=param)
    return mt


def _same_for_all(v: object, key: str) -> object:
    """A per-sample list of bootstrap_host/port (as SGLang's batch form allows) must name one prefill."""
    if not isinstance(v, list):
        return v
    if not v or any(x != v[0] for x in v):
        raise BadRequest(
            f"'{key}' as a list must repeat one value: pdsim pairs a request with one prefill", param=key
        )
    return v[0]


def _pd_fields(
    body: dict[str, Any],
) -> tuple[str | None, int | None, int | None, list[int] | None, dict[str, Any] | None]:
    host = _same_for_all(body.get("bootstrap_host"), "bootstrap_host")
    if host is not None and not isinstance(host, str):
        raise BadRequest("'bootstrap_host' must be a string", param="bootstrap_host", code="invalid_type")
    port = _same_for_all(body.get("bootstrap_port"), "bootstrap_port")
    if port is not None and not _is_int(port):
        raise BadRequest("'bootstrap_port' must be an integer", param="bootstrap_port", code="invalid_type")
    if port is not None and not 0 < port <= 65535:  # type: ignore[operator]
        raise BadRequest("'bootstrap_port' must be a TCP port", param="bootstrap_port")
    raw_room = body.get("bootstrap_room")
    room: int | None = None
    rooms: list[int] | None = None
    if isinstance(raw_room, list):
        if not raw_room or not all(_is_int(r) for r in raw_room):
            raise BadRequest(
                "'bootstrap_room' must be an integer or a non-empty list of integers",
                param="bootstrap_room",
                code="invalid_type",
            )
        rooms = list(raw_room)
        if len(set(rooms)) != len(rooms):
            raise BadRequest("'bootstrap_room' list repeats a room", param="bootstrap_room")
        if any(r < 0 for r in rooms):
            raise BadRequest("'bootstrap_room' must be >= 0", param="bootstrap_room")
        room = rooms[0]
    else:
        room = _opt_int(body, "bootstrap_room")
        if room is not None and room < 0:
            raise BadRequest("'bootstrap_room' must be >= 0", param="bootstrap_room")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise BadRequest(
            "'kv_transfer_params' must be an object", param="kv_transfer_params", code="invalid_type"
        )
    return host, port, room, rooms, kv  # type: ignore[return-value]


def _batch_size(api: Api, body: dict[str, Any]) -> int:
    """How many prompts the body carries (SGLang's and OpenAI's list forms); 1 for a single prompt."""
    if api == "generate":
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            return len(text)
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            return len(ids)
        return 1
    if api == "completions":
        p = body.get("prompt")
        if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
            return len(p)
    return 1


def _check_rooms(
    flavor: Flavor,
    room: int | None,
    rooms: list[int] | None,
    n: int,
    batch: int,
    sample_rooms: bool = True,
) -> tuple[int, ...]:
    if flavor == "sglang" and not sample_rooms and n > 1 and (room is not None or rooms is not None):
        # SGLang's tokenizer manager sends every sample of prompt i (and a max_new_tokens=0
        # prefix-caching request before them) with the room of prompt i, whatever the list says.
        raise BadRequest(
            f"n={n} with bootstrap rooms: SGLang sends all {n} samples of a prompt, and a prefix-caching "
            "request before them, through that prompt's one room, which hangs a PD deployment; "
            "send n requests with n=1 instead",
            param="bootstrap_room",
            code="parallel_sampling_in_pd",
        )
    if rooms is not None:
        if len(rooms) != n * batch:
            raise BadRequest(
                f"'bootstrap_room' has {len(rooms)} rooms but the request has {n * batch} samples "
                f"(n={n} x {batch} prompt(s)); send one room per sample",
                param="bootstrap_room",
            )
        return tuple(rooms)
    if room is None:
        return ()
    if flavor == "sglang" and n * batch > 1:
        what = f"n={n}" if batch == 1 else f"a batch of {batch} prompts" + (f" with n={n}" if n > 1 else "")
        raise BadRequest(
            f"'bootstrap_room' is one integer but the request has {what}: SGLang would send every "
            "sample through the same bootstrap room, which hangs a PD deployment (prefill and decode "
            "pair up the wrong transfers); send a list with one distinct room per sample",
            param="bootstrap_room",
            code="shared_bootstrap_room",
        )
    return (room,)


def _min_tokens(
    flavor: Flavor,
    value: int | None,
    max_tokens: int,
    explicit_max: bool,
    prompt_tokens: int,
    limits: Limits,
    param: str,
) -> int:
    if value is None or flavor == "both":
        return 0  # the lenient flavour ignores min_tokens, as before
    if flavor == "vllm":
        # vLLM's SamplingParams check; with no max_tokens vLLM fills in the rest of the context.
        limit = max_tokens if explicit_max else limits.context_length - prompt_tokens
        if value < 0:
            raise BadRequest(f"min_tokens must be greater than or equal to 0, got {value}.", param=param)
        if value > limit:
            raise BadRequest(
                f"min_tokens must be less than or equal to max_tokens={limit}, got {value}.", param=param
            )
        return value
    if not 0 <= value <= max_tokens:
        # SGLang's SamplingParams.verify wording.
        raise BadRequest(
            f"min_new_tokens must be in [0, max_new_tokens({max_tokens})], got {value}.", param=param
        )
    return value


def _check_context(prompt_tokens: int, max_tokens: int, limits: Limits, param: str) -> None:
    if prompt_tokens + max_tokens > limits.context_length:
        raise BadRequest(
            f"This model's maximum context length is {limits.context_length} tokens; the request has "
            f"{prompt_tokens} prompt tokens and asks for {max_tokens} more",
            param=param,
            code="context_length_exceeded",
        )


def parse_request(
    api: Api,
    body: object,
    limits: Limits,
    *,
    prompt_tokens_of: Any,
    flavor: Flavor = "both",
    sample_rooms: bool = True,
) -> GenRequest:
    """Validate ``body`` for ``api``; raises :class:`BadRequest` with an OpenAI-style message."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_type")
    host, port, room, room_list, kv = _pd_fields(body)
    batch = _batch_size(api, body)
    if batch > 1 and (room is not None):
        # Say why a shared room is wrong before saying that pdsim serves no batches.
        sp = body.get("sampling_params") if api == "generate" else body
        n_raw = sp.get("n") if isinstance(sp, dict) else None
        n_guess = n_raw if isinstance(n_raw, int) and not isinstance(n_raw, bool) and n_raw > 0 else 1
        _check_rooms(flavor, room, room_list, n_guess, batch)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model", code="invalid_type")
    stream = _opt_bool(body, "stream") or False
    rid: str | None = None
    include_usage = False
    prompts: list[str | list[int]]
    # Lists of prompts: SGLang serves them on /generate and /v1/completions, vLLM on /v1/completions
    # (its CompletionRequest.prompt is str | list[str] | list[int] | list[list[int]]); the lenient
    # flavour takes either.
    batch_ok = flavor != "vllm" or api == "completions"
    if api == "generate":
        rid_v = body.get("rid")
        if batch_ok and isinstance(rid_v, list) and rid_v and all(isinstance(r, str) for r in rid_v):
            # SGLang's batch form: one rid per prompt (pdsim answers under the first).
            if len(rid_v) != batch:
                raise BadRequest(f"'rid' has {len(rid_v)} ids for {batch} prompt(s)", param="rid")
            rid_v = rid_v[0]
        if rid_v is not None and not isinstance(rid_v, str):
            raise BadRequest("'rid' must be a string", param="rid", code="invalid_type")
        rid = rid_v
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadRequest(
                "exactly one of 'text' or 'input_ids' is required", param="text", code="missing_field"
            )
        if text is not None:
            if isinstance(text, str):
                prompts = [text]
            elif batch_ok and isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                prompts = list(text)
            else:
                raise BadRequest("'text' must be a string (batches are not supported)", param="text")
        else:
            parsed = _token_ids(ids, "input_ids")
            if parsed is not None:
                prompts = [parsed]
            elif batch_ok and isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
                batch_ids = [_token_ids(x, "input_ids") for x in ids]
                if any(b is None for b in batch_ids):
                    raise BadRequest(
                        "'input_ids' must be lists of integers", param="input_ids", code="invalid_type"
                    )
                prompts = [b for b in batch_ids if b is not None]
            else:
                raise BadRequest(
                    "'input_ids' must be a list of integers", param="input_ids", code="invalid_type"
                )
        sp = body.get("sampling_params", {})
        if sp is None:
            sp = {}
        if not isinstance(sp, dict):
            raise BadRequest(
                "'sampling_params' must be an object", param="sampling_params", code="invalid_type"
            )
        _check_numbers(sp, ("temperature", "top_p", "top_k"), "sampling_params.")
        n = _n(_opt_int(sp, "n", "sampling_params.n"), limits, "sampling_params.n")
        given_max = _opt_int(sp, "max_new_tokens", "sampling_params.max_new_tokens")
        max_tokens = _max_tokens(given_max, limits, "sampling_params.max_new_tokens", 0)
        param = "sampling_params.max_new_tokens"
        min_param = "sampling_params.min_new_tokens"
        min_given = _opt_int(sp, "min_new_tokens", min_param) if flavor != "both" else None
    else:
        _check_numbers(body, ("temperature", "top_p", "presence_penalty", "frequency_penalty"))
        so = body.get("stream_options")
        if so is not None:
            if not isinstance(so, dict):
                raise BadRequest(
                    "'stream_options' must be an object", param="stream_options", code="invalid_type"
                )
            include_usage = _opt_bool(so, "include_usage", "stream_options.include_usage") or False
        n = _n(_opt_int(body, "n"), limits, "n")
        if api == "completions":
            prompts = _completion_prompts(body.get("prompt"), batch_ok)
            if flavor == "vllm" and len(prompts) > 1 and kv is not None:
                # vLLM runs each prompt with the request's kv_transfer_params but answers with the
                # first prompt's only: a decode leg would read one prompt's KV for every prompt.
                raise BadRequest(
                    f"a batch of {len(prompts)} prompts with 'kv_transfer_params': vLLM returns the "
                    "first prompt's transfer parameters only, so decode would pair every prompt with "
                    "one prompt's KV; send one prompt per PD request",
                    param="kv_transfer_params",
                    code="batch_with_kv_transfer_params",
                )
            param = "max_tokens"
            mt = _opt_int(body, "max_tokens")
        else:
            prompts = [_chat_prompt(body.get("messages"))]
            mct = _opt_int(body, "max_completion_tokens")
            param = "max_completion_tokens" if mct is not None else "max_tokens"
            mt = mct if mct is not None else _opt_int(body, "max_tokens")
        given_max = mt
        max_tokens = _max_tokens(mt, limits, param, 1)
        min_param = "min_tokens"
        min_given = _opt_int(body, "min_tokens") if flavor != "both" else None
    each = [prompt_tokens_of(p) for p in prompts]
    if min(each) == 0:
        raise BadRequest("the prompt must not be empty", param="prompt" if api != "generate" else "text")
    prompt_tokens = max(each)
    _check_context(prompt_tokens, max_tokens, limits, param)
    min_tokens = _min_tokens(
        flavor, min_given, max_tokens, given_max is not None, prompt_tokens, limits, min_param
    )
    rooms = _check_rooms(flavor, room, room_list, n, len(prompts), sample_rooms)
    priority = _opt_int(body, "priority") or 0
    answer = _opt_int(body, ANSWER_FIELD)
    if answer is not None and answer < 1:
        raise BadRequest(f"{ANSWER_FIELD} must be at least 1, got {answer}", param=ANSWER_FIELD)
    if answer is None and isinstance(prompts[0], str):
        answer = answer_in_prompt(prompts[0])
    return GenRequest(
        api=api,
        prompt=prompts[0],
        prompts=tuple(prompts) if len(prompts) > 1 else (),
        n=n,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        model=model,
        rid=rid,
        bootstrap_host=host,
        bootstrap_port=port,
        bootstrap_room=room,
        kv_transfer_params=kv,
        bootstrap_rooms=rooms,
        min_tokens=min_tokens,
        priority=priority,
        answer_tokens=answer,
    )


def _completion_prompts(v: object, batch_ok: bool) -> list[str | list[int]]:
    if batch_ok and isinstance(v, list) and len(v) > 1:
        if all(isinstance(x, str) for x in v):
            return list(v)
        if all(isinstance(x, list) for x in v):
            out: list[str | list[int]] = []
            for x in v:
                ids = _token_ids(x, "prompt")
                if not ids:
                    raise BadRequest(
                        "'prompt' lists must hold token ids", param="prompt", code="invalid_type"
                    )
                out.append(ids)
            return out
    return [_completion_prompt(v)]


def _completion_prompt(v: object) -> str | list[int]:
    if v is None:
        raise BadRequest("'prompt' is required", param="prompt", code="missing_field")
    if isinstance(v, str):
        return v
    ids = _token_ids(v, "prompt")
    if ids is not None and ids:
        return ids
    if isinstance(v, list) and len(v) == 1:
        inner = v[0]
        if isinstance(inner, str):
            return inner
        ids = _token_ids(inner, "prompt")
        if ids is not None:
            return ids
    raise BadRequest(
        "'prompt' must be a string, a list of token ids, or a list of either (a batch)",
        param="prompt",
        code="invalid_type",
    )


def _chat_prompt(v: object) -> str:
    if v is None:
        raise BadRequest("'messages' is required", param="messages", code="missing_field")
    if not isinstance(v, list) or not v:
        raise BadRequest("'messages' must be a non-empty list", param="messages", code="invalid_type")
    parts: list[str] = []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"'{p}' must be an object", param=p, code="invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise BadRequest(f"'{p}.role' must be one of {sorted(CHAT_ROLES)}", param=f"{p}.role")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            pieces: list[str] = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise BadRequest(
                        f"'{p}.content[{j}]' must be an object with a 'type'",
                        param=f"{p}.content",
                        code="invalid_type",
                    )
                if part["type"] == "text":
                    t = part.get("text")
                    if not isinstance(t, str):
                        raise BadRequest(f"'{p}.content[{j}].text' must be a string", param=f"{p}.content")
                    pieces.append(t)
            text = "".join(pieces)
        else:
            raise BadRequest(
                f"'{p}.content' must be a string or a list", param=f"{p}.content", code="invalid_type"
            )
        parts.append(f"<|{role}|>{text}\n")
    # The assistant header the chat template would append before generation.
    parts.append("<|assistant|>")
    return "".join(parts)


def token_text(k: int) -> str:
    """The k-th generated token (1-based): deterministic, so tests can check the exact output."""
    return f" tok{k}"


def completion_text(num_tokens: int) -> str:
    return "".join(token_text(k) for k in range(1, num_tokens + 1))


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Formatter:
    """Builds the response (or the stream's chunks) of one request in its API's shape."""

    req: GenRequest
    rid: str
    created: int
    model: str
    prompt_tokens: int  # over all prompts of a batch
    cached_tokens: int
    # (prompt tokens, cached tokens) of each prompt of a batch, for SGLang's per-output meta_info.
    per_prompt: tuple[tuple[int, int], ...] = ()
    _text: str = ""

    def _usage(self, completion_tokens: int) -> dict[str, Any]:
        total_completion = completion_tokens * self.req.choices
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": total_completion,
            "total_tokens": self.prompt_tokens + total_completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _meta(self, k: int, finished: bool, choice: int) -> dict[str, Any]:
        pt, ct = (
            self.per_prompt[choice // self.req.n]
            if self.per_prompt
            else (self.prompt_tokens, self.cached_tokens)
        )
        return {
            "id": self.rid,
            "prompt_tokens": pt,
            "completion_tokens": k,
            "cached_tokens": ct,
            "finish_reason": self._sglang_reason(k) if finished else None,
        }

    def _sglang_reason(self, k: int) -> dict[str, Any]:
        if self.req.finish_reason(k) == "stop":
            return {"type": "stop", "matched": EOS_TOKEN_ID}
        return {"type": "length", "length": k}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.req.api == "chat" else "text_completion"
        out: dict[str, Any] = {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.req.include_usage:
            out["usage"] = None
        return out

    def start_chunks(self) -> Iterator[dict[str, Any]]:
        if self.req.api == "chat":
            for i in range(self.req.choices):
                delta = {"role": "assistant", "content": ""}
                yield self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])

    def token_chunks(self, k: int, total: int) -> Iterator[dict[str, Any]]:
        """Chunks for the k-th token (1-based) of ``total``; ``k == 0`` only when ``total == 0``."""
        finished = k == total
        tok = token_text(k) if k else ""
        self._text += tok
        for i in range(self.req.choices):
            if self.req.api == "generate":
                chunk: dict[str, Any] = {"text": self._text, "meta_info": self._meta(k, finished, i)}
                if self.req.choices > 1:
                    chunk["index"] = i
                yield chunk
            elif self.req.api == "completions":
                fr = self.req.finish_reason(k) if finished else None
                yield self._chunk([{"index": i, "text": tok, "logprobs": None, "finish_reason": fr}])
            else:
                yield self._chunk(
                    [{"index": i, "delta": {"content": tok}, "logprobs": None, "finish_reason": None}]
                )

    def end_chunks(self, total: int) -> Iterator[dict[str, Any]]:
        if self.req.api == "chat":
            for i in range(self.req.choices):
                fr = self.req.finish_reason(total)
                yield self._chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": fr}])
        if self.req.api != "generate" and self.req.include_usage:
            yield {**self._chunk([]), "usage": self._usage(total)}

    def full_response(self, total: int, extra: dict[str, Any] | None) -> Any:
        text = completion_text(total)
        if self.req.api == "generate":
            items = [
                {
                    "text": text,
                    "meta_info": self._meta(total, True, i),
                    **({"index": i} if self.req.choices > 1 else {}),
                }
                for i in range(self.req.choices)
            ]
            out: Any = items[0] if self.req.choices == 1 else items
            if extra and isinstance(out, dict):
                out = {**out, **extra}
            return out
        if self.req.api == "completions":
            choices: list[dict[str, Any]] = [
                {"index": i, "text": text, "logprobs": None, "finish_reason": self.req.finish_reason(total)}
                for i in range(self.req.choices)
            ]
            obj = "text_completion"
        else:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": self.req.finish_reason(total),
                }
                for i in range(self.req.choices)
            ]
            obj = "chat.completion"
        resp: dict[str, Any] = {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(total),
        }
        if extra:
            resp.update(extra)
        return resp
