"""Network faults under saturating load: cut, slow, lossy and flapping links between real processes,
each in its own network namespace (``tests/cluster/netfault.py``).

One fleet for the whole module — etcd behind a fault proxy, masters m1 and m2, a prefill node p1 (8)
and decode nodes d1 and d2 (6 slots each; a node is a pdsim engine with its agent, static split) —
and one scenario per test, each from a whole fleet back to a whole fleet: 20 closed-loop clients
send requests of 0.3-0.5 s through both masters, the fault lasts about 10 s, heals, and the test
waits (generously) for the exact split on every master again.

Every scenario must keep the invariants: no decode engine ever holds more than its capacity
(``pdsim_over_capacity_total`` stays 0) and every request ends in a result or an explicit error
(none hangs, none is lost: as many ended as were sent). Times — from the fault to the masters that
can still reach a node holding all of it, and from the heal to the exact split — are printed (run
with ``-s``) and never asserted: ``bench/netfault_bench.py`` records them.

Needs root, ``ip`` and ``nft`` (skipped without, a failure in CI).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest

from tests.cluster import netfault
from tests.cluster.netfault import (
    SCENARIOS,
    FaultProxy,
    Fleet,
    ScenarioResult,
    fleet_in_namespaces,
    run_scenario,
)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    reason = netfault.unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"the network-fault tests must run in CI: {reason}")
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("netfault")
    with fleet_in_namespaces(base, f"netfault-{os.getpid()}") as f:
        yield f


@pytest.fixture
def logged_fleet(request: pytest.FixtureRequest, fleet: Fleet) -> Iterator[Fleet]:
    """The fleet; the last lines of every process's log when the test failed."""
    yield fleet
    if getattr(getattr(request.node, "rep_call", None), "failed", False):
        for proc in fleet.c.group.processes:
            print(f"\n===== {proc.name} {proc.log_path}\n{proc.tail(30)}")


def check(result: ScenarioResult) -> None:
    assert result.requests > 40, f"too little load went through: {result.outcomes}"
    assert result.outcomes.get("ok", 0) > 20, result.outcomes
    over = {n: v for n, v in result.over_capacity.items() if v}
    assert not over, (
        f"a router over-admitted: pdsim_over_capacity_total rose by {over} during {result.name} "
        f"(held high water {result.held_high_water})"
    )
    assert not result.bad, f"{len(result.bad)} requests hung, broke or were lost: {result.bad[:10]}"
    assert result.sent == sum(result.outcomes.values()), (result.sent, result.outcomes)
    assert result.full_after_heal_s is not None, (
        f"{result.name}: the masters were not back at the exact split within the deadline after the heal"
    )


# A master cut from an agent while both reach etcd names the lost stream "released" in its key with the
# slots its requests there still run, and the agent frees the rest on that word (not on an engine sample).
RELEASES = {
    "master_some_agents_cut": ("m1", ["d1"]),
    "one_agent_one_master_cut": ("m2", ["d2"]),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_network_fault(logged_fleet: Fleet, name: str) -> None:
    what, apply = SCENARIOS[name]
    logs = {p.name: p.log_path for p in logged_fleet.c.group.processes}
    sizes = {n: path.stat().st_size if path.exists() else 0 for n, path in logs.items()}
    result = run_scenario(logged_fleet, name, what, apply, cut_s=10.0)
    check(result)
    if name in RELEASES:
        master, nodes = RELEASES[name]
        for node in nodes:
            with open(logs[f"agent-{node}"], "rb") as f:
                f.seek(sizes[f"agent-{node}"])
                new = f.read().decode(errors="replace")
            assert f"master {master} released its stream" in new, (
                f"{name}: {node}'s agent never freed {master}'s slots on its word in etcd"
            )
    if name == "slow_etcd":
        assert {"failover_s", "join_s"} <= result.notes.keys(), result.notes
    else:
        assert result.dropped_packets > 0, f"{name}: the fault's rules matched no packet"


async def test_fault_proxy_delays_each_direction_and_keeps_order() -> None:
    """The proxy alone, on loopback: an echo server behind it, 150 ± 100 ms each way."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
    proxy = FaultProxy(upstream.sockets[0].getsockname()[:2], seed=1)
    front = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
    async with upstream, front:
        reader, writer = await asyncio.open_connection(*front.sockets[0].getsockname()[:2])
        writer.write(b"a")
        await writer.drain()
        assert await reader.readexactly(1) == b"a"
        proxy.delay_s, proxy.jitter_s = 0.15, 0.1
        t0 = time.monotonic()
        expected = b""
        for i in range(30):  # chunks faster than the jitter: none may overtake another
            chunk = f"<{i}>".encode()
            expected += chunk
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0.005)
        got = b""
        while len(got) < len(expected):
            got += await asyncio.wait_for(reader.read(1 << 16), 5)
        slow = time.monotonic() - t0
        writer.close()
        await writer.wait_closed()
        # The EOF travels through the proxy too (delayed): let both handlers end before the servers close.
        for _ in range(100):
            if not proxy.active:
                break
            await asyncio.sleep(0.02)
    assert got == expected
    assert slow >= 0.1 + 0.15  # at least 50 ms each way, after the last chunk was sent
    assert proxy.connections == 1
