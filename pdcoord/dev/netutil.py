"""Small socket helpers for launchers and tests."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

# Ports below the kernel's ephemeral range: the source port of an outgoing connection (made by any
# process) is never one of them, so a port picked here stays free until its server binds it. A port
# from bind(0) is an ephemeral one, and a test run opens thousands of connections: now and then one
# took a port between the pick and the bind, and the server exited "address already in use".
_LOWEST = 20_000
_handed_out: set[int] = set()
_rng = random.Random()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on *host* that is free now and that no outgoing connection will take: picked at
    random below the kernel's ephemeral range, never the same twice in one process. Falls back to
    bind(0) where that range leaves too little room below it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    top = _ephemeral_low() - 1
    if top - _LOWEST >= 1_000:
        for _ in range(100):
            port = _rng.randint(_LOWEST, top)
            if port not in _handed_out and _bindable(family, host, port):
                _handed_out.add(port)
                return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_port(host: str, port: int, timeout: float = 10.0) -> None:
    """Block until host:port accepts TCP connections; TimeoutError after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if port_open(host, port, timeout=min(0.5, max(0.05, deadline - time.monotonic()))):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"nothing is listening on {host}:{port} after {timeout:.1f} s")
        time.sleep(0.05)
