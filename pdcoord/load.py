"""An engine's load as the agent samples it, reports it (``pb.Load``) and the master holds it: one record."""

from __future__ import annotations

from dataclasses import dataclass

from pdcoord.v1 import coordination_pb2 as pb

__all__ = ["EngineLoad"]


@dataclass(slots=True)
class EngineLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    probe_ok: bool = False  # False: no sample (the probe failed or is off); the counts mean nothing

    def to_pb(self) -> pb.Load:
        return pb.Load(
            running=self.running, waiting=self.waiting, kv_usage=self.kv_usage, probe_ok=self.probe_ok
        )

    @classmethod
    def from_pb(cls, msg: pb.Load) -> EngineLoad:
        return cls(msg.running, msg.waiting, msg.kv_usage, msg.probe_ok)

    def as_json(self) -> dict[str, object]:
        return {
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "probe_ok": self.probe_ok,
        }
