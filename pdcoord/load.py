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
    # Requests the engine retracted (SGLang) or preempted (vLLM) since it started; None: not published.
    retractions: int | None = None
    # Prompt tokens queued or in progress at a prefill engine, every master's together; None: unknown.
    prefill_backlog_tokens: int | None = None

    def to_pb(self) -> pb.Load:
        msg = pb.Load(
            running=self.running, waiting=self.waiting, kv_usage=self.kv_usage, probe_ok=self.probe_ok
        )
        if self.retractions is not None:
            msg.retractions = self.retractions
        if self.prefill_backlog_tokens is not None:
            msg.prefill_backlog_tokens = self.prefill_backlog_tokens
        return msg

    @classmethod
    def from_pb(cls, msg: pb.Load) -> EngineLoad:
        return cls(
            msg.running,
            msg.waiting,
            msg.kv_usage,
            msg.probe_ok,
            msg.retractions if msg.HasField("retractions") else None,
            msg.prefill_backlog_tokens if msg.HasField("prefill_backlog_tokens") else None,
        )

    def as_json(self) -> dict[str, object]:
        return {
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": self.kv_usage,
            "probe_ok": self.probe_ok,
            "retractions": self.retractions,
            "prefill_backlog_tokens": self.prefill_backlog_tokens,
        }
