"""Small socket helpers for launchers and tests."""

from __future__ import annotations

import socket
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on *host* that was free a moment ago (bind to port 0 and release it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
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
