"""Telling a dead master from a cut-off one: only a refused connection counts (nodeagent.reachability)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from nodeagent.reachability import host_port, refuses_connections


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("10.0.0.7:50051", ("10.0.0.7", 50051)),
        ("master-0.pd.svc:7000", ("master-0.pd.svc", 7000)),
        ("[::1]:7000", ("::1", 7000)),
        ("dns:///master-0:7000", ("master-0", 7000)),
        ("ipv4:127.0.0.1:7000", ("127.0.0.1", 7000)),
        ("no-port", None),
        (":7000", None),
        ("host:http", None),
    ],
)
def test_host_port(address: str, expected: tuple[str, int] | None) -> None:
    assert host_port(address) == expected


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


async def test_a_port_nothing_listens_on_refuses() -> None:
    assert await refuses_connections("127.0.0.1", _closed_port())


async def test_a_listening_port_does_not_refuse_and_the_probe_leaves_no_connection() -> None:
    accepted: list[bool] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(await reader.read() == b"")  # the probe closes without sending anything
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        assert not await refuses_connections("127.0.0.1", port)
        for _ in range(100):
            if accepted:
                break
            await asyncio.sleep(0.05)
        assert accepted == [True]
    finally:
        server.close()
        await server.wait_closed()


async def test_a_listener_that_does_not_accept_in_time_is_not_taken_for_dead() -> None:
    """A stopped (SIGSTOP) or overloaded master: the handshake may not finish; that is no refusal."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        port = s.getsockname()[1]
        # Fill the backlog (never accepted) so that further connects hang rather than complete; the
        # fillers do not wait for their own handshakes, which may hang as well.
        fillers = []
        for _ in range(4):
            f = socket.socket()
            f.setblocking(False)
            f.connect_ex(("127.0.0.1", port))
            fillers.append(f)
        try:
            assert not await refuses_connections("127.0.0.1", port, timeout=0.2)
        finally:
            for f in fillers:
                f.close()
