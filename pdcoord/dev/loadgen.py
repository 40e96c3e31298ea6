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
* ``python -m pdcoord.dev.loadgen``: the peer benchmarks' load in its own process (so its CPU is not
  the router's), printing ``START``/``END`` around the measured load and then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

HANG = -1  # status of a request that did not end within the client's timeout
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


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m pdcoord.dev.loadgen",
        description="Closed-loop streaming load for the peer benchmarks: START and END around the "
        "measured load on stdout, then one JSON line with the results.",
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
