"""gRPC adapter for NodeCoordination.Connect: turns stream messages into NodeRegistry calls.

While the master's etcd lease is lost (``lease_lost``: it admits nothing) its Ack on a decode node
says ``draining`` (with no queued demand) as soon as none of its leases runs there, and is sent at
once, without waiting for the agent's next Report: the agent then takes this master out of the split
with nothing of it reserved, and hands its share to the other masters before this master's key
expires (after which the agent would drop the stream and keep the share reserved until an engine
sample or its orphan timeout frees it). Not while its leases still run there: an agent takes a
draining master whose key then goes for one whose requests have ended (as after a graceful drain)
and would set what it still runs against the other masters' acked counts, which may be stale. So
where its leases run the Ack says nothing new, and the agent keeps that share for it, as for any
member, until they end there (then the Ack goes) or its key goes (then it is reserved as the orphan
of a master that may be alive, as before). A prefill share bounds no lease: nothing to hand on
there, and leaving the split would only cost the node's prefix-cache entries. When the lease is
held again (``lease_back``) every stream whose Ack said ``draining`` is closed, at once counting as
share 0: the grants of such a stream may be ones the agent gave before it took this master out, and
it has handed those slots on; the agent reconnects, and its Register carries what it grants now.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

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
# node_id: the floor this master asks the agent to keep for it there (Ack.floor_slots).
FloorProvider = Callable[[str], int]
# For an Ack on a node: the slots of this master's leases the engine held at the stream's previous
# Ack (their decode request had gone out) and still holds, with their end in sight; and the mark for
# the next Ack (AdmissionCore.kept_since).
KeptProvider = Callable[[str, int | None], tuple[int, int]]


# (active_tokens, wanted_tokens, kept_tokens) of this master on a node, for the Ack: the token
# counterparts of the slot counts (``kept_tokens`` matches the kept_slots of the same Ack).
TokensProvider = Callable[[str], tuple[int, int, int]]


def _no_slots(_node_id: str) -> tuple[int, int]:
    return 0, 0


# What a stream's handler waits for besides the agent's messages.
_PUSH = object()  # send an Ack now (lease lost: this master's last lease there ended)
_CLOSE = object()  # end the stream (lease held again after an Ack said draining)
_END = object()  # the agent closed its side


@dataclass(eq=False)
class _Stream:
    node_id: str
    token: int
    decode: bool  # a prefill share bounds no lease: such a stream never drains for a lost lease
    inbox: asyncio.Queue[object] = field(default_factory=asyncio.Queue)
    seq: int = 0  # the seq of the last Report read (echoed by a pushed Ack)
    said_draining: bool = False  # the last Ack said draining
    lost_draining: bool = False  # an Ack said draining while the lease was lost
    pushing: bool = False  # a pushed Ack is queued
    closed: bool = False  # closed by lease_back: the registry already counts it disconnected


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
        floor: FloorProvider | None = None,
        tokens: TokensProvider | None = None,
    ) -> None:
        self.tokens = tokens  # None: Acks without token counts (as masters of earlier releases)
        self.on_engine = on_engine
        self.floor = floor  # None: Acks without floor_slots (the agent's --share-floor applies)
        self.on_closed = on_closed
        self.kept = kept  # None: Acks without kept_slots (as masters of earlier releases)
        self.master_id = master_id
        self.registry = registry
        self.metrics = metrics
        self.slots = slots
        self.max_reports_per_s = max_reports_per_s
        self.lifecycle = lifecycle if lifecycle is not None else Lifecycle()
        # Set by the master while its etcd lease is lost and admission holds nothing (only then:
        # an Ack saying draining must never precede a lease granted after it).
        self.lease_lost = False
        self._streams: dict[int, _Stream] = {}  # by stream token

    def _ack(
        self, node_id: str, epoch: int, seq: int, mark: int | None, st: _Stream
    ) -> tuple[pb.MasterMessage, int | None]:
        """The Ack, and the stream's mark for the next one. ``mark``: what ``kept`` returned as the mark
        at this stream's previous Ack (None before the first)."""
        active, wanted = self.slots(node_id)
        lost = self.lease_lost
        if lost:
            wanted = 0  # nothing is queued: admission holds no capacity
        draining = self.lifecycle.draining or (lost and st.decode and active == 0)
        st.said_draining = draining
        st.lost_draining = st.lost_draining or (lost and draining)
        ack = pb.Ack(
            master_id=self.master_id,
            applied_epoch=epoch,
            active_slots=active,
            wanted_slots=wanted,
            seq=seq,
            draining=draining,
        )
        if self.kept is not None:
            ack.kept_slots, mark = self.kept(node_id, mark)
        if self.tokens is not None and st.decode:
            active_t, wanted_t, kept_t = self.tokens(node_id)
            ack.active_tokens, ack.wanted_tokens = active_t, 0 if lost else wanted_t
            if self.kept is not None:
                ack.kept_tokens = kept_t
        if self.floor is not None and st.decode:
            # nothing to keep while admission holds nothing (lease lost) or takes nothing (draining)
            ack.floor_slots = 0 if (lost or draining) else self.floor(node_id)
        return pb.MasterMessage(ack=ack), mark

    # -- etcd lease lost ------------------------------------------------------------------------
    def push_draining(self) -> int:
        """While the lease is lost: queue an Ack on every stream whose last Ack did not say draining
        and where no lease of this master runs any more. Returns how many were queued."""
        if not self.lease_lost:
            return 0
        n = 0
        for st in self._streams.values():
            if not st.decode or st.said_draining or st.pushing or st.closed or self.slots(st.node_id)[0]:
                continue
            st.pushing = True
            st.inbox.put_nowait(_PUSH)
            n += 1
        return n

    def lease_back(self) -> list[str]:
        """The lease is held again: Acks say draining no more, and every stream whose Ack said so
        while the lease was lost is closed, its share counting 0 at once. Returns their node ids."""
        self.lease_lost = False
        closed = []
        for st in self._streams.values():
            if st.lost_draining and not st.closed:
                st.closed = True
                self.registry.disconnect(st.node_id, st.token)
                st.inbox.put_nowait(_CLOSE)
                closed.append(st.node_id)
            st.lost_draining = False
        return closed

    async def _read(self, messages: AsyncIterator[pb.AgentMessage], inbox: asyncio.Queue[object]) -> None:
        """Forward the agent's messages to the stream's handler (which also hears of _PUSH, _CLOSE)."""
        try:
            async for msg in messages:
                inbox.put_nowait(msg)
        except asyncio.CancelledError:
            inbox.put_nowait(_END)  # whoever cancelled it: the handler must not wait on
            raise
        except BaseException as exc:  # an abort (undecodable message) or the call's end: the handler's
            inbox.put_nowait(exc)
        else:
            inbox.put_nowait(_END)

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
        has_tokens = reg.HasField("grant") and reg.grant.HasField("token_share")
        try:
            node, stream = self.registry.register(
                node_id=reg.node_id,
                role=_ROLES.get(reg.role, "unspecified"),
                endpoint=reg.endpoint,
                running_max_req_size=reg.running_max_req_size,
                start_args=dict(reg.start_args),
                agent_version=reg.agent_version,
                incarnation=reg.incarnation,
                stream_id=reg.stream_id,
                grant=grant,
                engine_down=reg.engine_down,
                engine_reason=reg.engine_reason,
                kv_tokens=reg.kv_tokens if reg.HasField("kv_tokens") else None,
                token_share=reg.grant.token_share if has_tokens else None,
            )
        except ProtocolError as exc:
            await self._refuse(context, exc.code, exc.message)
            return
        node_id = node.node_id
        node.heard_at = time.monotonic()
        log.info(
            "node %s (%s, %s) connected: share %d epoch %d%s%s",
            node_id,
            node.role,
            node.endpoint,
            node.share,
            node.epoch,
            " (legacy agent: full capacity)" if node.legacy else "",
            f", tokens {node.token_share} of {node.kv_tokens}"
            if node.kv_tokens is not None
            else (", no KV pool published: slots only" if node.role == DECODE else ""),
        )
        if node.engine_down:
            log.warning("node %s registered with its engine down: %s", node_id, node.engine_reason or "?")
        self.metrics.observe_node(self.registry, node_id)
        received, acks_sent = self.metrics.received, self.metrics.acks_sent
        received["register"].inc()
        st = _Stream(node_id, stream, node.role == DECODE)
        self._streams[stream] = st
        reader = asyncio.create_task(self._read(request_iterator, st.inbox), name=f"read-{node_id}")
        try:
            acks_sent.inc()
            self.registry.flush()
            ack, mark = self._ack(node_id, node.epoch, 0, None, st)
            yield ack
            bucket = TokenBucket(self.max_reports_per_s)
            while True:
                item = await st.inbox.get()
                if st.closed:  # whatever came before the _CLOSE: the registry counts it gone already
                    log.info(
                        "node %s: closing its stream (etcd lease held again after an Ack said draining); "
                        "it re-registers with the share it grants now",
                        node_id,
                    )
                    return
                if item is _END:
                    return
                if item is _PUSH:
                    st.pushing = False
                    if st.closed or st.said_draining:
                        continue
                    acks_sent.inc()
                    self.registry.flush()
                    # Echoes the last Report's seq: it is built after that Report was read, as its
                    # answer was (the agent's brackets need no more than that).
                    ack, mark = self._ack(node_id, self.registry.nodes[node_id].epoch, st.seq, mark, st)
                    yield ack
                    continue
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, pb.AgentMessage)
                msg = item
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
                heard = self.registry.nodes.get(node_id)
                if heard is not None and heard.stream == stream:
                    heard.heard_at = time.monotonic()
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
                st.seq = rep.seq
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
                            node_id,
                            stream,
                            rep.grant.capacity_share,
                            rep.grant.capacity_epoch,
                            rep.grant.token_share if rep.grant.HasField("token_share") else None,
                        )
                    except ProtocolError as exc:
                        await self._refuse(context, exc.code, exc.message)
                        return
                self.metrics.observe_node(self.registry, node_id)
                acks_sent.inc()
                self.registry.flush()
                ack, mark = self._ack(node_id, self.registry.nodes[node_id].epoch, rep.seq, mark, st)
                yield ack
        finally:
            reader.cancel()
            if self._streams.get(stream) is st:
                del self._streams[stream]
            if not st.closed:  # lease_back disconnected it already
                self.registry.disconnect(node_id, stream)
            self.metrics.observe_node(self.registry, node_id)
            log.info("node %s stream closed", node_id)
            if self.on_closed is not None:
                self.on_closed(node_id)
