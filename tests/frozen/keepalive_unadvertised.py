"""Frozen copy of the keep-alive behaviour of the release before masters advertised their keep-alive
times in etcd (commit 52cbce5): what such a master writes and does, and what such an agent reads and
assumes. The tests check today's masters and agents against it in both directions. Never edit.
"""

from __future__ import annotations

import json

# A master's etcd key: its addresses, nothing about its keep-alive.
MASTER_KEY = {
    "master_id": "m1",
    "grpc": "10.0.0.1:50051",
    "http": "http://10.0.0.1:8000",
    "version": "0.1.0",
    "started_at": 1764921369.0,
}

# Its gRPC server: a ping after 0.65 s without reads, 1 s for the answer (pdmaster.server).
MASTER_GRPC_OPTIONS = {
    "grpc.keepalive_time_ms": 650,
    "grpc.keepalive_timeout_ms": 1000,
    "grpc.http2.ping_timeout_ms": 1000,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.http2.min_ping_interval_without_data_ms": 500,
    "grpc.http2.max_pings_without_data": 0,
}
MASTER_DETECT_S = 1.65  # a silently cut agent stream is noticed within 0.65 + 1 s

# Its agents: the same channel options for every master (a ping after 1 s without reads, 1 s for the
# answer; nodeagent.agent.GRPC_CLIENT_OPTIONS) ...
AGENT_GRPC_OPTIONS = {
    "grpc.keepalive_time_ms": 1000,
    "grpc.keepalive_timeout_ms": 1000,
    "grpc.http2.ping_timeout_ms": 1000,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.http2.max_pings_without_data": 0,
}
# ... and for every master the same wait before engine samples may free a departed master's slots
# (strict handover; nodeagent.slicing.PEER_DETECT_S): what such an agent allows a master to notice
# that its stream is gone.
AGENT_PEER_DETECT_S = 1.75


def agent_parse_master(value: bytes) -> str | None:
    """Such an agent's reading of a master's key: the gRPC address, or None for an unusable value."""
    try:
        addr = json.loads(value)["grpc"]
        if not isinstance(addr, str) or ":" not in addr:
            raise ValueError(addr)
    except (ValueError, KeyError, TypeError):
        return None
    return addr
