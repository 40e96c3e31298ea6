"""gRPC adapter for NodeCoordination.Connect: turns stream messages into NodeRegistry calls."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from pdcoord.load import EngineLoad
from pdcoord.v1 import coordination_pb2 as pb
from pdcoord.v1 import coordination_pb2_grpc as pb_grpc
from pdmaster.lifecycle import Lifecycle
from pdmaster.metrics import MasterMetrics
from pdmaster.ratelimit import TokenBucket
from pdmaster.registry import DECODE, PREFILL, NodeRegistry, ProtocolError

log = logging.getLogger(__name__)

_ROLES = {pb.PREFILL: PREFILL, pb.DECODE: DECODE}

# (active_slots, wanted_slots) this master holds/wants on a node, for the Ack.
SlotsProvider = Callable[[str], tuple[int, int]]
# (node_id, down): the agent's verdict on its engine flipped.
EngineListener = Callable[[str, bool], None]
# node_id: its stream ended (after a Leaving, the registry marks the node gone first).
ClosedListener = Callable[[str], None]
# For an Ack on a node: the slots of this master's leases the engine held at the stream's previous
# Ack (their decode request had gone out) and still holds, with their end in sight; and the mark for
# the next Ack (AdmissionCore.kept_since).
KeptProvider = Callable[[str, int | None], tuple[int, int]]


def _no_slots(_node_id: str) -> tuple[int, int]:
    return 0, 0


class CoordinationService(pb_grpc.NodeCoordinationServicer):
    def __init__(
        self,
        master_id: str,
        registry: NodeRegistry,
        metrics: MasterMetrics,
        lifecycle: Lifecycle | None = None,
        *,
        slots: SlotsProvider = _no_slots,
        max_reports_per_s: float = 50.0,
        on_engine: EngineListener | None = None,
        kept: KeptProvider | None = None,
        on_closed: ClosedListener | None = None,
    ) -> None:
        self.on_engine = on_engine
        self.on_closed = on_closed
        self.kept = kept  # None: Acks without kept_slots (as masters of earlier releases)
        self.master_id = master_id
        self.registry = registry
        self.metrics = metrics
        self.slots = slots
        self.max_reports_per_s = max_reports_per_s
        self.lifecycle = lifecycle if lifecycle is not None else Lifecycle()

    def _ack(
        self, node_id: str, epoch: int, seq: int, mark: int | None
    ) -> tuple[pb.MasterMessage, int | None]:
        """The Ack, and the stream's mark for the next one. ``mark``: what ``kept`` returned as the mark
        at this stream's previous Ack (None before the first)."""
        active, wanted = self.slots(node_id)
        ack = pb.Ack(
            master_id=self.master_id,
            applied_epoch=epoch,
            active_slots=active,
            wanted_slots=wanted,
            seq=seq,
            draining=self.lifecycle.draining,
        )
        if self.kept is not None:
            ack.kept_slots, mark = self.kept(node_id, mark)
        return pb.MasterMessage(ack=ack), mark

    async def _refuse(self, context: grpc.aio.ServicerContext, code: str, message: str) -> None:
        self.metrics.protocol_rejections.labels(reason=code.lower()).inc()
        log.warning("refusing node stream: %s", message)
        await context.abort(getattr(grpc.StatusCode, code), message)

    async def _decoded(
        self, messages: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AgentMessage]:
        """The stream's messages; bytes that are not an AgentMessage end it with INVALID_ARGUMENT."""
        try:
            async for msg in messages:
                yield msg
        except DecodeError as exc:
            await self._refuse(context, "INVALID_ARGUMENT", f"undecodable AgentMessage: {exc}")

    async def Connect(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.MasterMessage]:
        request_iterator = self._decoded(request_iterator, context)
        if self.lifecycle.draining:
            await self._refuse(context, "UNAVAILABLE", f"master {self.master_id} is draining")
        first = await anext(aiter(request_iterator), None)
        if first is None:
            return
        if first.WhichOneof("msg") != "register":
            await self._refuse(
                context,
                "INVALID_ARGUMENT",
                f"first message must be Register, got {first.WhichOneof('msg') or 'an empty message'}",
            )
        reg = first.register
        grant = (reg.grant.capacity_share, reg.grant.capacity_epoch) if reg.HasField("grant") else None
        try:
            node, stream = self.registry.register(
                node_id=reg.node_id,
                role=_ROLES.get(reg.role, "unspecified"),
                endpoint=reg.endpoint,
                running_max_req_size=reg.running_max_req_size,
                start_args=dict(reg.start_args),
                agent_version=reg.agent_version,
                incarnation=reg.incarnation,
                grant=grant,
                engine_down=reg.engine_down,
                engine_reason=reg.engine_reason,
            )
        except ProtocolError as exc:
            await self._refuse(context, exc.code, exc.message)
            return
        node_id = node.node_id
        log.info(
            "node %s (%s, %s) connected: share %d epoch %d%s",
            node_id,
            node.role,
            node.endpoint,
            node.share,
            node.epoch,
            " (legacy agent: full capacity)" if node.legacy else "",
        )
        if node.engine_down:
            log.warning("node %s registered with its engine down: %s", node_id, node.engine_reason or "?")
        self.metrics.observe_node(self.registry, node_id)
        received, acks_sent = self.metrics.received, self.metrics.acks_sent
        received["register"].inc()
        try:
            acks_sent.inc()
            self.registry.flush()
            ack, mark = self._ack(node_id, node.epoch, 0, None)
            yield ack
            bucket = TokenBucket(self.max_reports_per_s)
            async for msg in request_iterator:
                # every message counts, so a flood of empty or unknown ones is refused too
                if not bucket.take():
                    await self._refuse(
                        context,
                        "RESOURCE_EXHAUSTED",
                        f"node {node_id}: more than {self.max_reports_per_s:g} messages per second "
                        "(--max-reports-per-s); stream closed",
                    )
                    return
                kind = msg.WhichOneof("msg")
                received.get(kind or "other", received["other"]).inc()
                if kind == "leaving":
                    log.info("node %s leaving: %s", node_id, msg.leaving.reason or "no reason given")
                    # forgotten once its stream is closed and no lease of this master runs there
                    self.registry.mark_leaving(node_id, stream)
                    return
                if kind == "register":
                    await self._refuse(context, "INVALID_ARGUMENT", f"node {node_id}: Register sent twice")
                    return
                if kind != "report":
                    continue  # a message kind from a newer agent: ignore, stay compatible
                rep = msg.report
                try:
                    self.registry.report_load(
                        node_id,
                        stream,
                        EngineLoad.from_pb(rep.load),
                    )
                    if self.registry.report_engine(node_id, stream, rep.engine_down, rep.engine_reason):
                        if rep.engine_down:
                            log.warning(
                                "node %s: engine down (agent): %s; no new leases there",
                                node_id,
                                rep.engine_reason or "no reason given",
                            )
                        else:
                            log.info("node %s: engine up again (agent)", node_id)
                        if self.on_engine is not None:
                            self.on_engine(node_id, rep.engine_down)
                except ProtocolError as exc:
                    await self._refuse(context, exc.code, exc.message)
                    return
                if rep.HasField("grant"):
                    try:
                        self.registry.apply_grant(
                            node_id, stream, rep.grant.capacity_share, rep.grant.capacity_epoch
                        )
                    except ProtocolError as exc:
                        await self._refuse(context, exc.code, exc.message)
                        return
                self.metrics.observe_node(self.registry, node_id)
                acks_sent.inc()
                self.registry.flush()
                ack, mark = self._ack(node_id, self.registry.nodes[node_id].epoch, rep.seq, mark)
                yield ack
        finally:
            self.registry.disconnect(node_id, stream)
            self.metrics.observe_node(self.registry, node_id)
            log.info("node %s stream closed", node_id)
            if self.on_closed is not None:
                self.on_closed(node_id)
