"""Client load and observation helpers for the cluster suite.

``Load`` is a small closed-loop client that runs its own asyncio loop in a background thread, so a
test can kill and restart processes synchronously while requests are in flight. Unlike
``pdcoord.dev.loadgen.Workload`` it records what the failover assertions need: the start and end time
of every request, the master it went to, whether a refusal carried ``Retry-After``, and the retries a
load balancer would make.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp

from nodeagent.slicing import slice_shares
from pdcoord.dev.cluster import LocalCluster, http_json, scrape_metrics
from pdcoord.dev.loadgen import error_kind

HANG = -1  # status of a request that did not end within the client's timeout
CONN_FAILED = 0  # status of a request whose connection failed or broke


@dataclass
class Result:
    master: str
    kind: str
    status: int
    started: float  # time.monotonic() when the (first) attempt was sent
    ended: float
    error: str = ""
    retry_after: bool = False
    attempts: list[str] = field(default_factory=list)  # masters tried, in order
    retried_because: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def explicit(self) -> bool:
        """Ended with a result or an error the client saw; not a hang."""
        return self.status != HANG

    def overlaps(self, t: float) -> bool:
        return self.started <= t <= self.ended


@dataclass
class LoadConfig:
    users: int = 8
    seed: int = 1
    max_tokens: int = 8
    request_timeout_s: float = 20.0
    gang_n: int = 2
    gang_fraction: float = 0.1
    session_fraction: float = 0.3
    stream_fraction: float = 0.6
    # Retry on another master only when nothing was processed: a connection that could not be made,
    # or a 503 from a draining master. That is what a load balancer in front of the masters does.
    lb_retry: bool = False
    max_attempts: int = 3


def _is_draining_refusal(status: int, body: bytes) -> bool:
    if status != 503:
        return False
    try:
        message = str(json.loads(body).get("error", {}).get("message", ""))
    except (ValueError, AttributeError):
        return False
    return "shutting down" in message


class Load:
    """Closed-loop load over ``targets()`` (the (name, base_url) pairs a load balancer would use now)."""

    def __init__(self, targets: Callable[[], Sequence[tuple[str, str]]], cfg: LoadConfig) -> None:
        self.targets = targets
        self.cfg = cfg
        self.results: list[Result] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rr = 0
        self.in_flight = 0

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> Load:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True, name="load")
        self._thread.start()
        return self

    def stop(self) -> list[Result]:
        """Stop sending; wait for every request to end (bounded by the request timeout)."""
        self._stop.set()
        assert self._thread is not None
        self._thread.join(self.cfg.request_timeout_s * self.cfg.max_attempts + 10)
        assert not self._thread.is_alive(), "load thread did not finish: a request outlived its timeout"
        return self.snapshot()

    def snapshot(self) -> list[Result]:
        with self._lock:
            return list(self.results)

    def wait_for_results(self, n: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.snapshot()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.snapshot())} of {n} requests ended within {timeout}s")
            time.sleep(0.05)

    # -- requests -----------------------------------------------------------------------------
    def _pick(self, avoid: Iterable[str] = ()) -> tuple[str, str] | None:
        ts = list(self.targets())
        avoid = set(avoid)
        preferred = [t for t in ts if t[0] not in avoid] or ts
        if not preferred:
            return None
        self._rr += 1
        return preferred[self._rr % len(preferred)]

    async def _attempt(
        self,
        http: aiohttp.ClientSession,
        base: str,
        path: str,
        body: dict[str, object],
        headers: dict[str, str],
    ) -> tuple[int, str, bool, bool]:
        """(status, error, retry_after_present, retriable_by_a_load_balancer)."""
        try:
            async with http.post(base + path, json=body, headers=headers) as resp:
                retry_after = "Retry-After" in resp.headers
                if resp.status != 200:
                    raw = await resp.read()
                    return (
                        resp.status,
                        f"http {resp.status} {error_kind(resp.status, raw)}",
                        retry_after,
                        _is_draining_refusal(resp.status, raw),
                    )
                if body.get("stream"):
                    error = ""
                    done = False
                    async for line in resp.content:
                        if line.startswith(b"data:"):
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                done = True
                            elif payload.startswith(b'{"error"'):
                                error = "stream_error"
                    if not done and not error:
                        error = "stream_truncated"  # the stream ended without [DONE]
                    return 200, error, retry_after, False
                data = await resp.json(content_type=None)
                if not isinstance(data, dict) or not data.get("choices"):
                    return 200, "bad_body", retry_after, False
                return 200, "", retry_after, False
        except aiohttp.ClientConnectorError as exc:  # nothing was sent
            return CONN_FAILED, type(exc).__name__, False, True
        except (aiohttp.ClientError, OSError) as exc:
            return CONN_FAILED, type(exc).__name__, False, False

    async def _request(self, http: aiohttp.ClientSession, rng: random.Random, uid: int, seq: int) -> None:
        pick = self._pick()
        if pick is None:
            await asyncio.sleep(0.05)
            return
        r = rng.random()
        headers: dict[str, str] = {}
        n = 1
        if r < self.cfg.gang_fraction:
            kind, n = "gang", self.cfg.gang_n
        elif r < self.cfg.gang_fraction + self.cfg.session_fraction:
            kind = "session"
            headers["X-Session-Id"] = f"u{uid}-s{seq // 3}"
        else:
            kind = "cold"
        stream = rng.random() < self.cfg.stream_fraction
        if kind == "session":
            path = "/v1/chat/completions"
            body: dict[str, object] = {
                "model": "sim",
                "messages": [{"role": "user", "content": f"user {uid} turn {seq}: go on"}],
                "max_tokens": self.cfg.max_tokens,
                "stream": stream,
            }
        else:
            path = "/v1/completions"
            body = {
                "model": "sim",
                "prompt": f"prompt {uid}-{seq}-{rng.getrandbits(32):x}: summarise",
                "max_tokens": self.cfg.max_tokens,
                "n": n,
                "stream": stream,
            }
        name, base = pick
        started = time.monotonic()
        res = Result(name, kind, HANG, started, started, error="hang", attempts=[name])
        self.in_flight += 1
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                while True:
                    status, error, retry_after, retriable = await self._attempt(
                        http, base, path, body, headers
                    )
                    res.master, res.status, res.error, res.retry_after = name, status, error, retry_after
                    if not (self.cfg.lb_retry and retriable and len(res.attempts) < self.cfg.max_attempts):
                        break
                    res.retried_because.append(f"{name}: {error}")
                    nxt = self._pick(avoid=res.attempts)
                    if nxt is None:
                        break
                    name, base = nxt
                    res.attempts.append(name)
        except TimeoutError:
            res.status, res.error = HANG, "hang"
        finally:
            self.in_flight -= 1
            res.ended = time.monotonic()
            with self._lock:
                self.results.append(res)

    async def _user(self, http: aiohttp.ClientSession, uid: int) -> None:
        rng = random.Random(self.cfg.seed * 7919 + uid)
        seq = 0
        while not self._stop.is_set():
            await self._request(http, rng, uid, seq)
            seq += 1

    async def _main(self) -> None:
        # A fresh connection per request: a refused connect then means "nothing was sent", never a
        # stale pooled connection that the server closed in between.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        ) as http:
            await asyncio.gather(*(self._user(http, i) for i in range(self.cfg.users)))


# -- observation ------------------------------------------------------------------------------


def engine_metric(cluster: LocalCluster, names: Iterable[str], metric: str) -> dict[str, float]:
    return {n: scrape_metrics(cluster.engines[n].url).get(metric, 0.0) for n in names}


def ready(url: str) -> bool:
    try:
        return bool(http_json(url + "/readiness", timeout=1.0).get("ready"))
    except (OSError, ValueError):
        return False


class Targets:
    """The masters a load balancer sends to: added when /readiness says so, removed before a stop."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self._names: list[str] = []
        self._lock = threading.Lock()

    def __call__(self) -> list[tuple[str, str]]:
        with self._lock:
            names = list(self._names)
        return [(n, self.cluster.masters[n].url) for n in names]

    def names(self) -> list[str]:
        with self._lock:
            return list(self._names)

    def add_when_ready(self, name: str, timeout: float = 15.0) -> float:
        took = self.cluster.wait_for(lambda: ready(self.cluster.masters[name].url), timeout)
        with self._lock:
            if name not in self._names:
                self._names.append(name)
        return took

    def remove(self, name: str) -> None:
        with self._lock:
            if name in self._names:
                self._names.remove(name)


def summarize(results: Sequence[Result]) -> str:
    by: dict[str, int] = {}
    for r in results:
        key = "ok" if r.ok else f"{r.status} {r.error}"
        by[key] = by.get(key, 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))


def wait_no_leases(cluster: LocalCluster, timeout: float = 10.0) -> dict[str, object]:
    """Wait until every live master reports 0 active slots and 0 queued; returns what was last seen."""
    last: dict[str, object] = {}

    def idle() -> bool:
        last.clear()
        for mid, m in cluster.masters.items():
            if m.proc.alive:
                a = m.admission()
                last[mid] = (a["active"], a.get("queued_requests", 0))
        return all(v == (0, 0) for v in last.values())

    try:
        cluster.wait_for(idle, timeout)
    except TimeoutError:
        pass
    return dict(last)


def start_master_retrying(cluster: LocalCluster, master_id: str, timeout: float = 15.0) -> float:
    """(Re)start a master once etcd no longer holds a killed predecessor's lease (seconds taken)."""
    return cluster.start_master_when_free(master_id, timeout)


def expected_share_table(masters: Iterable[str], caps: dict[str, int]) -> dict[str, dict[str, int]]:
    """master -> node -> share that the slicing function gives when exactly ``masters`` are live."""
    names = list(masters)
    table: dict[str, dict[str, int]] = {m: {} for m in names}
    for node, cap in caps.items():
        for m, s in slice_shares(cap, names, node).items():
            table[m][node] = s
    return table


def churn_masters(
    cluster: LocalCluster, targets: Targets, masters: Sequence[str], duration: float, rng: random.Random
) -> list[str]:
    """Masters join, leave gracefully (SIGTERM: drain, revoke) and restart in a loop for ``duration``.

    At least one master stays up. Returns a log of the actions with their times.
    """
    import signal

    log: list[str] = []
    start = time.monotonic()
    while time.monotonic() - start < duration:
        time.sleep(rng.uniform(0.3, 1.2))
        up = [m for m in masters if cluster.masters[m].proc.alive]
        down = [m for m in masters if m not in up]
        choices = (["leave", "restart"] if len(up) >= 2 else []) + (["join"] * 2 if down else [])
        action = rng.choice(choices)
        mid = rng.choice(down if action == "join" else up)
        if action in ("leave", "restart"):
            proc = cluster.masters[mid].proc
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)  # the load balancer notices the failing readiness probe
            targets.remove(mid)
            proc.wait(30)
        if action in ("join", "restart"):
            start_master_retrying(cluster, mid)
            targets.add_when_ready(mid)
        log.append(f"{time.monotonic() - start:5.1f}s {action} {mid}")
    return log
