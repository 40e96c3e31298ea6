"""Client load and observation helpers for the cluster suite (the load itself is ``pdcoord.dev.loadgen``)."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from nodeagent.slicing import share_table
from pdcoord.dev.cluster import LocalCluster, http_json, scrape_metrics
from pdcoord.dev.loadgen import BackgroundLoad, LoadConfig, Outcome, RequestMix


def cluster_load(
    targets: Callable[[], Sequence[tuple[str, str]]],
    *,
    users: int = 8,
    seed: int = 1,
    max_tokens: int = 8,
    request_timeout_s: float = 20.0,
    gangs: bool = True,
    lb_retry: bool = False,
) -> BackgroundLoad:
    """The cluster suite's load (not started): short requests, no waiting after a refusal, so the
    refusals a failover causes are counted rather than smoothed away."""
    weights = {"gang": 0.1 if gangs else 0.0, "session": 0.3, "cold": 0.6}
    mix = RequestMix(weights=weights, max_tokens=max_tokens, gang_n=2, stream_fraction=0.6)
    cfg = LoadConfig(users=users, seed=seed, request_timeout_s=request_timeout_s, mix=mix, max_backoff_s=0.0,
                     lb_retry=lb_retry, fresh_connections=True)  # fmt: skip
    return BackgroundLoad(targets, cfg)


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
        self._pending: dict[str, threading.Event] = {}  # add_once_ready: name -> its watcher's stop
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

    def add_once_ready(self, name: str) -> None:
        """Add ``name`` whenever it turns ready, without waiting here: a chaos loop may have stopped
        every prefill (or decode) agent, and then no master is ready until one is back."""
        stop = threading.Event()
        with self._lock:
            self._pending[name] = stop

        def watch() -> None:
            while not stop.wait(0.1):
                if ready(self.cluster.masters[name].url):
                    with self._lock:
                        if self._pending.get(name) is stop:
                            del self._pending[name]
                            if name not in self._names:
                                self._names.append(name)
                    return

        threading.Thread(target=watch, name=f"add-{name}", daemon=True).start()

    def remove(self, name: str) -> None:
        with self._lock:
            pending = self._pending.pop(name, None)
            if pending is not None:
                pending.set()
            if name in self._names:
                self._names.remove(name)


def summarize(results: Sequence[Outcome]) -> str:
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
    return share_table(masters, caps)


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


def post_unread(
    port: int, path: str, body: object, *, http_version: str = "1.1", close: bool = True, timeout: float = 30
) -> socket.socket:
    """POST ``body`` (JSON) to 127.0.0.1:``port`` from a socket whose small receive buffer (set before
    connect, so no autotuning) fills at once: a client that reads nothing of its answer until the test
    says so. The caller closes it."""
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/{http_version}\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.settimeout(timeout)
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(head.encode() + payload)
    except BaseException:
        sock.close()
        raise
    return sock
