"""Network faults for the cluster tests: processes in their own network namespaces, cut, slowed and
made lossy between one another.

Topology. A *hub* namespace routes between *host* namespaces, one veth pair each (``eth0`` in the
host, ``h<k>`` in the hub), one /30 per link. Every address comes from one /24 of the benchmarking
range 198.18.0.0/15 (RFC 2544) that no route or address of the root namespace overlaps. The test
runner (root namespace) reaches the hosts through one more veth into the hub, with one address and
one route for that /24 in the root namespace: it sends the client load and reads ``/admission``,
``/status`` and ``/metrics`` that way. Faults never touch that link, so the observer stays outside
the experiment.

Faults are ``nft`` rules in the hub's own ``inet pdnf`` table (the root namespace's tables are never
read or written): a *cut* drops (silent) or rejects (TCP reset: refused) the packets between two
addresses, optionally of one TCP port only; *loss* drops a random N % (``numgen random mod 100 < N``);
:class:`Flapper` cuts and heals in a loop. This kernel has no ``netem``, so latency and jitter come
from :class:`FaultProxy`, a small asyncio TCP proxy run on the path (in front of etcd: every member
of a :class:`NetCluster` reaches etcd through it), tuned at run time over a Unix socket.

Names: every namespace is ``pdnf-<pid>-<run>-<host>`` (the pid of the process that made it), the
root veth ``pdnf<pid>x<run>``; namespaces whose pid is gone (a crashed run) are removed by the next
:meth:`Network.up`. :meth:`Network.down` removes everything, also after a failure; processes are
started and stopped by a :class:`~pdcoord.dev.launcher.ProcessGroup`, by PID only.

Run as a script it is the fault proxy: ``python netfault.py proxy --listen HOST:PORT --upstream
HOST:PORT --control PATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import itertools
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeagent.slicing import share_table, slice_shares
from pdcoord.dev.cluster import Agent, Engine, LocalCluster, Master, _flags, http_json, scrape_metrics
from pdcoord.dev.etcd_server import etcd_argv, find_etcd_binary
from pdcoord.dev.launcher import ProcessGroup
from pdcoord.dev.loadgen import (
    CONN_FAILED,
    BackgroundLoad,
    ClosedLoop,
    LoadConfig,
    Outcome,
    Request,
    RequestMix,
)
from pdcoord.dev.loadgen import Targets as LoadTargets

PREFIX = "pdnf"
RANGE = ipaddress.IPv4Network("198.18.0.0/15")  # RFC 2544 benchmarking addresses
TABLE = "inet pdnf"
_runs = itertools.count(1)


class NetfaultError(RuntimeError):
    """A namespace, link or rule could not be set up."""


def _run(argv: Sequence[str], *, check: bool = True, stdin: str | None = None) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, input=stdin, check=False)
    if check and proc.returncode != 0:
        raise NetfaultError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None when they can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and nft need root"
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)} (Debian packages iproute2, nftables)"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def reap_stale() -> list[str]:
    """Remove namespaces (and with them their veths) left by runs whose process is gone."""
    removed = []
    for name in _namespaces():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-.*", name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


def _pick_block(seed: int) -> ipaddress.IPv4Network:
    """A /24 of RANGE that nothing in the root namespace routes or holds (another run's, say)."""
    text = _run(["ip", "-4", "route", "show", "table", "all"]) + _run(["ip", "-4", "-o", "addr", "show"])
    used = []
    for found in re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)\b", text):
        with contextlib.suppress(ValueError):
            used.append(ipaddress.ip_network(found, strict=False))
    blocks = list(RANGE.subnets(new_prefix=24))
    for i in range(len(blocks)):
        block = blocks[(seed + i) % len(blocks)]
        if not any(block.overlaps(u) for u in used if isinstance(u, ipaddress.IPv4Network)):
            return block
    raise NetfaultError(f"every /24 of {RANGE} is in use in the root namespace")


@dataclass(frozen=True)
class Host:
    """A network namespace with one address, reached through the hub."""

    name: str
    ns: str
    addr: str
    hub_addr: str
    link: str  # the hub's end of its veth

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace (``ip netns exec`` execs it: the PID stays the same)."""
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass
class Fault:
    """Rules in the hub's table; :meth:`Network.heal` deletes them."""

    what: str
    handles: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    dropped: int = 0  # packets the rules matched, read when they are deleted


class Network:
    """The hub and its hosts; a context manager (``with Network() as net:``)."""

    def __init__(self, label: str = "t") -> None:
        run = next(_runs)
        self.id = f"{PREFIX}-{os.getpid()}-{label}{run}"
        self.hub = f"{self.id}-hub"
        self.root_if = f"{PREFIX}{os.getpid()}x{run}"[:15]
        self.hosts: dict[str, Host] = {}
        self.block: ipaddress.IPv4Network | None = None
        self.root_addr = ""
        self._links = 0
        self._made: list[str] = []  # namespaces created, in order
        self._faults: list[Fault] = []
        self._lock = threading.Lock()

    # -- setup and teardown -----------------------------------------------------------------------

    def __enter__(self) -> Network:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _addrs(self, k: int) -> tuple[str, str]:
        assert self.block is not None
        base = int(self.block.network_address) + 4 * k
        return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))

    def up(self) -> Network:
        reason = unavailable()
        if reason:
            raise NetfaultError(reason)
        reap_stale()
        try:
            self.block = _pick_block(os.getpid() * 31 + len(self.id))
            self._add_ns(self.hub)
            hub = ["ip", "netns", "exec", self.hub]
            _run([*hub, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
            ruleset = (
                f"table {TABLE} {{\n"
                "  chain forward { type filter hook forward priority 0; policy accept; }\n"
                "}\n"
            )
            _run([*hub, "nft", "-f", "-"], stdin=ruleset)
            # The runner's link: one address in the root namespace, a route for the block.
            hub_addr, self.root_addr = self._addrs(0)
            _run(
                ["ip", "link", "add", self.root_if, "type", "veth", "peer", "name", "root", "netns", self.hub]
            )
            _run(["ip", "-n", self.hub, "addr", "add", f"{hub_addr}/30", "dev", "root"])
            _run(["ip", "-n", self.hub, "link", "set", "root", "up"])
            _run(["ip", "addr", "add", f"{self.root_addr}/30", "dev", self.root_if])
            _run(["ip", "link", "set", self.root_if, "up"])
            _run(["ip", "route", "add", str(self.block), "via", hub_addr, "dev", self.root_if])
        except BaseException:
            self.down()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def add_host(self, name: str) -> Host:
        if name in self.hosts:
            return self.hosts[name]
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,20}", name):
            raise ValueError(f"host name {name!r}: 1-20 letters, digits, '-' or '_'")
        self._links += 1
        k = self._links
        if k >= 64:
            raise NetfaultError("a /24 holds 63 hosts")
        ns, link = f"{self.id}-{name}", f"h{k}"
        hub_addr, addr = self._addrs(k)
        self._add_ns(ns)
        _run(["ip", "-n", self.hub, "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run(["ip", "-n", self.hub, "addr", "add", f"{hub_addr}/30", "dev", link])
        _run(["ip", "-n", self.hub, "link", "set", link, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", ns, "route", "add", "default", "via", hub_addr])
        host = Host(name, ns, addr, hub_addr, link)
        self.hosts[name] = host
        return host

    def down(self) -> None:
        """Delete every namespace this network made (their veths go with them) and the root veth.
        The processes inside must have been stopped first: a namespace lives as long as they do."""
        for name in reversed(self._made):
            _run(["ip", "netns", "del", name], check=False)
        self._made.clear()
        if Path(f"/sys/class/net/{self.root_if}").exists():
            _run(["ip", "link", "del", self.root_if], check=False)
        self.hosts.clear()

    # -- faults -----------------------------------------------------------------------------------

    def _nft(self, *args: str) -> str:
        return _run(["ip", "netns", "exec", self.hub, "nft", *args])

    def _add_rules(self, what: str, rules: Iterable[str]) -> Fault:
        fault = Fault(what)
        with self._lock:
            try:
                for rule in rules:
                    out = self._nft("-e", "-a", "add", "rule", *TABLE.split(), "forward", *rule.split())
                    found = re.search(r"# handle (\d+)", out)
                    if not found:
                        raise NetfaultError(f"nft did not echo the handle of {rule!r}: {out!r}")
                    fault.handles.append(int(found.group(1)))
            except BaseException:
                self._delete(fault)
                raise
            self._faults.append(fault)
        return fault

    def _counters(self) -> dict[int, int]:
        out = self._nft("-a", "list", "chain", *TABLE.split(), "forward")
        return {
            int(m.group(2)): int(m.group(1))
            for m in re.finditer(r"counter packets (\d+) bytes \d+ .*?# handle (\d+)", out)
        }

    def _delete(self, fault: Fault) -> None:
        if not fault.handles:
            return  # healed already
        with contextlib.suppress(NetfaultError):
            counts = self._counters()
            fault.dropped = sum(counts.get(h, 0) for h in fault.handles)
        for handle in fault.handles:
            _run(
                ["ip", "netns", "exec", self.hub, "nft", "delete", "rule", *TABLE.split(), "forward",
                 "handle", str(handle)],
                check=False,
            )  # fmt: skip
        fault.handles.clear()

    def heal(self, fault: Fault) -> Fault:
        with self._lock:
            self._delete(fault)
            if fault in self._faults:
                self._faults.remove(fault)
        return fault

    def heal_all(self) -> None:
        for fault in list(self._faults):
            self.heal(fault)

    @staticmethod
    def _addr(x: Host | str) -> str:
        return x.addr if isinstance(x, Host) else x

    def cut(self, a: Host | str, b: Host | str, port: int | None = None, *, reject: bool = False) -> Fault:
        """Cut the path between ``a`` and ``b`` both ways; with ``port`` only connections from ``a`` to
        ``b``'s TCP ``port``. ``reject`` answers with a TCP reset (refused) instead of dropping."""
        x, y = self._addr(a), self._addr(b)
        verdict = "counter reject with tcp reset" if reject else "counter drop"
        proto = "meta l4proto tcp " if reject or port else ""
        there = f"tcp dport {port} " if port else ""
        back = f"tcp sport {port} " if port else ""
        what = f"{'reject' if reject else 'cut'} {x} <-> {y}" + (f" port {port}" if port else "")
        return self._add_rules(
            what,
            [
                f"ip saddr {x} ip daddr {y} {proto}{there}{verdict}",
                f"ip saddr {y} ip daddr {x} {proto}{back}{verdict}",
            ],
        )

    def isolate(self, host: Host | str, *, reject: bool = False) -> Fault:
        """Cut every path of ``host`` except the test runner's."""
        x, verdict = self._addr(host), ("counter reject with tcp reset" if reject else "counter drop")
        proto = "meta l4proto tcp " if reject else ""
        return self._add_rules(
            f"isolate {x}",
            [f"ip saddr {x} ip daddr != {self.root_addr} {proto}{verdict}",
             f"ip daddr {x} ip saddr != {self.root_addr} {proto}{verdict}"],
        )  # fmt: skip

    def loss(self, host: Host | str, percent: int) -> Fault:
        """Drop ``percent`` % of the packets to and from ``host`` (not the test runner's)."""
        if not 0 < percent <= 100:
            raise ValueError("percent must be in 1..100")
        x = self._addr(host)
        draw = f"numgen random mod 100 < {percent} counter drop"
        return self._add_rules(
            f"loss {percent}% {x}",
            [
                f"ip saddr {x} ip daddr != {self.root_addr} {draw}",
                f"ip daddr {x} ip saddr != {self.root_addr} {draw}",
            ],
        )


class Flapper:
    """Applies a fault for ``down_s``, heals it for ``up_s``, in a loop until :meth:`stop`."""

    def __init__(
        self, net: Network, make: Callable[[], Fault], *, up_s: float = 2.0, down_s: float = 2.0
    ) -> None:
        self.net, self.make, self.up_s, self.down_s = net, make, up_s, down_s
        self.toggles: list[tuple[float, str]] = []
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flapper", daemon=True)

    def start(self) -> Flapper:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            fault = self.make()
            self.toggles.append((time.monotonic(), "down"))
            self._stop.wait(self.down_s)
            self.dropped += self.net.heal(fault).dropped
            self.toggles.append((time.monotonic(), "up"))
            if self._stop.wait(self.up_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


# -- the fault proxy ----------------------------------------------------------------------------


class FaultProxy:
    """A TCP proxy that delays every chunk by ``delay ± jitter`` (uniform), each direction on its own,
    keeping each direction's order (a chunk never overtakes an earlier one)."""

    def __init__(self, upstream: tuple[str, int], seed: int | None = None) -> None:
        self.upstream = upstream
        self.delay_s = 0.0
        self.jitter_s = 0.0
        self.rng = random.Random(seed)
        self.connections = 0
        self.active = 0

    def state(self) -> dict[str, Any]:
        return {
            "delay_ms": self.delay_s * 1e3,
            "jitter_ms": self.jitter_s * 1e3,
            "connections": self.connections,
            "active": self.active,
        }

    def _delay(self) -> float:
        if not self.delay_s and not self.jitter_s:
            return 0.0
        return max(0.0, self.delay_s + self.rng.uniform(-self.jitter_s, self.jitter_s))

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()

        writer = asyncio.create_task(deliver())
        last = 0.0
        try:
            while True:
                data = await src.read(1 << 16)
                last = max(last, loop.time() + self._delay())
                queue.put_nowait((last, data))
                if not data:
                    break
            await writer
        finally:
            writer.cancel()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.active += 1
        up_writer: asyncio.StreamWriter | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            for end in (writer, up_writer):
                sock = end.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pumps = [
                asyncio.create_task(self._pump(reader, up_writer)),
                asyncio.create_task(self._pump(up_reader, writer)),
            ]
            # Both directions end (EOF each way), or one fails and the other is cut with it.
            _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        except OSError:
            pass
        finally:
            self.active -= 1
            for w in (writer, up_writer):
                if w is not None:
                    w.close()

    async def control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    change = json.loads(line)
                    if "delay_ms" in change:
                        self.delay_s = max(0.0, float(change["delay_ms"]) / 1e3)
                    if "jitter_ms" in change:
                        self.jitter_s = max(0.0, float(change["jitter_ms"]) / 1e3)
                    if "seed" in change:
                        self.rng.seed(change["seed"])
                    answer = self.state()
                except (ValueError, TypeError, AttributeError) as exc:
                    answer = {"error": str(exc)}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        finally:
            writer.close()


async def _serve_proxy(listen: tuple[str, int], upstream: tuple[str, int], control_path: str) -> None:
    proxy = FaultProxy(upstream)
    server = await asyncio.start_server(proxy.handle, *listen)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(control_path)
    control = await asyncio.start_unix_server(proxy.control, control_path)
    print(
        f"netfault proxy {listen[0]}:{listen[1]} -> {upstream[0]}:{upstream[1]} control {control_path}",
        flush=True,
    )
    async with server, control:
        await asyncio.gather(server.serve_forever(), control.serve_forever())


class ProxyControl:
    """Talks to a running proxy over its control socket (which every namespace can reach: it is a file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)

    def set(self, **change: float) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(self.path)
            sock.sendall(json.dumps(change).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        answer: dict[str, Any] = json.loads(data)
        if "error" in answer:
            raise NetfaultError(f"proxy control: {answer['error']}")
        return answer

    def state(self) -> dict[str, Any]:
        return self.set()

    def answers(self) -> bool:
        try:
            self.state()
        except (OSError, ValueError, NetfaultError):
            return False
        return True


# -- a pdcoord fleet in namespaces -----------------------------------------------------------------

# Every process has a namespace (an address) of its own, so the ports can be fixed.
ETCD_PORT, ETCD_INNER_PORT = 2379, 2381
MASTER_HTTP, MASTER_GRPC = 8000, 50051
ENGINE_PORT, BOOTSTRAP_PORT, AGENT_HEALTH = 30000, 31000, 9100


@dataclass
class NetMaster(Master):
    host: str = ""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"


@dataclass
class NetAgent(Agent):
    host: str = ""

    def status(self, timeout: float = 2.0) -> dict[str, Any]:
        answer: dict[str, Any] = http_json(f"http://{self.host}:{self.health_port}/status", timeout=timeout)
        return answer


@dataclass
class NetEngine(Engine):
    host: str = ""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class NetCluster(LocalCluster):
    """A :class:`LocalCluster` whose etcd, masters and nodes (an engine with its agent, as on a GPU
    host) each live in a namespace of ``net``, named after them. etcd listens on its namespace's
    loopback only; everyone reaches it through a :class:`FaultProxy` on its namespace's address."""

    def __init__(
        self, group: ProcessGroup, net: Network, cluster: str, *, python: str = sys.executable
    ) -> None:
        self.net = net
        self.etcd_host = net.add_host("etcd")
        super().__init__(group, f"{self.etcd_host.addr}:{ETCD_PORT}", cluster, python=python)
        self.proxy: ProxyControl | None = None

    def start_etcd(self, data_dir: str | Path) -> None:
        h = self.etcd_host
        control = Path(self.group.log_dir) / f"{self.net.id}-etcd-proxy.sock"
        self.proxy = ProxyControl(control)
        proxy = [self.python, str(Path(__file__).resolve()), "proxy", "--listen", f"{h.addr}:{ETCD_PORT}",
                 "--upstream", f"127.0.0.1:{ETCD_INNER_PORT}", "--control", str(control)]  # fmt: skip
        self.group.start("etcd-proxy", h.argv(proxy), ready=self.proxy.answers)
        binary = find_etcd_binary()
        argv = etcd_argv(binary, host="127.0.0.1", port=ETCD_INNER_PORT, peer_port=ETCD_INNER_PORT + 1,
                         data_dir=str(data_dir), log_level="warn")  # fmt: skip
        # Ready when it answers through the proxy: the path every member uses.
        self.group.start("etcd", h.argv(argv), ready=f"http://{h.addr}:{ETCD_PORT}/health", ready_timeout=30)

    def start_master(
        self, master_id: str, *, wait: bool = True, env: dict[str, str] | None = None, **extra: Any
    ) -> Master:
        h = self.net.add_host(master_id)
        argv = self._module("pdmaster") + [
            "--etcd", self.etcd, "--cluster", self.cluster, "--master-id", master_id,
            "--http-host", h.addr, "--http-port", str(MASTER_HTTP),
            "--grpc-host", h.addr, "--grpc-port", str(MASTER_GRPC),
            *_flags(extra),
        ]  # fmt: skip
        ready = f"http://{h.addr}:{MASTER_HTTP}/health" if wait else None
        proc = self.group.start(f"master-{master_id}", h.argv(argv), env=env, ready=ready)
        master = NetMaster(master_id, MASTER_HTTP, MASTER_GRPC, proc, dict(extra), host=h.addr)
        self.masters[master_id] = master
        return master

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
        h = self.net.add_host(node_id)
        endpoint = endpoint or f"http://{h.addr}:{ENGINE_PORT}"
        argv = self._module("nodeagent") + [
            "--etcd", self.etcd, "--cluster", self.cluster, "--node-id", node_id,
            "--role", role, "--endpoint", endpoint,
            *([] if capacity is None else ["--running-max-req-size", str(capacity)]),
            "--health-host", h.addr, "--health-port", str(AGENT_HEALTH),
            *_flags(extra),
        ]  # fmt: skip
        ready = f"http://{h.addr}:{AGENT_HEALTH}/health" if wait else None
        proc = self.group.start(f"agent-{node_id}", h.argv(argv), env=env, ready=ready)
        agent = NetAgent(node_id, role, endpoint, capacity, proc, dict(extra), AGENT_HEALTH, host=h.addr)
        self.agents[node_id] = agent
        return agent

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
        h = self.net.add_host(name)
        port = ENGINE_PORT if port is None else port
        bport = BOOTSTRAP_PORT if bootstrap_port is None else bootstrap_port
        argv = self._module("pdsim") + [
            "--role", role, "--host", h.addr, "--port", str(port),
            "--running-max-req-size", str(capacity), "--bootstrap-port", str(bport),
            *(["--fast"] if fast else []), *_flags(extra),
        ]  # fmt: skip
        proc = self.group.start(f"engine-{name}", h.argv(argv), ready=f"http://{h.addr}:{port}/health")
        engine = NetEngine(name, role, port, bport, capacity, proc, host=h.addr)
        self.engines[name] = engine
        return engine

    def host(self, name: str) -> Host:
        return self.net.hosts[name]


# -- load, observation and scenarios ---------------------------------------------------------------

PREFILL = {"p1": 8}
DECODE = {"d1": 6, "d2": 6}
CAPS = {**PREFILL, **DECODE}
MASTERS = ["m1", "m2"]
MODEL = "sim"
DECODE_STEP_MS = 25.0  # per token: 12-20 tokens make a request of 0.3-0.5 s
# What a client may see besides a result: an HTTP error status, or an SSE error event after the
# first chunk. Not allowed: a hang, a broken connection, a stream that ends without [DONE], a body
# that is not an answer (unless its master was killed on purpose, see ``killed``).
EXPLICIT_STREAM_ERRORS = {"stream_error"}


@dataclass
class VariedMix(RequestMix):
    """The cluster suite's mix with ``max_tokens`` drawn from a range per request."""

    token_range: tuple[int, int] = (12, 20)

    def requests(self, rng: random.Random, tag: str) -> Iterator[Request]:
        for req in super().requests(rng, tag):
            req.body["max_tokens"] = rng.randint(*self.token_range)
            yield req


class CountingLoop(ClosedLoop):
    """Counts every attempt sent, to compare with the outcomes that came back."""

    def __init__(self, targets: LoadTargets, cfg: LoadConfig) -> None:
        super().__init__(targets, cfg)
        self.sent = 0

    async def _attempt(self, http: Any, base: str, req: Request) -> Any:
        with self._lock:
            self.sent += 1
        return await super()._attempt(http, base, req)


def saturating_load(
    targets: LoadTargets, *, users: int = 20, seed: int = 1, tokens: tuple[int, int] = (12, 20)
) -> BackgroundLoad:
    """More closed-loop clients than decode slots, requests of ``tokens`` tokens (0.3-0.5 s at the
    default step); a refused client waits its Retry-After (at most 0.2 s) so that a master at capacity
    0 is not hammered."""
    mix = VariedMix(
        token_range=tokens,
        weights={"gang": 0.1, "session": 0.3, "cold": 0.6},
        gang_n=2,
        stream_fraction=0.6,
        model=MODEL,
    )
    cfg = LoadConfig(users=users, seed=seed, request_timeout_s=60.0, mix=mix, max_backoff_s=0.2,
                     fresh_connections=True)  # fmt: skip
    load = BackgroundLoad(targets, cfg)
    load.loop = CountingLoop(targets, cfg)
    return load


def engine_counts(c: LocalCluster, names: Iterable[str]) -> dict[str, dict[str, float]]:
    """The over-capacity check of each decode engine, and its legacy queued count."""
    out = {}
    for n in names:
        m = scrape_metrics(c.engines[n].url)
        out[n] = {k: m.get(k, 0.0) for k in ("pdsim_over_capacity_total", "pdsim_held_high_water",
                                             "pdsim_queued_total", "pdsim_max_running")}  # fmt: skip
    return out


def holds_free(
    table: dict[str, dict[str, int]],
    active: dict[str, dict[str, int]],
    owners: dict[str, list[str]],
    caps: dict[str, int],
) -> bool:
    """On every node the owners hold all the slots that the other masters' leases do not run: what
    they may hold without cutting anyone's request short."""
    for node, cap in caps.items():
        held = sum(table.get(m, {}).get(node, 0) for m in owners[node])
        running = sum(active.get(m, {}).get(node, 0) for m in table if m not in owners[node])
        if held + running < cap:
            return False
    return True


def holds(table: dict[str, dict[str, int]], owners: dict[str, list[str]], caps: dict[str, int]) -> bool:
    """Every node's capacity is held, exactly as the static split gives it, by its ``owners``."""
    for node, cap in caps.items():
        expected = slice_shares(cap, owners[node], node)
        for m in owners[node]:
            if table.get(m, {}).get(node) != expected[m]:
                return False
    return True


def summarize_outcomes(results: Sequence[Outcome]) -> dict[str, int]:
    by: dict[str, int] = {}
    for r in results:
        key = "ok" if r.ok else f"{r.status} {r.error}"
        by[key] = by.get(key, 0) + 1
    return dict(sorted(by.items(), key=lambda kv: -kv[1]))


@dataclass
class Faulted:
    """A fault in place: ``heal`` ends it; ``dropped`` counts the packets its rules matched."""

    heal: Callable[[], None]
    dropped: Callable[[], int] = lambda: 0
    # node -> the masters that can still hold it while the fault lasts (default: all of them)
    owners: dict[str, list[str]] | None = None
    killed: dict[str, float] = field(default_factory=dict)  # master -> when it was SIGKILLed
    notes: dict[str, Any] = field(default_factory=dict)
    min_hold_s: float = 0.0  # how long the fault lasts at least once ``apply`` returned
    # set by a fault that measured it itself while ``apply`` ran (the slow etcd: its failover)
    survivors_full_s: float | None = None
    heal_on_error: Callable[[], None] | None = None  # undoes what ``heal`` might not have reached


@dataclass
class ScenarioResult:
    name: str
    what: str
    cut_s: float
    survivors_full_s: float | None  # from the fault to its owners holding every node; None: not in the cut
    # from the fault to its owners holding every slot the other masters' leases do not run (the
    # slots of requests a cut-off master still runs follow as those end); None: not in the cut
    survivors_free_s: float | None
    full_after_heal_s: float | None  # from the heal to the exact split on every master; None: not converged
    unheld_s: float  # time during the fault in which the owners did not hold their exact split
    longest_unheld_s: float  # its longest stretch
    min_capacity: dict[str, int]  # per master, the least decode capacity seen during the fault
    requests: int
    sent: int
    outcomes: dict[str, int]
    bad: list[str]  # requests that hung, were lost or broke without an explicit error
    over_capacity: dict[str, float]  # per decode engine, during this scenario
    held_high_water: dict[str, float]  # per decode engine, since it started
    queued: dict[str, float]  # pdsim_queued_total during this scenario, per decode engine
    dropped_packets: int
    notes: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Fleet:
    """A network, its processes and the load targets: what every scenario runs against."""

    def __init__(self, group: ProcessGroup, net: Network, cluster: str, data_dir: str | Path,
                 *, agent_extra: dict[str, Any] | None = None, master_extra: dict[str, Any] | None = None,
                 decode_ms: float = DECODE_STEP_MS) -> None:  # fmt: skip
        self.net = net
        self.c = NetCluster(group, net, cluster)
        self.agent_extra = {"share_policy": "static", "model": MODEL, **(agent_extra or {})}
        self.master_extra = {"model": MODEL, **(master_extra or {})}
        self.data_dir = data_dir
        self.decode_ms = decode_ms
        self.targets: list[str] = []
        self._lock = threading.Lock()

    def start(self) -> Fleet:
        c = self.c
        c.start_etcd(self.data_dir)
        for m in MASTERS:
            c.start_master(m, **self.master_extra)
        for name, cap in PREFILL.items():
            c.start_node(name, "prefill", cap, **self.agent_extra)
        for name, cap in DECODE.items():
            c.start_node(
                name, "decode", cap, engine_args={"decode_base_ms": self.decode_ms}, **self.agent_extra
            )
        self.wait_exact(60)
        self.targets = list(MASTERS)
        return self

    def load_targets(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(m, self.c.masters[m].url) for m in self.targets]

    def set_targets(self, names: Iterable[str]) -> None:
        with self._lock:
            self.targets = list(names)

    def table(self) -> dict[str, dict[str, int]]:
        return self.c.share_table()

    def exact(self) -> bool:
        return self.table() == share_table(MASTERS, CAPS)

    def wait_exact(self, timeout: float) -> float:
        return self.c.wait_for(self.exact, timeout, interval=0.05)

    def restart_agent(self, node: str, extra: dict[str, Any], timeout: float = 60.0) -> None:
        """Start ``node``'s agent again with the flags ``extra`` (its engine stays), and wait for the
        exact split."""
        old = self.c.agents[node]
        old.proc.terminate()
        self.c.start_agent(node, old.role, endpoint=old.endpoint, capacity=old.capacity, **extra)
        self.wait_exact(timeout)

    @contextlib.contextmanager
    def agent_flags(self, flags: dict[str, dict[str, Any]]) -> Iterator[None]:
        """These agents run with these flags added inside the block (restarted before, and after with
        the flags they had)."""
        before = {node: dict(self.c.agents[node].extra) for node in flags}
        for node, f in flags.items():
            self.restart_agent(node, {**before[node], **f})
        try:
            yield
        finally:
            for node, extra in before.items():
                self.restart_agent(node, extra)

    def view(self) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
        """Per live master, from one ``/admission`` each: node -> effective share, node -> active slots."""
        shares: dict[str, dict[str, int]] = {}
        active: dict[str, dict[str, int]] = {}
        for mid, m in self.c.masters.items():
            if not m.proc.alive:
                continue
            with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
                snap = m.admission()
                shares[mid] = {n["node_id"]: int(n["effective_share"]) for n in snap["nodes"]}
                active[mid] = {n: int(v["active"]) for n, v in snap.get("admission_nodes", {}).items()}
        return shares, active

    def capacities(self) -> dict[str, int]:
        out = {}
        for m in MASTERS:
            with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
                out[m] = int(http_json(self.c.masters[m].url + "/admission?nodes=0", timeout=1.0)["capacity"])
        return out


def run_scenario(
    fleet: Fleet,
    name: str,
    what: str,
    apply: Callable[[Fleet], Faulted],
    *,
    cut_s: float = 10.0,
    heal_timeout_s: float = 90.0,
    users: int = 20,
    tokens: tuple[int, int] = (12, 20),
    log: Callable[[str], None] = print,
) -> ScenarioResult:
    """Saturating load; the fault for ``cut_s``; heal; wait for the exact split on every master.

    Measures the time from the fault to its surviving owners holding the whole capacity and from the
    heal to the exact split, the least capacity each master had, the outcome of every request and the
    engines' over-capacity checks. Asserts nothing: the caller decides."""
    with fleet.agent_flags(AGENT_FLAGS.get(name, {})):
        return _run_scenario(
            fleet,
            name,
            what,
            apply,
            cut_s=cut_s,
            heal_timeout_s=heal_timeout_s,
            users=users,
            tokens=tokens,
            log=log,
        )


def _run_scenario(
    fleet: Fleet,
    name: str,
    what: str,
    apply: Callable[[Fleet], Faulted],
    *,
    cut_s: float,
    heal_timeout_s: float,
    users: int,
    tokens: tuple[int, int],
    log: Callable[[str], None],
) -> ScenarioResult:
    c = fleet.c
    fleet.wait_exact(heal_timeout_s)  # the previous scenario left it whole
    before = engine_counts(c, DECODE)
    load = saturating_load(fleet.load_targets, users=users, tokens=tokens)
    load.start()
    faulted: Faulted | None = None
    survivors_full: float | None = None
    survivors_free: float | None = None
    full_after_heal: float | None = None
    min_cap: dict[str, int] = {}
    unheld = longest_unheld = 0.0  # seconds of the fault in which the owners did not hold their split
    t_cut = t_heal = time.monotonic()
    try:
        load.wait_for_results(users, timeout=30)
        t_cut = time.monotonic()
        faulted = apply(fleet)
        owners = faulted.owners or {n: list(MASTERS) for n in CAPS}
        t_applied = time.monotonic()
        until = max(t_cut + cut_s, t_applied + faulted.min_hold_s)
        last = t_applied  # the previous sample
        since: float | None = None  # the start of the current stretch not held
        while (now := time.monotonic()) < until:
            held = False
            with contextlib.suppress(OSError, ValueError, urllib.error.URLError, KeyError):
                table, active = fleet.view()
                held = holds(table, owners, CAPS)
                if survivors_free is None and holds_free(table, active, owners, CAPS):
                    survivors_free = now - t_cut
            if held:
                if survivors_full is None:
                    survivors_full = now - t_cut
                if since is not None:
                    longest_unheld = max(longest_unheld, now - since)
                    since = None
            else:
                unheld += now - last
                since = now if since is None else since
            last = now
            for m, cap in fleet.capacities().items():
                min_cap[m] = min(min_cap.get(m, cap), cap)
            time.sleep(0.05)
        t_heal = time.monotonic()
        if since is not None:
            longest_unheld = max(longest_unheld, t_heal - since)
        faulted.heal()
        with contextlib.suppress(TimeoutError):
            full_after_heal = fleet.wait_exact(heal_timeout_s)
        time.sleep(1.0)  # a moment of load on the whole fleet again
    finally:
        if faulted is not None and faulted.heal_on_error is not None:
            faulted.heal_on_error()
        results = load.stop()
    after = engine_counts(c, DECODE)
    over0 = {n: before[n]["pdsim_over_capacity_total"] for n in DECODE}
    sent = load.loop.sent if isinstance(load.loop, CountingLoop) else len(results)
    killed = faulted.killed if faulted is not None else {}
    bad = []
    for r in results:
        if r.ok or r.status >= 400 or r.error in EXPLICIT_STREAM_ERRORS:
            continue
        at = killed.get(r.master)
        if at is not None and r.started <= at and (r.status == CONN_FAILED or r.error == "stream_truncated"):
            continue  # in flight on a master SIGKILLed on purpose: the client saw its connection break
        bad.append(f"{r.master} {r.kind} status {r.status} {r.error or ''} after {r.latency_s:.1f}s".strip())
    ended = sum(len(r.attempts) for r in results)
    if ended != sent:
        bad.append(f"{sent} requests sent, {ended} ended")
    if faulted is not None and faulted.survivors_full_s is not None:
        survivors_full = faulted.survivors_full_s
        survivors_free = survivors_full if survivors_free is None else min(survivors_free, survivors_full)
    result = ScenarioResult(
        name=name,
        what=what,
        cut_s=round(t_heal - t_cut, 2),
        survivors_full_s=None if survivors_full is None else round(survivors_full, 2),
        survivors_free_s=None if survivors_free is None else round(survivors_free, 2),
        full_after_heal_s=None if full_after_heal is None else round(full_after_heal, 2),
        unheld_s=round(unheld, 2),
        longest_unheld_s=round(longest_unheld, 2),
        min_capacity=min_cap,
        requests=len(results),
        sent=sent,
        outcomes=summarize_outcomes(results),
        bad=bad,
        over_capacity={n: after[n]["pdsim_over_capacity_total"] - over0[n] for n in DECODE},
        held_high_water={n: after[n]["pdsim_held_high_water"] for n in DECODE},
        queued={n: after[n]["pdsim_queued_total"] - before[n]["pdsim_queued_total"] for n in DECODE},
        dropped_packets=faulted.dropped() if faulted is not None else 0,
        notes=dict(faulted.notes) if faulted is not None else {},
    )
    full = "-" if survivors_full is None else f"{survivors_full:.2f}s"
    free = "-" if survivors_free is None else f"{survivors_free:.2f}s"
    healed = "never" if full_after_heal is None else f"{full_after_heal:.2f}s"
    log(
        f"{name}: {what}; its owners held everything {full} (all but the slots others still ran: {free}) "
        f"into the {result.cut_s:.1f}s fault, the exact "
        f"split {healed} after the heal; not held {result.unheld_s:.2f}s (longest "
        f"{result.longest_unheld_s:.2f}s); least capacity {min_cap}; {len(results)} requests "
        f"{result.outcomes}; over capacity {result.over_capacity}, held high water "
        f"{result.held_high_water}, queued {result.queued}; {result.dropped_packets} packets dropped; "
        f"{result.notes}"
    )
    return result


# -- the scenarios ---------------------------------------------------------------------------------


def _cut(
    fleet: Fleet,
    pairs: Sequence[tuple[str, str, int | None]],
    owners: dict[str, list[str]] | None = None,
    *,
    reject: bool = False,
) -> Faulted:
    net = fleet.net
    faults = [net.cut(net.hosts[a], net.hosts[b], port, reject=reject) for a, b, port in pairs]

    def heal() -> None:
        for f in faults:
            net.heal(f)

    return Faulted(heal, lambda: sum(f.dropped for f in faults), owners, heal_on_error=heal)


def master_etcd_cut(fleet: Fleet) -> Faulted:
    """m1 loses etcd; clients and agents still reach it. Its lease expires and its key goes: m2 is
    the owner of everything."""
    return _cut(fleet, [("m1", "etcd", ETCD_PORT)], {n: ["m2"] for n in CAPS})


def agent_etcd_cut(fleet: Fleet) -> Faulted:
    """d1's agent loses etcd, not the masters: the split should not change."""
    return _cut(fleet, [("d1", "etcd", ETCD_PORT)])


def master_some_agents_cut(fleet: Fleet) -> Faulted:
    """m1's gRPC port cut from the agents of p1 and d1 (its data plane to their engines and its link to
    d2's agent stay): m2 owns p1 and d1, d2 stays split."""
    owners = {"p1": ["m2"], "d1": ["m2"], "d2": list(MASTERS)}
    return _cut(fleet, [("p1", "m1", MASTER_GRPC), ("d1", "m1", MASTER_GRPC)], owners)


def one_agent_one_master_cut(fleet: Fleet) -> Faulted:
    """d2's agent cut from m2's gRPC port: m1 owns d2."""
    owners = {"p1": list(MASTERS), "d1": list(MASTERS), "d2": ["m1"]}
    return _cut(fleet, [("d2", "m2", MASTER_GRPC)], owners)


def one_agent_one_master_reject(fleet: Fleet) -> Faulted:
    """d2's agent refused by m2's gRPC port (TCP resets): to the agent m2 looks like a process that is
    gone, while it lives and its requests still run on d2. m1 owns d2; its slots must wait for them."""
    owners = {"p1": list(MASTERS), "d1": list(MASTERS), "d2": ["m1"]}
    return _cut(fleet, [("d2", "m2", MASTER_GRPC)], owners, reject=True)


def agent_loss(fleet: Fleet, percent: int = 5) -> Faulted:
    """5 % of the packets to and from d1 (its agent and its engine) are lost."""
    net = fleet.net
    fault = net.loss(net.hosts["d1"], percent)

    def heal() -> None:
        net.heal(fault)

    return Faulted(heal, lambda: fault.dropped, heal_on_error=heal)


def flapping_link(fleet: Fleet) -> Faulted:
    """d1's link (its agent and its engine, to everyone but the test runner) down 2 s, up 2 s."""
    net = fleet.net
    flapper = Flapper(net, lambda: net.isolate(net.hosts["d1"])).start()
    notes: dict[str, Any] = {}

    def heal() -> None:
        flapper.stop()
        notes["toggles"] = len(flapper.toggles)

    return Faulted(heal, lambda: flapper.dropped, notes=notes, heal_on_error=flapper.stop)


def slow_etcd(fleet: Fleet, delay_ms: float = 300.0, jitter_ms: float = 200.0) -> Faulted:
    """etcd answers 300 ms ± 200 ms late (each direction of the proxy delays by half of both), and
    while it does m2 is SIGKILLed (failover: m1 owns everything) and started again (join: the exact
    split). The fault then lasts 3 s more with both masters."""
    c = fleet.c
    proxy = c.proxy
    assert proxy is not None

    def heal() -> None:
        proxy.set(delay_ms=0, jitter_ms=0)
        fleet.set_targets(MASTERS)

    proxy.set(delay_ms=delay_ms / 2, jitter_ms=jitter_ms / 2)
    result = Faulted(heal, min_hold_s=3.0, heal_on_error=heal)
    try:
        time.sleep(2.0)  # the split under a slow etcd, before the kill
        fleet.set_targets(["m1"])  # the load balancer stops sending to m2 first
        alone = {n: ["m1"] for n in CAPS}
        t_kill = time.monotonic()
        c.masters["m2"].proc.kill()
        result.killed["m2"] = t_kill
        failover = c.wait_for(lambda: holds(fleet.table(), alone, CAPS), 60, interval=0.05)
        t_start = time.monotonic()
        restart = c.start_master_when_free("m2", timeout=60)
        join = c.wait_for(fleet.exact, 60, interval=0.05)
        fleet.set_targets(MASTERS)
    except BaseException:
        heal()
        raise
    result.survivors_full_s = failover
    result.notes.update(
        failover_s=round(failover, 2),  # SIGKILL -> m1 holds every node
        restart_s=round(restart, 2),  # start -> registered (waits for the killed one's lease to expire)
        join_s=round(time.monotonic() - t_start, 2),  # start -> the exact split on both
        join_after_registered_s=round(join, 2),
    )
    return result


# Agent flags a scenario runs with (the agent is restarted with them before and without them after).
# Behind resets the agent must not take a refusal for a dead master: m2 lives and, until it notices
# the cut (its keep-alive), may place work on d2 under its share, which the agent would hand on at once.
AGENT_FLAGS: dict[str, dict[str, dict[str, Any]]] = {
    "one_agent_one_master_reject": {"d2": {"no_gone_on_refusal": True}},
}

SCENARIOS: dict[str, tuple[str, Callable[[Fleet], Faulted]]] = {
    "master_etcd_cut": ("m1 cut from etcd (clients and agents reach it)", master_etcd_cut),
    "agent_etcd_cut": ("d1's agent cut from etcd (masters reach it)", agent_etcd_cut),
    "master_some_agents_cut": ("m1 cut from the agents of p1 and d1 (gRPC)", master_some_agents_cut),
    "one_agent_one_master_cut": ("d2's agent cut from m2 (gRPC)", one_agent_one_master_cut),
    "one_agent_one_master_reject": (
        "d2's agent refused by m2 (gRPC resets; --no-gone-on-refusal)",
        one_agent_one_master_reject,
    ),
    "slow_etcd": ("etcd 300 ms ± 200 ms; m2 SIGKILLed and restarted", slow_etcd),
    "agent_loss": ("5 % loss on d1's links", agent_loss),
    "flapping_link": ("d1's link up 2 s, down 2 s", flapping_link),
}
# The same resets with d2's agent at its defaults, which take m2's refusal for its death: the hazard
# --no-gone-on-refusal closes, for the benchmark to count (not a test: it may overshoot).
HAZARDS: dict[str, tuple[str, Callable[[Fleet], Faulted]]] = {
    "one_agent_one_master_reject_gone": (
        "d2's agent refused by m2 (gRPC resets; the default, refused = gone)",
        one_agent_one_master_reject,
    ),
}


@contextlib.contextmanager
def fleet_in_namespaces(log_dir: str | Path, cluster: str, **kw: Any) -> Iterator[Fleet]:
    """A started :class:`Fleet`; everything (processes, namespaces, veths) removed on exit."""
    log_dir = Path(log_dir)
    group = ProcessGroup(log_dir / "logs", handle_signals=False)
    net = Network("f")
    try:
        net.up()
        fleet = Fleet(group, net, cluster, log_dir / "etcd-data", **kw)
        fleet.start()
        yield fleet
    finally:
        try:
            group.close()
        finally:
            net.down()


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="netfault", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("proxy", help="run the fault proxy")
    p.add_argument("--listen", required=True, type=_hostport)
    p.add_argument("--upstream", required=True, type=_hostport)
    p.add_argument("--control", required=True)
    sub.add_parser("reap", help="remove namespaces left by runs whose process is gone")
    args = parser.parse_args(argv)
    if args.cmd == "proxy":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve_proxy(args.listen, args.upstream, args.control))
    else:
        print("\n".join(reap_stale()) or "nothing to remove")


if __name__ == "__main__":
    main()
