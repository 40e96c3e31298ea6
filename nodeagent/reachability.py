"""Whether a master's process is gone: its address refuses TCP connections.

When a master's stream breaks, the agent keeps the master's share for ``--grace`` because a master
that is alive but cut off may still place work on the node until its keep-alive notices. A process
that was killed places none, and its kernel closed its listening socket with it: a connection to its
address is refused (a TCP reset in answer to the SYN). That refusal is the evidence this module looks
for; anything else (a connection that opens, a timeout, an unreachable host) proves nothing and
leaves the grace to decide.
"""

from __future__ import annotations

import asyncio
import contextlib

# When, after a master's stream broke, its address is tried (seconds after the first try). A killed
# process's connections close before its listening socket: the first try usually still connects
# (or is reset), one 20 ms later is refused.
GONE_PROBES_S = (0.0, 0.05, 0.2, 0.5)
GONE_PROBE_TIMEOUT_S = 0.25


def host_port(address: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port``, an optional ``dns:///`` or ``ipv4:`` scheme) of a gRPC target."""
    for scheme in ("dns:///", "ipv4:", "ipv6:"):
        if address.startswith(scheme):
            address = address[len(scheme) :]
            break
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


async def refuses_connections(host: str, port: int, timeout: float = GONE_PROBE_TIMEOUT_S) -> bool:
    """True only when a TCP connection to ``host:port`` is actively refused."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False
