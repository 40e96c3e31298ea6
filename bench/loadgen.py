"""Closed-loop streaming load generator, run as its own process by the peer benchmarks.

``--url``: every request goes to one router (pdmaster, sglang-router).
``--prefill``/``--decode``/``--bootstrap-port``: "direct" — the client does the SGLang PD dance
itself, exactly as a router would: the same body with a fresh ``bootstrap_room`` goes to P
(response read and dropped) and to D (streamed) at once.

Protocol on stdout: ``START`` when the load begins, ``END`` when the last request is done, then
one JSON line with the results. The parent samples process CPU times at START and END.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any

import aiohttp

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "judge",
    "boxing",
]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def make_prompt(i: int, rng: random.Random) -> str:
    # ~64 words, unique per request: no prefix-cache shortcut for any contender.
    return f"request {i}: " + " ".join(rng.choice(WORDS) for _ in range(64))


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.samples: list[tuple[float, float, float]] = []  # (start, first event, done)
        self.errors = 0
        self.error_samples: list[str] = []
        self.completed = 0
        self.rng = random.Random(args.seed)
        self.counter = 0
        self.urls = args.url.split(",") if args.url else []

    def body(self) -> dict[str, Any]:
        self.counter += 1
        return {
            "model": "pdsim-model",
            "prompt": make_prompt(self.counter, self.rng),
            "max_tokens": self.args.tokens,
            "stream": True,
        }

    def fail(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:300])

    async def _stream(self, resp: aiohttp.ClientResponse, t0: float) -> tuple[float, bool]:
        first = 0.0
        tail = b""
        async for chunk in resp.content.iter_any():
            if not first and b"data:" in chunk:
                first = time.perf_counter()
            tail = (tail + chunk)[-64:]
        return first or time.perf_counter(), b"[DONE]" in tail

    async def one(self, session: aiohttp.ClientSession) -> None:
        a = self.args
        body = self.body()
        t0 = time.perf_counter()
        try:
            if self.urls:
                url = self.urls[self.counter % len(self.urls)]
                async with session.post(url + a.path, json=body) as resp:
                    if resp.status != 200:
                        self.fail(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
                        await asyncio.sleep(0.01)
                        return
                    first, done = await self._stream(resp, t0)
            else:
                body["bootstrap_host"] = "127.0.0.1"
                body["bootstrap_port"] = a.bootstrap_port
                body["bootstrap_room"] = random.getrandbits(63)
                data = json.dumps(body).encode()
                hdrs = {"Content-Type": "application/json"}

                async def prefill() -> int:
                    async with session.post(a.prefill + a.path, data=data, headers=hdrs) as r:
                        await r.read()
                        return r.status

                p = asyncio.create_task(prefill())
                async with session.post(a.decode + a.path, data=data, headers=hdrs) as resp:
                    if resp.status != 200:
                        self.fail(f"decode HTTP {resp.status}: {(await resp.read())[:200]!r}")
                        await p
                        return
                    first, done = await self._stream(resp, t0)
                if await p != 200:
                    self.fail("prefill failed")
                    return
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.fail(repr(exc))
            await asyncio.sleep(0.01)  # a dead router refuses at once: do not spin on it
            return
        if not done:
            self.fail("stream ended without [DONE]")
            return
        t1 = time.perf_counter()
        self.completed += 1
        self.samples.append((t0, first, t1))

    async def run(self) -> dict[str, Any]:
        a = self.args
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            # Open the keep-alive connections before the clock starts.
            await asyncio.gather(*(self.one(session) for _ in range(min(a.concurrency, 50))))
            self.samples.clear()
            self.completed = 0
            self.errors = 0
            print("START", flush=True)
            t_start = time.perf_counter()
            w0 = t_start + a.warmup
            end = w0 + a.duration

            async def worker() -> None:
                while time.perf_counter() < end:
                    await self.one(session)

            await asyncio.gather(*(worker() for _ in range(a.concurrency)))
            t_stop = time.perf_counter()
            print("END", flush=True)
        window = [s for s in self.samples if s[0] >= w0 and s[2] <= end]
        in_window_done = sum(1 for s in self.samples if w0 <= s[2] <= end)
        ttft = [(f - s) * 1000 for s, f, _ in window]
        e2e = [(d - s) * 1000 for s, _, d in window]
        cpu = os.times()
        return {
            "concurrency": a.concurrency,
            "completed_total": self.completed,
            "errors": self.errors,
            "error_samples": self.error_samples,
            "wall_s": t_stop - t_start,
            "window_s": a.duration,
            "rps": in_window_done / a.duration,
            "measured": len(window),
            "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
            "e2e_ms": {"p50": percentile(e2e, 50), "p99": percentile(e2e, 99)},
            "loadgen_cpu_s": cpu.user + cpu.system,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", default=None, help="router base URL (comma-separated: round robin)")
    p.add_argument("--prefill", default=None, help="direct mode: prefill base URL")
    p.add_argument("--decode", default=None, help="direct mode: decode base URL")
    p.add_argument("--bootstrap-port", type=int, default=None)
    p.add_argument("--path", default="/v1/completions")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--duration", type=float, default=8.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds of load before measuring")
    p.add_argument("--tokens", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if not args.url and not (args.prefill and args.decode and args.bootstrap_port):
        p.error("give --url, or --prefill, --decode and --bootstrap-port")
    result = asyncio.run(Load(args).run())
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
