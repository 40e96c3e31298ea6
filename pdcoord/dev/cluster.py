"""A local pdcoord cluster made of real processes: etcd, masters, agents and simulated engines.

Used by the demo, the integration tests and the benchmarks, so that all three exercise exactly
the same processes and flags an operator would run.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pdcoord.dev.launcher import ManagedProcess, ProcessError, ProcessGroup
from pdcoord.dev.netutil import free_port


def http_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def scrape_metrics(url: str, timeout: float = 3.0) -> dict[str, float]:
    """Prometheus text of ``url``/metrics as metric name -> value (label sets summed)."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _registered(url: str) -> bool:
    try:
        return bool(http_json(url + "/health", timeout=1.0).get("registered"))
    except (OSError, ValueError):
        return False


def _flags(extra: dict[str, object] | None) -> list[str]:
    out: list[str] = []
    for key, value in (extra or {}).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        else:
            out += [flag, str(value)]
    return out


@dataclass
class Master:
    master_id: str
    http_port: int
    grpc_port: int
    proc: ManagedProcess
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def admission(self, timeout: float = 2.0) -> dict[str, Any]:
        result: dict[str, Any] = http_json(self.url + "/admission", timeout)
        return result

    def shares(self) -> dict[str, int]:
        """node_id -> effective share this master holds (0 when the stream is down)."""
        return {n["node_id"]: int(n["effective_share"]) for n in self.admission()["nodes"]}

    def epochs(self) -> dict[str, int]:
        """node_id -> capacity epoch this master holds."""
        return {n["node_id"]: int(n["epoch"]) for n in self.admission()["nodes"]}


@dataclass
class Agent:
    node_id: str
    role: str
    endpoint: str
    capacity: int | None
    proc: ManagedProcess
    extra: dict[str, Any] = field(default_factory=dict)
    health_port: int = 0

    def status(self, timeout: float = 2.0) -> dict[str, Any]:
        """The agent's ``GET /status``."""
        return http_json(f"http://127.0.0.1:{self.health_port}/status", timeout=timeout)


@dataclass
class Engine:
    name: str
    role: str
    port: int
    bootstrap_port: int
    capacity: int
    proc: ManagedProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class LocalCluster:
    """Starts and tracks the processes of one cluster name on one etcd."""

    def __init__(
        self, group: ProcessGroup, etcd_endpoint: str, cluster: str, *, python: str = sys.executable
    ):
        self.group = group
        self.etcd = etcd_endpoint
        self.cluster = cluster
        self.python = python
        self.masters: dict[str, Master] = {}
        self.agents: dict[str, Agent] = {}
        self.engines: dict[str, Engine] = {}

    def _module(self, module: str) -> list[str]:
        return [self.python, "-m", module]

    # -- masters ------------------------------------------------------------------------------
    def start_master(
        self, master_id: str, *, wait: bool = True, env: dict[str, str] | None = None, **extra: Any
    ) -> Master:
        prev = self.masters.get(master_id)
        http_port = prev.http_port if prev else free_port()
        grpc_port = prev.grpc_port if prev else free_port()
        for attempt in range(3):
            argv = self._module("pdmaster") + [
                "--etcd", self.etcd, "--cluster", self.cluster, "--master-id", master_id,
                "--http-host", "127.0.0.1", "--http-port", str(http_port),
                "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port),
                *_flags(extra),
            ]  # fmt: skip
            try:
                proc = self.group.start(
                    f"master-{master_id}",
                    argv,
                    env=env,
                    ready=f"http://127.0.0.1:{http_port}/health" if wait else None,
                )
                break
            except ProcessError as exc:
                # A port picked (or kept across a restart) can be taken by another process in the
                # meantime; anything else is a real failure.
                if "address already in use" not in str(exc) or attempt == 2:
                    raise
                http_port, grpc_port = free_port(), free_port()
        master = Master(master_id, http_port, grpc_port, proc, dict(extra))
        self.masters[master_id] = master
        return master

    def _start_on_free_ports(
        self,
        name: str,
        build: Callable[[], tuple[list[str], str | None]],
        env: dict[str, str] | None = None,
    ) -> ManagedProcess:
        """Start a process on ports ``build`` picks, picking again when one was taken meanwhile.

        A port that was free a moment ago can be bound by another process before ours binds it.
        """
        for attempt in range(3):
            argv, ready = build()
            try:
                return self.group.start(name, argv, env=env, ready=ready)
            except ProcessError as exc:
                if "address already in use" not in str(exc).lower() or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def start_master_when_free(self, master_id: str, timeout: float = 15.0) -> float:
        """(Re)start a master, retrying while etcd still holds the lease of a killed predecessor.

        The master binds HTTP before it registers, so a refused start may look healthy for a moment:
        only ``registered`` in ``/health`` on a live process counts. Not ``/readiness``: that also
        needs a prefill and a decode node, and the test may have stopped every agent of a role.
        Returns the seconds it took.
        """
        start = time.monotonic()
        while True:
            try:
                m = (
                    self.restart_master(master_id)
                    if master_id in self.masters
                    else self.start_master(master_id)
                )
                self.wait_for(lambda m=m: not m.proc.alive or _registered(m.url), timeout=30)  # type: ignore[misc]
                if m.proc.alive:
                    return time.monotonic() - start
            except ProcessError:
                pass
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"master {master_id} could not be restarted within {timeout}s")
            time.sleep(0.3)

    def restart_master(self, master_id: str) -> Master:
        old = self.masters[master_id]
        return self.start_master(master_id, **old.extra)

    # -- agents -------------------------------------------------------------------------------
    def start_agent(
        self,
        node_id: str,
        role: str,
        *,
        endpoint: str | None = None,
        capacity: int | None = None,
        wait: bool = True,
        env: dict[str, str] | None = None,
        **extra: Any,
    ) -> Agent:
        if endpoint is None:
            # No engine behind this agent: nothing to probe or check, and without an engine's running count
            # strict handover could only free a departed master's slots after --orphan-timeout.
            extra.setdefault("no_load_probe", True)
            extra.setdefault("no_health_check", True)  # nothing answers there: it would count as down
            extra.setdefault("handover", "fast")
            if role == "prefill":  # a prefill agent would otherwise ask its (absent) engine for one
                extra.setdefault("bootstrap_port", free_port())
        endpoint = endpoint or f"http://127.0.0.1:{free_port()}"
        argv = self._module("nodeagent") + [
            "--etcd", self.etcd, "--cluster", self.cluster, "--node-id", node_id,
            "--role", role, "--endpoint", endpoint,
            *([] if capacity is None else ["--running-max-req-size", str(capacity)]),
            *_flags(extra),
        ]  # fmt: skip
        ports: dict[str, int] = {}

        def build() -> tuple[list[str], str | None]:
            ports["health"] = free_port()
            tail = ["--health-host", "127.0.0.1", "--health-port", str(ports["health"])]
            return argv + tail, f"http://127.0.0.1:{ports['health']}/health" if wait else None

        proc = self._start_on_free_ports(f"agent-{node_id}", build, env)
        agent = Agent(node_id, role, endpoint, capacity, proc, dict(extra), ports["health"])
        self.agents[node_id] = agent
        return agent

    def restart_agent(self, node_id: str) -> Agent:
        a = self.agents[node_id]
        return self.start_agent(a.node_id, a.role, endpoint=a.endpoint, capacity=a.capacity, **a.extra)

    # -- engines ------------------------------------------------------------------------------
    def start_engine(
        self,
        name: str,
        role: str,
        capacity: int,
        *,
        fast: bool = True,
        port: int | None = None,
        bootstrap_port: int | None = None,
        **extra: Any,
    ) -> Engine:
        """A pdsim engine (``port``/``bootstrap_port``: fixed ones; ``bootstrap_port=0``: none)."""
        ports: dict[str, int] = {}

        def build() -> tuple[list[str], str | None]:
            ports.update(
                port=port if port is not None else free_port(),
                bootstrap=bootstrap_port if bootstrap_port is not None else free_port(),
            )
            argv = self._module("pdsim") + [
                "--role", role, "--host", "127.0.0.1", "--port", str(ports["port"]),
                "--running-max-req-size", str(capacity), "--bootstrap-port", str(ports["bootstrap"]),
                *(["--fast"] if fast else []), *_flags(extra),
            ]  # fmt: skip
            return argv, f"http://127.0.0.1:{ports['port']}/health"

        proc = self._start_on_free_ports(f"engine-{name}", build)
        engine = Engine(name, role, ports["port"], ports["bootstrap"], capacity, proc)
        self.engines[name] = engine
        return engine

    def start_node(
        self,
        name: str,
        role: str,
        capacity: int,
        *,
        fast: bool = True,
        engine_args: dict[str, Any] | None = None,
        **agent_extra: Any,
    ) -> Engine:
        """An engine and its agent, the way a GPU pod runs them (``engine_args``: extra pdsim flags)."""
        engine = self.start_engine(name, role, capacity, fast=fast, **(engine_args or {}))
        agent_extra.setdefault("bootstrap_port", engine.bootstrap_port)
        self.start_agent(name, role, endpoint=engine.url, capacity=capacity, **agent_extra)
        return engine

    # -- observation --------------------------------------------------------------------------
    def share_table(self) -> dict[str, dict[str, int]]:
        """master_id -> node_id -> effective share, for the live masters."""
        table: dict[str, dict[str, int]] = {}
        for mid, m in self.masters.items():
            if not m.proc.alive:
                continue
            try:
                table[mid] = m.shares()
            except (urllib.error.URLError, OSError, ValueError):
                continue
        return table

    def wait_for(self, predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> float:
        """Poll until predicate() holds; returns the seconds it took, raises TimeoutError otherwise."""
        start = time.monotonic()
        last_exc: BaseException | None = None
        while True:
            try:
                if predicate():
                    return time.monotonic() - start
            except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                last_exc = exc
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"condition not met within {timeout:.1f}s (last error: {last_exc})")
            time.sleep(interval)

    def full_capacity_held(self, masters: Iterable[str], capacities: dict[str, int]) -> bool:
        """Every node's capacity is split among exactly ``masters`` and each of them holds some of it.

        With strict handover (grants never exceed the split's targets) a full sum means every master
        holds exactly its target; "each holds some" keeps a master that has not joined yet from
        passing the check while the others still hold everything.
        """
        table = self.share_table()
        names = list(masters)
        if any(m not in table for m in names):
            return False
        if any(sum(table[m].values()) == 0 for m in names):
            return False
        return all(sum(table[m].get(node, 0) for m in names) == cap for node, cap in capacities.items())
