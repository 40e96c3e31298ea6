"""The load generator of the demo, the cluster tests and the benchmarks.

One request mix (:class:`RequestMix`): multi-turn sessions (``X-Session-Id``, the conversation
grows), cold prompts, shared-prefix prompts (a few long system prompts reused) and gangs (``n`` > 1),
seeded per user. One outcome type (:class:`Outcome`): every request ends with a status, an explicit
error or, when it does not end within ``request_timeout_s``, as a hang.

Drivers:

* :class:`ClosedLoop` (asyncio): ``users`` clients, each sending one request and waiting for its end.
  Like the OpenAI SDK, a client that is refused (429/503) waits before its next request, following
  the master's ``Retry-After`` (capped by ``max_backoff_s``, jittered); without that every refusal
  came straight back and a failover turned into thousands of 429s a second. With ``lb_retry`` a
  request that nothing processed (connection refused, a draining master's 503) is retried on another
  target, as a load balancer in front of the masters does.
* :class:`DirectPD`: the same clients doing the SGLang PD dance themselves, as a router would (the
  benchmarks' "direct" baseline).
* :class:`BackgroundLoad`: a ClosedLoop on its own event loop in a thread, so a test or the demo can
  kill and restart processes synchronously while requests are in flight.
* :class:`OpenLoop`: open-loop load that looks like production (arrivals do not wait for answers):
  Poisson or trace arrivals under a rate :class:`~pdcoord.dev.workload.Schedule`, multi-turn synthetic
  sessions or a Mooncake trace replay (:mod:`pdcoord.dev.workload`), every request a streamed chat
  completion through a sticky :class:`~pdcoord.dev.workload.Balancer`, one :class:`RequestRecord`
  each; :func:`summarize` turns them into goodput, attainment and per-class latency.
* ``python -m pdcoord.dev.loadgen``: the peer benchmarks' load in its own process (so its CPU is not
  the router's), printing ``START``/``END`` around the measured load and then one JSON line.
  ``python -m pdcoord.dev.loadgen open …`` does the same for the open-loop load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdcoord.dev.workload import (
    Arrival,
    Balancer,
    Schedule,
    SyntheticConfig,
    Target,
    Turn,
    corpus,
    load_trace,
    parse_targets,
    synthetic_arrivals,
    trace_arrivals,
    trace_span,
)

HANG = -1  # status of a request that did not end within the client's timeout
# pdsim's top-level field for the answer the model would give (pdsim/protocol.py: ANSWER_FIELD)
ANSWER_FIELD = "pdsim_answer_tokens"


def with_answer_marker(messages: list[dict[str, Any]], answer: int) -> list[dict[str, Any]]:
    """The messages with the last one's content ending in pdsim's answer marker, which replaces as
    many characters (the prompt keeps its length in tokens)."""
    marker = f"<pdsim-answer-tokens={answer}>"
    last = dict(messages[-1])
    content = str(last.get("content", ""))
    last["content"] = (content[: -len(marker)] if len(content) > len(marker) else content) + marker
    return [*messages[:-1], last]


CONN_FAILED = 0  # status of a request whose connection failed or broke

SHARED_PREFIXES = [
    ("You are a meticulous assistant for a logistics company. Answer with numbered steps. " * 6),
    ("System: you translate technical documentation between English and German precisely. " * 6),
    ("Context: the following is a customer support transcript for a cloud storage product. " * 6),
]
FILLER = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
          "quietly", "judge", "boxing"]  # fmt: skip

Targets = Callable[[], Sequence[tuple[str, str]]]  # the (name, base_url) pairs to send to now


# ---------------------------------------------------------------------------- requests


@dataclass
class Request:
    kind: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class RequestMix:
    # relative weights of the request kinds: session, cold, shared_prefix, gang
    weights: dict[str, float] = field(
        default_factory=lambda: {"session": 0.35, "cold": 0.25, "shared_prefix": 0.3, "gang": 0.1}
    )
    max_tokens: int = 16
    gang_n: int = 4
    stream_fraction: float = 0.7
    model: str = "sim"
    # Random words appended to cold prompts: the benchmarks' ~64-word prompts that no prefix cache
    # can shortcut.
    prompt_words: int = 0

    def requests(self, rng: random.Random, tag: str) -> Iterator[Request]:
        """One client's endless stream of requests; a session's turns come one after another."""
        kinds, weights = zip(*self.weights.items(), strict=True)
        while True:
            kind = rng.choices(kinds, weights)[0]
            if kind == "session":
                sid = f"s-{tag}-{rng.getrandbits(32):x}"
                history: list[dict[str, str]] = []
                for turn in range(rng.randint(2, 4)):
                    history.append({"role": "user", "content": f"turn {turn} of {sid}: tell me more"})
                    body = {"model": self.model, "messages": list(history), "max_tokens": self.max_tokens,
                            "stream": rng.random() < self.stream_fraction}  # fmt: skip
                    yield Request(kind, "/v1/chat/completions", body, {"X-Session-Id": sid})
                    history.append({"role": "assistant", "content": "ok " * 8})
                continue
            n = 1
            if kind == "shared_prefix":
                prompt = rng.choice(SHARED_PREFIXES) + f" Question {rng.randint(0, 10**6)}?"
            elif kind == "gang":
                prompt = f"Write {self.gang_n} alternative slogans for product {rng.getrandbits(40):x}."
                n = self.gang_n
            else:
                tag64, day = rng.getrandbits(64), rng.randint(1, 9999)
                prompt = f"Cold prompt {tag64:x}: summarise the news of day {day}."
                if self.prompt_words:
                    prompt += " " + " ".join(rng.choice(FILLER) for _ in range(self.prompt_words))
            body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "n": n,
                    "stream": rng.random() < self.stream_fraction}  # fmt: skip
            yield Request(kind, "/v1/completions", body)


# ---------------------------------------------------------------------------- outcomes


@dataclass
class Outcome:
    kind: str
    master: str  # the target that gave the final answer
    status: int  # HTTP status; CONN_FAILED when the connection failed, HANG on a client-side timeout
    started: float  # time.monotonic() when the (first) attempt was sent
    ended: float
    klass: str = ""  # X-Admission-Class
    wait_ms: float = 0.0  # X-Admission-Wait-Ms
    error: str = ""
    streamed_events: int = 0
    first_event: float = 0.0  # time.monotonic() of the first streamed event, 0 when there was none
    retry_after_s: float | None = None  # the refusal's Retry-After, None when it had none
    attempts: list[str] = field(default_factory=list)  # targets tried, in order
    retried_because: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def explicit(self) -> bool:
        """Ended with a result or an error the client saw; not a hang."""
        return self.status != HANG

    @property
    def retry_after(self) -> bool:
        return self.retry_after_s is not None

    @property
    def latency_s(self) -> float:
        return self.ended - self.started

    def overlaps(self, t: float) -> bool:
        return self.started <= t <= self.ended


def error_kind(status: int, body: bytes) -> str:
    """The ``code`` (else ``type``) of an OpenAI-style error body, else the status."""
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("code") or err.get("type") or status)
    except (ValueError, AttributeError):
        return str(status)


def _is_draining_refusal(status: int, body: bytes) -> bool:
    if status != 503:
        return False
    try:
        message = str(json.loads(body).get("error", {}).get("message", ""))
    except (ValueError, AttributeError):
        return False
    return "shutting down" in message


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return 0.0


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank *q*-th percentile (0-100), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


# ---------------------------------------------------------------------------- drivers


@dataclass
class LoadConfig:
    users: int = 16
    duration_s: float | None = None  # None: until stop()
    seed: int = 1
    request_timeout_s: float = 30.0
    mix: RequestMix = field(default_factory=RequestMix)
    # Wait after a refusal: Retry-After (or 0.2 s without one) capped here; 0 disables waiting.
    max_backoff_s: float = 0.5
    lb_retry: bool = False
    max_attempts: int = 3
    # A fresh connection per request: a refused connect then means "nothing was sent", never a
    # stale pooled connection that the server closed in between.
    fresh_connections: bool = False


@dataclass
class _Attempt:
    status: int
    error: str = ""
    retry_after_s: float | None = None
    retriable: bool = False  # nothing was processed: a load balancer may send it elsewhere
    klass: str = ""
    wait_ms: float = 0.0
    events: int = 0
    first_event: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


class ClosedLoop:
    """``users`` closed-loop clients over ``targets()`` (re-read for every request)."""

    def __init__(self, targets: Targets, cfg: LoadConfig) -> None:
        self.targets = targets
        self.cfg = cfg
        self.outcomes: list[Outcome] = []
        self.stop_event = threading.Event()  # a threading.Event so another thread can stop the load
        self._lock = threading.Lock()
        self._rr = 0

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def _pick(self, avoid: Iterable[str] = ()) -> tuple[str, str] | None:
        ts = list(self.targets())
        avoid = set(avoid)
        preferred = [t for t in ts if t[0] not in avoid] or ts
        if not preferred:
            return None
        self._rr += 1
        return preferred[self._rr % len(preferred)]

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[aiohttp.ClientSession]:
        if self.cfg.fresh_connections:
            connector = aiohttp.TCPConnector(limit=0, force_close=True)
        else:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as s:
            yield s

    async def _read(self, resp: aiohttp.ClientResponse, stream: bool, at: _Attempt) -> None:
        if stream:
            done = False
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                at.events += 1
                if not at.first_event:
                    at.first_event = time.monotonic()
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                elif payload.startswith(b'{"error"'):
                    at.error = "stream_error"
            if not done and not at.error:
                at.error = "stream_truncated"  # the stream ended without [DONE]
            return
        try:
            data = await resp.json(content_type=None)
        except ValueError:
            data = None
        if not isinstance(data, dict) or not data.get("choices"):
            at.error = "bad_body"

    async def _attempt(self, http: aiohttp.ClientSession, base: str, req: Request) -> _Attempt:
        try:
            async with http.post(base + req.path, json=req.body, headers=req.headers) as resp:
                at = _Attempt(resp.status, retry_after_s=_retry_after(resp.headers.get("Retry-After")))
                at.klass = resp.headers.get("X-Admission-Class", "")
                at.wait_ms = float(resp.headers.get("X-Admission-Wait-Ms", "0") or 0)
                if resp.status != 200:
                    raw = await resp.read()
                    at.error = error_kind(resp.status, raw)
                    at.retriable = _is_draining_refusal(resp.status, raw)
                    return at
                await self._read(resp, bool(req.body.get("stream")), at)
                return at
        except aiohttp.ClientConnectorError as exc:  # nothing was sent
            return _Attempt(CONN_FAILED, type(exc).__name__, retriable=True)
        except (aiohttp.ClientError, OSError) as exc:
            return _Attempt(CONN_FAILED, type(exc).__name__)

    async def request(self, http: aiohttp.ClientSession, req: Request) -> Outcome | None:
        """Send *req* (retrying elsewhere with ``lb_retry``); None when there is no target to send to."""
        pick = self._pick()
        if pick is None:
            await asyncio.sleep(0.05)
            return None
        name, base = pick
        started = time.monotonic()
        out = Outcome(req.kind, name, HANG, started, started, error="hang", attempts=[name])
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                while True:
                    at = await self._attempt(http, base, req)
                    out.master, out.status, out.error = name, at.status, at.error
                    out.retry_after_s, out.klass, out.wait_ms = at.retry_after_s, at.klass, at.wait_ms
                    out.streamed_events, out.first_event = at.events, at.first_event
                    if not (self.cfg.lb_retry and at.retriable and len(out.attempts) < self.cfg.max_attempts):
                        break
                    out.retried_because.append(f"{name}: {at.error}")
                    nxt = self._pick(avoid=out.attempts)
                    if nxt is None:
                        break
                    name, base = nxt
                    out.master = name  # a hang on the next target is that target's
                    out.attempts.append(name)
        except TimeoutError:
            out.status, out.error = HANG, "hang"
        out.ended = time.monotonic()
        with self._lock:
            self.outcomes.append(out)
        return out

    async def _back_off(self, out: Outcome, rng: random.Random) -> None:
        cap = self.cfg.max_backoff_s
        if cap <= 0:
            return
        if out.status in (429, 503):
            wait = min(out.retry_after_s or 0.2, cap)
        elif out.status == CONN_FAILED:  # connection refused or reset: the next pick may be another target
            wait = min(0.05, cap)
        else:
            return
        await asyncio.sleep(wait * rng.uniform(0.5, 1.0))

    async def user(self, http: aiohttp.ClientSession, uid: int, until: float) -> None:
        rng = random.Random(self.cfg.seed * 1000 + uid)
        for req in self.cfg.mix.requests(rng, f"{self.cfg.seed}-{uid}"):
            if self.stop_event.is_set() or time.monotonic() >= until:
                return
            out = await self.request(http, req)
            if out is not None:
                await self._back_off(out, rng)

    async def run(self) -> list[Outcome]:
        """Run until ``duration_s`` has passed (or ``stop_event`` is set); every outcome."""
        until = time.monotonic() + (self.cfg.duration_s if self.cfg.duration_s is not None else float("inf"))
        async with self.session() as http:
            await asyncio.gather(*(self.user(http, i, until) for i in range(self.cfg.users)))
        return self.snapshot()


class DirectPD(ClosedLoop):
    """Clients that talk to one SGLang-style prefill/decode pair themselves, as a router would: the
    same body with a fresh ``bootstrap_room`` goes to P (response read and dropped) and to D (read
    as the answer) at once."""

    def __init__(self, prefill: str, decode: str, bootstrap_port: int, cfg: LoadConfig) -> None:
        super().__init__(lambda: [("direct", decode)], cfg)
        self.prefill = prefill
        self.bootstrap_port = bootstrap_port

    async def _attempt(self, http: aiohttp.ClientSession, base: str, req: Request) -> _Attempt:
        body = {**req.body, "bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": random.getrandbits(63)}  # fmt: skip

        async def prefill() -> int:
            async with http.post(self.prefill + req.path, json=body) as r:
                await r.read()
                return r.status

        p = asyncio.create_task(prefill())
        try:
            at = await super()._attempt(http, base, Request(req.kind, req.path, body, req.headers))
            p_status = await p
        except BaseException:
            p.cancel()
            raise
        if p_status != 200 and at.ok:
            at.error = f"prefill_http_{p_status}"
        return at


class BackgroundLoad:
    """A :class:`ClosedLoop` on its own event loop in a background thread."""

    def __init__(self, targets: Targets, cfg: LoadConfig) -> None:
        self.loop = ClosedLoop(targets, cfg)
        self.cfg = cfg
        self._thread: threading.Thread | None = None

    def start(self) -> BackgroundLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self.loop.run()), daemon=True, name="load")
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> list[Outcome]:
        """Stop sending; wait for every request to end (bounded by the request timeout)."""
        self.loop.stop_event.set()
        self.join(self.cfg.request_timeout_s * self.cfg.max_attempts + 10)
        assert not self.running, "load thread did not finish: a request outlived its timeout"
        return self.snapshot()

    def snapshot(self) -> list[Outcome]:
        return self.loop.snapshot()

    def wait_for_results(self, n: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.snapshot()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.snapshot())} of {n} requests ended within {timeout}s")
            time.sleep(0.05)


# ---------------------------------------------------------------------------- open loop


@dataclass
class OpenLoopConfig:
    """Times are engine seconds: the driver stretches them by ``time_scale`` (engines that run K
    times slower than the real ones they stand for see the load K times slower too)."""

    duration_s: float = 60.0  # arrivals (and later turns of sessions) start within this window
    request_timeout_s: float = 120.0  # from the first send to the end; then HANG, connection closed
    retry_refused: bool = False  # resend a 429/503 once after its Retry-After (1 s without one)
    # The balancer passes a request that a router answered 429 or 503 to the next router at once, up to
    # this many more (nginx: proxy_next_upstream http_429 http_503 non_idempotent; tries = 1 + this).
    next_upstream: int = 0
    time_scale: float = 1.0
    model: str = "pdsim-model"
    connection_limit: int = 1024
    # Ask for the usage chunk: the output token count then comes from the server, not from counting
    # content chunks (a real engine may put several tokens in one chunk).
    include_usage: bool = True
    # Also write an answer's length at the end of the prompt (``<pdsim-answer-tokens=N>``, replacing
    # as many characters): for routers that drop the field (sglang-router rebuilds the body).
    answer_in_prompt: bool = False


@dataclass
class RequestRecord:
    """One request of an open-loop run. Times are wall-clock seconds (``t_*`` from the run's start);
    :func:`summarize` divides them by the time scale."""

    seq: int  # arrival order of the turn
    kind: str  # "trace" | "synthetic"
    target: str
    t_sched: float  # when it was due (send lag = t_send - t_sched: the load generator's health)
    t_send: float
    t_end: float
    ttft_s: float | None  # first content token of any choice, from t_send (None: no token)
    tpot_s: float | None  # worst choice's (last token - first token) / (tokens - 1); None below 2 tokens
    status: int  # HTTP status; CONN_FAILED (0) before a status; HANG (-1) past the request timeout
    error_code: str = ""  # the error envelope's / SSE error event's code (else type), "stream_truncated"
    error_type: str = ""
    retry_after_s: float | None = None
    retried: bool = False  # refused, then sent again once (retry_refused)
    passed_on: int = 0  # refused, then passed to another router by the balancer (next_upstream)
    session_id: str | None = None
    turn: int = 0
    session_turns: int | None = None
    is_continuation: bool = False
    n: int = 1
    input_tokens: int = 0
    clipped: bool = False
    max_tokens: int = 0
    answer_tokens: int | None = None  # the answer's own length when it ends before max_tokens
    output_tokens: int = 0  # the usage chunk's completion_tokens, else content chunks counted
    server_class: str = ""  # X-Admission-Class (pdmaster: continuation / probable_cache_hit / cold)
    admission_wait_ms: float | None = None  # X-Admission-Wait-Ms
    spilled_to: str = ""  # X-Spilled-To: the master that served it for the one asked (--spill-peers)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error_code

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


def _envelope(raw: bytes) -> tuple[str, str]:
    """(code, type) of an OpenAI error envelope; ("", "") when it is not one."""
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return "", ""
    if not isinstance(err, dict):
        return (str(err), "") if err else ("", "")
    code, type_ = err.get("code"), err.get("type")
    return str(code if code is not None else type_ or "error"), str(type_ or "")


class OpenLoop:
    """Open-loop load: arrivals follow the workload's clock whatever the answers do. Each
    :class:`~pdcoord.dev.workload.Arrival` is a session whose first turn is sent at its time and each
    later turn a think time after the previous one *ended* (a user reads the answer before typing;
    arrivals of new sessions still never wait), only if the previous one succeeded: a refused or
    failed turn ends its session, as the user would have nothing to continue from. Every request is
    a streamed ``/v1/chat/completions`` through the sticky :class:`~pdcoord.dev.workload.Balancer`.
    A refusal is an outcome, not retried unless ``retry_refused``."""

    def __init__(
        self,
        targets: Balancer | Sequence[Target],
        arrivals: Iterable[Arrival],
        cfg: OpenLoopConfig,
        out: str | os.PathLike[str] | None = None,
        seed: int = 1,
    ) -> None:
        self.balancer = targets if isinstance(targets, Balancer) else Balancer(targets, seed)
        self.arrivals = arrivals
        self.cfg = cfg
        self.out_path = out
        self.records: list[RequestRecord] = []
        self.stop_event = threading.Event()
        self._seq = 0
        self._t0 = time.monotonic()  # run() restarts the clock; send() alone counts from here
        self._out: Any = None

    def _now(self) -> float:
        return time.monotonic() - self._t0

    async def run(self) -> list[RequestRecord]:
        """Send every arrival due within the window, wait for every request to end; the records."""
        k = self.cfg.time_scale
        window = self.cfg.duration_s * k
        connector = aiohttp.TCPConnector(
            limit=self.cfg.connection_limit, limit_per_host=0, keepalive_timeout=60
        )
        tasks: set[asyncio.Task[None]] = set()
        with contextlib.ExitStack() as stack:
            if self.out_path is not None:
                # opened once, before the clock starts; each line is a small buffered write
                self._out = stack.enter_context(open(self.out_path, "w"))  # noqa: ASYNC230
            async with aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
            ) as http:
                corpus()  # built once (~0.1 s), before the clock starts rather than in the first send
                self._t0 = time.monotonic()
                for arr in self.arrivals:
                    due = arr.at_s * k
                    if due >= window or self.stop_event.is_set():
                        break
                    if due > self._now():
                        await asyncio.sleep(due - self._now())
                    task = asyncio.create_task(self._session(http, arr, due, window))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                # wait until the window's end even when arrivals ran out before it
                if not self.stop_event.is_set() and self._now() < window:
                    await asyncio.sleep(window - self._now())
                while tasks:
                    await asyncio.gather(*list(tasks))
            self._out = None
        return self.records

    async def _session(self, http: aiohttp.ClientSession, arr: Arrival, due: float, window: float) -> None:
        for i, turn in enumerate(arr.turns):
            if i > 0:
                due = self._now() + arr.think_s[i - 1] * self.cfg.time_scale
                if due >= window or self.stop_event.is_set():
                    return  # the window closed: later turns are not sent (not a failure)
                await asyncio.sleep(max(0.0, due - self._now()))
            rec = await self.send(http, turn, due)
            if not rec.ok:
                return

    async def send(self, http: aiohttp.ClientSession, turn: Turn, due: float | None = None) -> RequestRecord:
        """Send one turn (and, with ``retry_refused``, once more after a refusal); its record."""
        target = self.balancer.pick(turn.session_id)
        self._seq += 1
        body: dict[str, Any] = {"model": self.cfg.model, "messages": turn.messages(),
                                "max_tokens": turn.max_tokens, "n": turn.n, "stream": True}  # fmt: skip
        if self.cfg.include_usage:
            body["stream_options"] = {"include_usage": True}
        if turn.answer_tokens is not None:
            body[ANSWER_FIELD] = turn.answer_tokens
            if self.cfg.answer_in_prompt:
                body["messages"] = with_answer_marker(body["messages"], turn.answer_tokens)
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if turn.session_id is not None:
            headers["X-Session-Id"] = turn.session_id
        t_send = self._now()
        rec = RequestRecord(self._seq, turn.kind, target.name, due if due is not None else t_send, t_send,
                            t_send, None, None, HANG, session_id=turn.session_id, turn=turn.turn,
                            session_turns=turn.session_turns, is_continuation=turn.is_continuation, n=turn.n,
                            input_tokens=turn.input_tokens, clipped=turn.clipped,
                            max_tokens=turn.max_tokens, answer_tokens=turn.answer_tokens)  # fmt: skip
        deadline = time.monotonic() + self.cfg.request_timeout_s * self.cfg.time_scale
        url = target.url + "/v1/chat/completions"
        await self._attempt(http, url, data, headers, rec, deadline)
        tried = [target]
        while rec.status in (429, 503) and len(tried) <= self.cfg.next_upstream:
            nxt = self.balancer.next_after(turn.session_id, tried)
            if nxt is None or time.monotonic() >= deadline:
                break
            tried.append(nxt)
            rec.passed_on += 1
            rec.target = nxt.name
            rec.error_code = rec.error_type = ""
            await self._attempt(http, nxt.url + "/v1/chat/completions", data, headers, rec, deadline)
        if self.cfg.retry_refused and rec.status in (429, 503):
            wait = rec.retry_after_s if rec.retry_after_s is not None else 1.0
            if time.monotonic() + wait < deadline:
                await asyncio.sleep(wait)
                rec.retried = True
                rec.error_code = rec.error_type = ""
                await self._attempt(http, url, data, headers, rec, deadline)
        rec.t_end = self._now()
        self.records.append(rec)
        if self._out is not None:
            self._out.write(rec.to_json() + "\n")
        return rec

    async def _attempt(
        self,
        http: aiohttp.ClientSession,
        url: str,
        data: bytes,
        headers: dict[str, str],
        rec: RequestRecord,
        deadline: float,
    ) -> None:
        resp: aiohttp.ClientResponse | None = None
        finished = False
        rec.status = CONN_FAILED
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + (deadline - time.monotonic())):
                resp = await http.post(url, data=data, headers=headers)
                rec.status = resp.status
                rec.retry_after_s = _retry_after(resp.headers.get("Retry-After"))
                rec.server_class = resp.headers.get("X-Admission-Class", "")
                wait = resp.headers.get("X-Admission-Wait-Ms")
                rec.admission_wait_ms = float(wait) if wait else None
                rec.spilled_to = resp.headers.get("X-Spilled-To", "")
                if resp.status != 200:
                    raw = await resp.read()
                    rec.error_code, rec.error_type = _envelope(raw)
                    if not rec.error_code:
                        rec.error_code = str(resp.status)
                else:
                    await self._read_stream(resp, rec)
                finished = True
        except TimeoutError:
            rec.status, rec.error_code, rec.error_type = HANG, "hang", ""
        except (aiohttp.ClientError, OSError) as exc:
            if resp is None:
                rec.status = CONN_FAILED
                rec.error_code = type(exc).__name__
            else:  # the stream broke after the headers: the status stays, the answer is incomplete
                rec.error_code = "stream_truncated"
            rec.error_type = type(exc).__name__
        finally:
            if resp is not None:
                if finished:
                    resp.release()
                else:
                    resp.close()  # the server sees the client leave

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord) -> None:
        """Minimal SSE: ``data:`` lines, one JSON each; content deltas counted per choice."""
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        count: dict[int, int] = {}
        usage_tokens: int | None = None
        done = False
        buf = b""
        async for chunk in resp.content.iter_any():
            now = self._now()
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                try:
                    ev = json.loads(payload)
                except ValueError:
                    continue
                if not isinstance(ev, dict):
                    continue
                if "error" in ev:
                    code, type_ = _envelope(payload)
                    rec.error_code, rec.error_type = code or "stream_error", type_
                    continue
                usage = ev.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    usage_tokens = usage["completion_tokens"]
                for ch in ev.get("choices") or ():
                    delta = ch.get("delta") or {}
                    if delta.get("content") or ch.get("text"):
                        idx = int(ch.get("index", 0))
                        first.setdefault(idx, now)
                        last[idx] = now
                        count[idx] = count.get(idx, 0) + 1
        if not done and not rec.error_code:
            rec.error_code = "stream_truncated"  # the stream ended without [DONE]
        if first:
            rec.ttft_s = min(first.values()) - rec.t_send
        tpots = [(last[i] - first[i]) / (count[i] - 1) for i in first if count[i] > 1]
        rec.tpot_s = max(tpots) if tpots else None
        rec.output_tokens = usage_tokens if usage_tokens is not None else sum(count.values())


def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99)}


def meets_slo(r: RequestRecord, slo_ttft_s: float, slo_tpot_s: float, time_scale: float = 1.0) -> bool:
    """Succeeded, first token within the TTFT SLO and (with two tokens or more) TPOT within its SLO."""
    if not r.ok or r.ttft_s is None:
        return False
    return r.ttft_s / time_scale <= slo_ttft_s and (r.tpot_s is None or r.tpot_s / time_scale <= slo_tpot_s)


def summarize(
    records: Sequence[RequestRecord],
    slo_ttft_s: float,
    slo_tpot_s: float,
    time_scale: float = 1.0,
    duration_s: float | None = None,
) -> dict[str, Any]:
    """An open-loop run in engine time (wall times / *time_scale*). *duration_s* (engine seconds)
    divides the counts into rates; by default the span from the first send to the last end.

    ``goodput_rps`` is requests per second that succeeded within both SLOs; ``attainment`` their
    share of all requests sent (refusals, errors and hangs included). Per class (``first_turn``,
    ``continuation``, as the load knows them): counts, attainment, TTFT/TPOT p50/p99 of the
    successful ones. ``sessions_met``: sessions whose every sent turn met the SLO;
    ``sessions_completed``: those that also sent every planned turn (synthetic sessions only)."""
    k = time_scale
    if duration_s is None:
        duration_s = (max(r.t_end for r in records) - min(r.t_send for r in records)) / k if records else 0.0
    per_s = (lambda c: c / duration_s) if duration_s > 0 else (lambda c: 0.0)
    met = {r.seq for r in records if meets_slo(r, slo_ttft_s, slo_tpot_s, k)}
    ok = [r for r in records if r.ok]

    def block(rs: Sequence[RequestRecord]) -> dict[str, Any]:
        good = [r for r in rs if r.ok]
        n_met = sum(1 for r in rs if r.seq in met)
        return {
            "requests": len(rs),
            "ok": len(good),
            "met_slo": n_met,
            "attainment": n_met / len(rs) if rs else None,
            "ttft_s": _pcts([r.ttft_s / k for r in good if r.ttft_s is not None]),
            "tpot_s": _pcts([r.tpot_s / k for r in good if r.tpot_s is not None]),
        }

    statuses: dict[str, int] = {}
    errors: dict[str, int] = {}
    server_classes: dict[str, int] = {}
    for r in records:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
        if r.error_code:
            errors[r.error_code] = errors.get(r.error_code, 0) + 1
        if r.server_class:
            server_classes[r.server_class] = server_classes.get(r.server_class, 0) + 1
    sessions: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.session_id is not None:
            sessions.setdefault(r.session_id, []).append(r)
    sessions_met = [rs for rs in sessions.values() if all(r.seq in met for r in rs)]
    completed = [
        rs for rs in sessions_met if rs[0].session_turns is not None and len(rs) == rs[0].session_turns
    ]
    summary = {
        "duration_s": duration_s,
        "time_scale": k,
        "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
        "requests": len(records),
        "offered_rps": per_s(len(records)),
        "ok": len(ok),
        "throughput_rps": per_s(len(ok)),
        "met_slo": len(met),
        "goodput_rps": per_s(len(met)),
        "attainment": len(met) / len(records) if records else None,
        "output_tokens_per_s": per_s(sum(r.output_tokens for r in ok)),
        "goodput_output_tokens_per_s": per_s(sum(r.output_tokens for r in records if r.seq in met)),
        "all": block(records),
        "first_turn": block([r for r in records if not r.is_continuation]),
        "continuation": block([r for r in records if r.is_continuation]),
        "statuses": statuses,
        "refusals": {s: c for s, c in statuses.items() if s in ("429", "503")},
        "refused": sum(1 for r in records if r.status in (429, 503)),
        "hangs": sum(1 for r in records if r.status == HANG),
        "conn_failed": sum(1 for r in records if r.status == CONN_FAILED),
        "errors": errors,
        "retried": sum(1 for r in records if r.retried),
        "server_classes": server_classes,
        "clipped": sum(1 for r in records if r.clipped),
        "sessions": len(sessions),
        "sessions_met": len(sessions_met),
        "sessions_completed": len(completed),
        "session_attainment": len(sessions_met) / len(sessions) if sessions else None,
        "max_send_lag_s": max((r.t_send - r.t_sched for r in records), default=0.0) / k,
    }
    return summary


# ---------------------------------------------------------------------------- benchmark process


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Cold streamed prompts at a fixed concurrency; measures requests that start and end in the window."""
    mix = RequestMix(weights={"cold": 1.0}, max_tokens=args.tokens, stream_fraction=1.0, model="pdsim-model",
                     prompt_words=64)  # fmt: skip
    # A dead router refuses at once: wait a little rather than spin on it.
    cfg = LoadConfig(users=args.concurrency, seed=args.seed, request_timeout_s=120, mix=mix,
                     max_backoff_s=0.01)  # fmt: skip
    load: ClosedLoop
    if args.url:
        urls = args.url.split(",")
        load = ClosedLoop(lambda: [(u, u) for u in urls], cfg)
    else:
        load = DirectPD(args.prefill, args.decode, args.bootstrap_port, cfg)
    async with load.session() as http:
        # Open the keep-alive connections before the clock starts.
        warm = mix.requests(random.Random(args.seed + 10**6), "warm")
        await asyncio.gather(*(load.request(http, next(warm)) for _ in range(min(args.concurrency, 50))))
        load.outcomes.clear()
        print("START", flush=True)
        t_start = time.monotonic()
        w0 = t_start + args.warmup
        end = w0 + args.duration
        await asyncio.gather(*(load.user(http, i, end) for i in range(args.concurrency)))
        t_stop = time.monotonic()
        print("END", flush=True)
    outcomes = load.snapshot()
    ok = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    window = [o for o in ok if o.started >= w0 and o.ended <= end]
    in_window_done = sum(1 for o in ok if w0 <= o.ended <= end)
    ttft = [((o.first_event or o.ended) - o.started) * 1000 for o in window]
    e2e = [o.latency_s * 1000 for o in window]
    cpu = os.times()
    return {
        "concurrency": args.concurrency,
        "completed_total": len(ok),
        "errors": len(failed),
        "error_samples": [f"{o.master}: {o.status} {o.error}"[:300] for o in failed[:5]],
        "wall_s": t_stop - t_start,
        "window_s": args.duration,
        "rps": in_window_done / args.duration,
        "measured": len(window),
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "e2e_ms": {"p50": percentile(e2e, 50), "p99": percentile(e2e, 99)},
        "loadgen_cpu_s": cpu.user + cpu.system,
    }


# ---------------------------------------------------------------------------- open-loop process


def _int_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    a, b = int(lo), int(hi or lo)
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"need LO-HI with 0 < LO <= HI, got {text!r}")
    return a, b


def open_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdcoord.dev.loadgen open",
        description="Open-loop streamed chat load (a Mooncake trace replay or synthetic multi-turn "
        "sessions) through a sticky load balancer: START and END around the load on stdout, then one "
        "JSON line with the summary; one JSON line per request in --out. Times (rate, duration, "
        "schedule, think time, timeout, SLOs) are engine seconds, stretched by --time-scale.",
    )
    p.add_argument("--targets", required=True, help="router base URLs, comma-separated")
    p.add_argument("--weights", default="even", help="'even' or one relative weight per target: 0.7,0.2,0.1")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", default=None, help="Mooncake-format JSONL trace to replay")
    src.add_argument("--synthetic", action="store_true", help="synthetic multi-turn sessions")
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="requests/s: with --trace the trace's mean rate over the whole file becomes this "
        "(default: its own, or --speed); with --synthetic the offered rate, sessions arriving at "
        "rate / mean turns (default 1)",
    )
    p.add_argument("--speed", type=float, default=None, help="--trace: timestamps divided by this")
    p.add_argument("--duration", type=float, required=True, help="seconds of arrivals")
    p.add_argument("--schedule", default="", help="rate multipliers from:to:mult[,…], e.g. 0:60:1,60:120:2.5")
    p.add_argument("--time-scale", type=float, default=1.0, help="the engines run this many times slower")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None, help="one JSON line per request")
    p.add_argument("--request-timeout", type=float, default=120.0, help="then HANG, connection closed")
    p.add_argument("--retry-refused", action="store_true", help="resend a 429/503 once after Retry-After")
    p.add_argument(
        "--next-upstream",
        type=int,
        default=0,
        help="the balancer passes a request answered 429/503 to the next router at once, up to this many "
        "more (as nginx's proxy_next_upstream http_429 http_503 non_idempotent)",
    )
    p.add_argument("--model", default="pdsim-model")
    p.add_argument("--connections", type=int, default=1024, help="connection pool limit")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO of the summary (s)")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="TPOT SLO of the summary (s)")
    t = p.add_argument_group("trace")
    t.add_argument(
        "--max-input-tokens",
        type=int,
        default=32768,
        help="longer prompts are clipped to this (the engines' context must also hold max_tokens)",
    )
    t.add_argument("--trace-start", type=float, default=0.0, help="skip the trace's first seconds")
    t.add_argument(
        "--trace-input-range",
        type=_int_range,
        default=None,
        help="replay only the requests with LO-HI input tokens (the rate is of those)",
    )
    t.add_argument(
        "--ask-max-tokens",
        type=int,
        default=None,
        help="send this max_tokens; the trace's output length becomes the answer's (pdsim_answer_tokens)",
    )
    t.add_argument(
        "--answer-in-prompt",
        action="store_true",
        help="also end the prompt with <pdsim-answer-tokens=N> (routers that drop unknown fields)",
    )
    s = p.add_argument_group("synthetic")
    d = SyntheticConfig()
    s.add_argument("--turns", type=_int_range, default=d.turns, help="turns per session, LO-HI (2-6)")
    s.add_argument("--max-tokens", type=_int_range, default=d.max_tokens, help="per turn, LO-HI (80-350)")
    s.add_argument("--think-mean", type=float, default=d.think_mean_s, help="mean think time (s)")
    s.add_argument("--gang-fraction", type=float, default=d.gang_fraction, help="requests with n > 1")
    s.add_argument("--gang-n", type=int, default=d.gang_n)
    s.add_argument("--system-prompts", type=int, default=d.system_prompts)
    s.add_argument("--system-tokens", type=int, default=d.system_tokens)
    s.add_argument(
        "--first-user-tokens", type=float, default=d.first_user_median_tokens, help="lognormal median"
    )
    s.add_argument("--user-tokens", type=_int_range, default=d.user_tokens, help="later turns, LO-HI")
    return p


def open_arrivals(args: argparse.Namespace) -> tuple[Iterable[Arrival], dict[str, Any]]:
    """The arrivals the CLI's arguments describe, and what was chosen (for the summary)."""
    schedule = Schedule.parse(args.schedule)
    if args.trace:
        n, span = trace_span(args.trace, args.trace_input_range)
        speed = args.speed or 1.0
        if args.rate:
            speed = args.rate / (n / span)
        # The trace time the run consumes: a schedule above 1x replays more of it (a burst), not
        # the same window faster and then nothing.
        reqs = load_trace(args.trace, args.trace_start, schedule.cumulative(args.duration) * speed,
                          args.trace_input_range)  # fmt: skip
        info = {"source": "trace", "trace": args.trace, "speed": speed, "trace_requests": len(reqs),
                "continuations": sum(1 for r in reqs if r.turn > 0)}  # fmt: skip
        return trace_arrivals(reqs, speed=speed, schedule=schedule, max_input_tokens=args.max_input_tokens,
                              tag=f"mc{args.seed}", ask_max_tokens=args.ask_max_tokens), info  # fmt: skip
    cfg = SyntheticConfig(turns=args.turns, max_tokens=args.max_tokens, think_mean_s=args.think_mean,
                          gang_fraction=args.gang_fraction, gang_n=args.gang_n,
                          system_prompts=args.system_prompts, system_tokens=args.system_tokens,
                          first_user_median_tokens=args.first_user_tokens,
                          user_tokens=args.user_tokens)  # fmt: skip
    cfg.session_rate = (args.rate or 1.0) / cfg.mean_turns
    info = {"source": "synthetic", "session_rate": cfg.session_rate}
    return synthetic_arrivals(cfg, args.seed, schedule), info


async def open_bench(args: argparse.Namespace) -> dict[str, Any]:
    arrivals, info = open_arrivals(args)
    cfg = OpenLoopConfig(duration_s=args.duration, request_timeout_s=args.request_timeout,
                         retry_refused=args.retry_refused, next_upstream=args.next_upstream,
                         time_scale=args.time_scale, model=args.model,
                         answer_in_prompt=args.answer_in_prompt,
                         connection_limit=args.connections)  # fmt: skip
    load = OpenLoop(parse_targets(args.targets, args.weights), arrivals, cfg, args.out, seed=args.seed)
    print("START", flush=True)
    records = await load.run()
    print("END", flush=True)
    summary = summarize(records, args.slo_ttft, args.slo_tpot, args.time_scale, args.duration)
    cpu = os.times()
    return {**info, **summary, "loadgen_cpu_s": cpu.user + cpu.system}


def open_main(argv: Sequence[str]) -> None:
    args = open_parser().parse_args(argv)
    result = asyncio.run(open_bench(args))
    sys.stdout.write(json.dumps(result) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["open"]:  # the open-loop load; without it, the peer benchmarks' closed loop
        open_main(argv[1:])
        return
    p = argparse.ArgumentParser(
        prog="python -m pdcoord.dev.loadgen",
        description="Closed-loop streaming load for the peer benchmarks: START and END around the "
        "measured load on stdout, then one JSON line with the results. The open-loop load is "
        "`python -m pdcoord.dev.loadgen open --help`.",
    )
    p.add_argument("--url", default=None, help="router base URL (comma-separated: round robin)")
    p.add_argument("--prefill", default=None, help="direct mode: prefill base URL")
    p.add_argument("--decode", default=None, help="direct mode: decode base URL")
    p.add_argument("--bootstrap-port", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds of load before measuring")
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if not args.url and not (args.prefill and args.decode and args.bootstrap_port):
        p.error("give --url, or --prefill, --decode and --bootstrap-port")
    result = asyncio.run(bench(args))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
