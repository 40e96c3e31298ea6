"""Client load for the demo, the cluster tests and the benchmarks: a mixed, seeded workload.

Closed loop: ``users`` concurrent clients, each repeatedly sending one request and waiting for its
end. Kinds: multi-turn sessions (``X-Session-Id``, the conversation grows), cold prompts,
shared-prefix prompts (a few long system prompts reused), and gangs (``n`` > 1). Every request ends
as an Outcome; a request that does not end within ``request_timeout`` is recorded as a hang.

Like the OpenAI SDK, a client that is refused (429/503) waits before its next request, following the
master's ``Retry-After`` (capped by ``max_backoff_s``, jittered); without that every refusal came
straight back and a failover turned into thousands of 429s a second.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

SHARED_PREFIXES = [
    ("You are a meticulous assistant for a logistics company. Answer with numbered steps. " * 6),
    ("System: you translate technical documentation between English and German precisely. " * 6),
    ("Context: the following is a customer support transcript for a cloud storage product. " * 6),
]


@dataclass
class Outcome:
    kind: str
    master: str
    status: int  # HTTP status, 0 when the connection failed, -1 on a client-side timeout (a hang)
    latency_s: float
    klass: str = ""
    wait_ms: float = 0.0
    error: str = ""
    streamed_events: int = 0
    retry_after_s: float = 0.0  # the refusal's Retry-After, 0 when there was none

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


@dataclass
class WorkloadConfig:
    users: int = 16
    duration_s: float = 10.0
    seed: int = 1
    max_tokens: int = 16
    request_timeout_s: float = 30.0
    # relative weights of the request kinds
    mix: dict[str, float] = field(
        default_factory=lambda: {"session": 0.35, "cold": 0.25, "shared_prefix": 0.3, "gang": 0.1}
    )
    gang_n: int = 4
    stream_fraction: float = 0.7
    # Wait after a refusal: Retry-After (or 0.2 s without one) capped here; 0 disables waiting.
    max_backoff_s: float = 0.5


def error_kind(status: int, body: bytes) -> str:
    """The ``code`` (else ``type``) of an OpenAI-style error body, else the status."""
    try:
        err = json.loads(body).get("error", {})
        return str(err.get("code") or err.get("type") or status)
    except (ValueError, AttributeError):
        return str(status)


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0


class Workload:
    def __init__(self, masters: Callable[[], Sequence[tuple[str, str]]], cfg: WorkloadConfig) -> None:
        """``masters()`` returns the (name, base_url) pairs to spread load over, re-read per request."""
        self.masters = masters
        self.cfg = cfg
        self.outcomes: list[Outcome] = []
        self.rng = random.Random(cfg.seed)
        self._rr = 0
        self.stop_at = 0.0

    def _pick_master(self) -> tuple[str, str]:
        ms = list(self.masters())
        self._rr += 1
        return ms[self._rr % len(ms)]

    async def _one(self, session: aiohttp.ClientSession, kind: str, body: dict[str, object],
                   headers: dict[str, str], path: str) -> Outcome:  # fmt: skip
        name, base = self._pick_master()
        start = time.monotonic()
        stream = bool(body.get("stream"))
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                async with session.post(base + path, json=body, headers=headers) as resp:
                    klass = resp.headers.get("X-Admission-Class", "")
                    wait_ms = float(resp.headers.get("X-Admission-Wait-Ms", "0") or 0)
                    if resp.status != 200:
                        raw = await resp.read()
                        after = _retry_after(resp.headers.get("Retry-After"))
                        return Outcome(kind, name, resp.status, time.monotonic() - start, klass, wait_ms,
                                       error_kind(resp.status, raw), retry_after_s=after)  # fmt: skip
                    events = 0
                    error = ""
                    if stream:
                        async for line in resp.content:
                            if line.startswith(b"data:"):
                                events += 1
                                if b'"error"' in line[:40]:
                                    error = "stream_error"
                    else:
                        await resp.read()
                    return Outcome(kind, name, 200, time.monotonic() - start, klass, wait_ms, error, events)
        except TimeoutError:
            return Outcome(kind, name, -1, time.monotonic() - start, error="hang")
        except (aiohttp.ClientError, OSError) as exc:
            return Outcome(kind, name, 0, time.monotonic() - start, error=type(exc).__name__)

    async def _user(self, session: aiohttp.ClientSession, uid: int) -> None:
        rng = random.Random(self.cfg.seed * 1000 + uid)
        kinds, weights = zip(*self.cfg.mix.items(), strict=True)
        while time.monotonic() < self.stop_at:
            kind = rng.choices(kinds, weights)[0]
            if kind == "session":
                sid = f"s-{self.cfg.seed}-{uid}-{rng.getrandbits(32):x}"
                history: list[dict[str, str]] = []
                for turn in range(rng.randint(2, 4)):
                    if time.monotonic() >= self.stop_at:
                        break
                    history.append({"role": "user", "content": f"turn {turn} of {sid}: tell me more"})
                    body = {"model": "sim", "messages": list(history), "max_tokens": self.cfg.max_tokens,
                            "stream": rng.random() < self.cfg.stream_fraction}  # fmt: skip
                    out = await self._one(session, kind, body, {"X-Session-Id": sid}, "/v1/chat/completions")
                    self.outcomes.append(out)
                    await self._back_off(out, rng)
                    history.append({"role": "assistant", "content": "ok " * 8})
                continue
            if kind == "shared_prefix":
                prompt = rng.choice(SHARED_PREFIXES) + f" Question {rng.randint(0, 10**6)}?"
                n = 1
            elif kind == "gang":
                prompt = f"Write {self.cfg.gang_n} alternative slogans for product {rng.getrandbits(40):x}."
                n = self.cfg.gang_n
            else:
                prompt = (
                    f"Cold prompt {rng.getrandbits(64):x}: summarise the news of day {rng.randint(1, 9999)}."
                )
                n = 1
            body = {"model": "sim", "prompt": prompt, "max_tokens": self.cfg.max_tokens, "n": n,
                    "stream": rng.random() < self.cfg.stream_fraction}  # fmt: skip
            out = await self._one(session, kind, body, {}, "/v1/completions")
            self.outcomes.append(out)
            await self._back_off(out, rng)

    async def _back_off(self, out: Outcome, rng: random.Random) -> None:
        cap = self.cfg.max_backoff_s
        if cap <= 0:
            return
        if out.status in (429, 503):
            wait = min(out.retry_after_s or 0.2, cap)
        elif out.status == 0:  # connection refused or reset: the next pick may be another master
            wait = min(0.05, cap)
        else:
            return
        await asyncio.sleep(wait * rng.uniform(0.5, 1.0))

    async def run(self) -> list[Outcome]:
        self.stop_at = time.monotonic() + self.cfg.duration_s
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self._user(session, i) for i in range(self.cfg.users)))
        return self.outcomes


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]
