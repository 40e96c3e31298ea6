"""A node agent built for unit tests: its etcd is never contacted and nothing is started."""

from __future__ import annotations

from typing import Any

from nodeagent.agent import AgentConfig, NodeAgent
from pdcoord.config import EtcdSettings


def offline_agent(capacity: int, **cfg: Any) -> NodeAgent:
    """Decode node ``d1`` with ``capacity`` slots; ``cfg``: further ``AgentConfig`` fields."""
    return NodeAgent(
        AgentConfig(
            etcd=EtcdSettings(["127.0.0.1:1"], "c", None, 5),  # never contacted
            node_id="d1",
            role="decode",
            endpoint="http://127.0.0.1:1",
            running_max_req_size=capacity,
            **cfg,
        )
    )
