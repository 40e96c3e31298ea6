"""The node agent: etcd membership watch, share slicing, one gRPC stream per master.

All decisions about shares live in ``nodeagent.slicing.Slicer``; this module only moves events
between etcd, the gRPC streams and that core.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import grpc.aio
from aiohttp import web

from nodeagent.handover import END_SEEN_S, START_SEEN_S
from nodeagent.probe import (
    EngineHealth,
    EngineSample,
    EngineUnreachable,
    LoadProbe,
    check_health,
    discover_engine,
)
from nodeagent.reachability import GONE_PROBES_S, host_port, refuses_connections
from nodeagent.slicing import BRACKET_ACK_WAIT_S, SharePolicy, Slicer
from pdcoord import __version__
from pdcoord.config import EtcdSettings
from pdcoord.etcd import EtcdClient, EtcdError, WatchCompacted
from pdcoord.gctuning import collect_soon
from pdcoord.keepalive import UNADVERTISED_KEEPALIVE_S
from pdcoord.keys import Keys
from pdcoord.load import EngineLoad
from pdcoord.registration import Registration
from pdcoord.retry import Backoff, Outage, register_with_retry
from pdcoord.tls import ClientTLS, grpc_channel, looks_like_tls_failure
from pdcoord.v1 import coordination_pb2 as pb
from pdcoord.v1 import coordination_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

# The agent pings a master after a silence a little longer than the master's own ping period (its
# ``keepalive_s``, see master_channel_options), 1 s at least, and allows 1 s for the answer: a hung or
# cut-off master at the default --keepalive 2 is noticed within 3.35 s, one of an earlier release
# (0.65 s) within 2 s. ``grpc.http2.ping_timeout_ms`` is what enforces the answer time in gRPC 1.85
# (see the master's grpc_server_options).
GRPC_CLIENT_OPTIONS = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.http2.ping_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 1 << 20),
    # Small control messages only: no BDP pings (each is one more ping the master answers).
    ("grpc.http2.bdp_probe", 0),
]

# A master's advertised times above this are a broken key, not a configuration (an hour).
MAX_ADVERTISED_S = 3600.0
# The agent pings a master only after this much longer a silence than the master's own ping period,
# so that while the master is alive its pings (which reset the agent's timer) are the only ones.
AGENT_PING_AFTER_MASTER_S = 0.35


def master_channel_options(master_keepalive_s: float) -> list[tuple[str, int]]:
    """The channel options for a master that pings every ``master_keepalive_s``: every ping costs
    the master about as much whoever sends it, so the agent stays quiet while the master's come."""
    ping_ms = max(1000, round((master_keepalive_s + AGENT_PING_AFTER_MASTER_S) * 1000))
    return [(k, ping_ms if k == "grpc.keepalive_time_ms" else v) for k, v in GRPC_CLIENT_OPTIONS]


@dataclass(frozen=True)
class MasterEntry:
    """What a master's key in etcd tells its agents."""

    address: str  # host:port of its gRPC service
    # An older master's key says neither: it pings after 0.65 s (UNADVERTISED_KEEPALIVE_S), whatever
    # today's default is, and notices a cut stream within 1.65 s, which PEER_DETECT_S covers.
    keepalive_s: float = UNADVERTISED_KEEPALIVE_S
    detect_s: float = 0.0  # how soon it notices a cut stream; 0: not said (PEER_DETECT_S covers it)
    drained: bool = False  # it drained: nothing of it runs any more (written just before it goes)
    # The stream of ours that it names as released (gone; it places nothing more on this node) and
    # the slots its leases here still run.
    released_stream: int | None = None
    released_running: int = 0


_ROLE = {"prefill": pb.PREFILL, "decode": pb.DECODE}
# At most 20 reports per second per master (the master refuses more than --max-reports-per-s, 50).
MIN_REPORT_GAP_S = 0.05
PERSIST_MIN_GAP_S = 1.0
NODE_VALUE_MIN_GAP_S = 10.0
CHANNEL_READY_WAIT_S = 5.0
# Ask a master for an Ack again when its answer to the last report has not come for this long.
UNANSWERED_REPOLL_S = 5.0
# After a link to a master that left is dropped, collect garbage this much later (see _drop_link).
DROPPED_LINK_GC_S = 1.0


class StartupError(Exception):
    """A reason the agent cannot start, phrased for the operator (names the flag)."""


@dataclass
class AgentConfig:
    etcd: EtcdSettings
    node_id: str
    role: str
    endpoint: str
    running_max_req_size: int
    # The engine's KV pool in tokens (--kv-tokens, or what the engine said at start); None: not known.
    kv_tokens: int | None = None
    # Ask the engine for its pool while it is not known, and follow it when the engine's metrics show
    # another one (a restart with other settings). False: --kv-tokens was given and wins.
    discover_kv_tokens: bool = True
    start_args: dict[str, str] = field(default_factory=dict)
    # Heartbeat: a report when nothing changed. A grant change is reported at once, a load change
    # within load_report_interval, the engine's liveness verdict at once when it flips (an engine
    # that stays down sends nothing more), and the streams' liveness is gRPC keep-alive's job (the
    # master has no timeout on a silent stream), so a heartbeat carries nothing new; at 10 s the
    # heartbeats cost a master 0.3 % of a core per 100 idle agents.
    report_interval: float = 30.0
    # A load change (display only on the master) is reported at most this often.
    load_report_interval: float = 2.0
    # Engine probe period while no handover waits for the engine's count (then 0.25 s).
    probe_interval: float = 2.0
    shares: SharePolicy = field(default_factory=SharePolicy)
    register_wait: float = 15.0
    load_urls: tuple[str, ...] = ()  # where the engine's load is read, best first; () = no probe
    health_host: str = "127.0.0.1"
    health_port: int | None = None
    reconnect_max_backoff: float = 2.0
    send_grant: bool = True  # False emulates an older agent (tests of compatibility)
    # Report (and so collect Acks) this often while a master waits for slots others still hold.
    handover_poll: float = 0.1
    grpc_tls: ClientTLS | None = None  # None: plaintext gRPC to the masters
    # Engine liveness check (GET <endpoint>/health): off with health_check=False.
    health_check: bool = True
    health_interval: float = 0.5
    health_timeout: float = 3.0  # SGLang's /health takes at least 1 s
    health_failures: int = 3
    health_successes: int = 2
    # A master whose address refuses connections after its stream broke is taken for a dead process
    # (it leaves the split at once; its slots are set against the acked counts): SIGKILL failover in
    # a fraction of a second. False (--no-gone-on-refusal): a refusal proves nothing, as behind a
    # firewall that rejects (not drops) traffic between agents and live masters.
    gone_on_refusal: bool = True


def released_word(doc: Any, node_id: str) -> tuple[int | None, int]:
    """The stream a master's key names released on ``node_id``, and the slots its requests there
    still run: ``(stream id, running)``, or ``(None, 0)`` when the key names none for this node.

    An optional hint: anything but ``{"released": {node_id: {"stream": id > 0, "running": n >= 0}}}``
    (bools, floats and strings included) is ignored, and the slots then wait for engine samples.
    """
    released = doc.get("released") if isinstance(doc, dict) else None
    word = released.get(node_id) if isinstance(released, dict) else None
    if isinstance(word, dict):
        sid, n = word.get("stream"), word.get("running")
        if type(sid) is int and type(n) is int and sid > 0 and n >= 0:
            return sid, n
    return None, 0


@dataclass
class MasterLink:
    master_id: str
    address: str
    keepalive_s: float = UNADVERTISED_KEEPALIVE_S  # the master's ping period (its etcd key)
    task: asyncio.Task[None] | None = None
    call: Any = None
    connected: bool = False
    send_now: asyncio.Event = field(default_factory=asyncio.Event)
    last_ack: pb.Ack | None = None
    sent_epoch: int = -1
    sent_share: int = -1  # the share in the last Register/Report sent on this stream
    sent_tokens: int | None = None  # and its token share
    # When the last Report's writing began, and its seq: an Ack that echoes that seq answers a
    # Report sent no earlier (strict handover brackets engine samples with such Acks).
    reported_at: float = 0.0
    report_seq: int = -1
    answered_seq: int = -1  # the seq the last Ack echoed
    stream_id: int = 0  # Register.stream_id of the current (or last) stream
    registered_kv: int | None = None  # Register.kv_tokens of the current stream (None: absent)
    acked_at: float = 0.0  # when the last Ack came in
    gone_check: asyncio.Task[None] | None = None  # tries the address after the stream broke


def _opt(ack: pb.Ack | None, name: str) -> int | None:
    """An optional Ack field, None when absent."""
    return getattr(ack, name) if ack is not None and ack.HasField(name) else None


def _retrieved(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


class NodeAgent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.keys = Keys.for_cluster(cfg.etcd.cluster, cfg.etcd.prefix)
        self.etcd = EtcdClient(cfg.etcd.endpoints, **cfg.etcd.options)
        self.slicer = Slicer(
            node_id=cfg.node_id,
            capacity=cfg.running_max_req_size,
            # Prefill shares bound no lease (admission is on decode slots): nothing to hand over.
            policy=cfg.shares if cfg.role == "decode" else dataclasses.replace(cfg.shares, handover="fast"),
            probe=bool(cfg.load_urls),
            now=time.monotonic(),
            kv_tokens=cfg.kv_tokens if cfg.role == "decode" else None,
        )
        self.links: dict[str, MasterLink] = {}
        self.registration: Registration | None = None
        self.incarnation = time.time_ns()
        self._last_stream_id = 0
        self._entries: dict[str, MasterEntry] = {}  # what the masters' keys say, as last read
        self.load: EngineLoad = EngineLoad()
        # The KV pool in tokens, where it came from ("flag", "engine"; "" while not known), and
        # whether the engine answered that it publishes none (then capacity is slots only).
        # Decode nodes only: a prefill share bounds no lease, and masters place on decode tokens.
        decode = cfg.role == "decode"
        self.kv_tokens = cfg.kv_tokens if cfg.kv_tokens and decode else None
        self.kv_source = ("engine" if cfg.discover_kv_tokens else "flag") if self.kv_tokens else ""
        self._pool_absent = False
        self._value_stale = False  # the node's key says something outdated (its pool)
        self.engine = EngineHealth(cfg.health_failures, cfg.health_successes)
        self.seq = 0
        self._kick = asyncio.Event()
        self._probe_wake = asyncio.Event()
        self._acked = asyncio.Event()  # an Ack came in (for _answers)
        self._load_dirty = False
        self._members: frozenset[str] = frozenset()
        self._last_report = 0.0
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._persisted_epoch = 0
        self._persist_wake = asyncio.Event()
        self._http: aiohttp.ClientSession | None = None
        self._health: web.AppRunner | None = None
        self.ready = asyncio.Event()
        self.probe: LoadProbe | None = None

    # -- etcd ---------------------------------------------------------------------------------
    def _node_value(self) -> bytes:
        return json.dumps(
            {
                "node_id": self.cfg.node_id,
                "role": self.cfg.role,
                "endpoint": self.cfg.endpoint,
                "running_max_req_size": self.slicer.capacity,
                "kv_tokens": self.kv_tokens,  # null: the engine publishes no pool, capacity is slots only
                "agent_version": __version__,
                "last_epoch": self.slicer.epoch,
            }
        ).encode()

    async def _stored_epoch(self) -> int:
        kv = await self.etcd.get(self.keys.epoch(self.cfg.node_id))
        try:
            return int(kv.value) if kv is not None else 0
        except ValueError:
            return 0

    async def _persist_loop(self) -> None:
        """Write the newest epoch to etcd, coalesced; a restarted agent starts above it.

        Two keys: the epoch key (no lease: it outlives the agent) guards a clock that steps back
        across a restart, written a second after a change (coalescing a transition's steps);
        ``last_epoch`` in the node's registration is for operators reading etcd and lags by up to
        ``NODE_VALUE_MIN_GAP_S``. Writing both on every change put two writes a second per node on
        etcd during a thousand-node join.
        """
        backoff, outage = Backoff(), Outage(log, "persisting the epoch")
        value_epoch, value_at = 0, -NODE_VALUE_MIN_GAP_S
        while True:
            epoch, now = self.slicer.epoch, time.monotonic()
            key_due = epoch > self._persisted_epoch
            value_due = self.registration is not None and (epoch > value_epoch or self._value_stale)
            if not key_due and not value_due:
                await self._persist_wake.wait()
                self._persist_wake.clear()
                continue
            if not key_due and now < value_at + NODE_VALUE_MIN_GAP_S:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(value_at + NODE_VALUE_MIN_GAP_S - now):
                        await self._persist_wake.wait()
                self._persist_wake.clear()
                continue
            try:
                if key_due:
                    # One write per transition, a second after its first step: a join or failover
                    # moves every node's epoch two or three times within a second, and a thousand
                    # nodes writing each step is etcd's busiest moment. Epochs follow time_ns, so a
                    # restart starts above an epoch not yet written anyway; the key guards a clock
                    # that steps back.
                    await asyncio.sleep(PERSIST_MIN_GAP_S)
                    epoch, now = self.slicer.epoch, time.monotonic()
                    await self.etcd.put(self.keys.epoch(self.cfg.node_id), str(epoch))
                    self._persisted_epoch = epoch
                if self.registration is not None and value_due and now >= value_at + NODE_VALUE_MIN_GAP_S:
                    self._value_stale = False
                    await self.registration.update(self._node_value())
                    value_epoch, value_at = epoch, now
                outage.recovered()
                backoff.reset()
            except EtcdError as exc:
                outage.failed(exc)
                await asyncio.sleep(backoff.next())

    async def _watch_masters(self) -> None:
        prefix = self.keys.masters_prefix
        backoff, outage = Backoff(), Outage(log, "masters watch")
        while True:
            try:
                kvs, revision = await self.etcd.get_prefix(prefix)
                outage.recovered()
                backoff.reset()
                current: dict[str, MasterEntry] = {}
                for kv in kvs:
                    mid, entry = self._parse_master(kv.key, kv.value)
                    if entry is not None:
                        current[mid] = entry
                self._set_masters(current)
                async for ev in self.etcd.watch_prefix(prefix, start_revision=revision + 1):
                    if ev.kind == "put":
                        mid, entry = self._parse_master(ev.key, ev.value)
                        if entry is not None:
                            current[mid] = entry
                    else:
                        try:
                            current.pop(self.keys.id_from_key(ev.key, prefix), None)
                        except ValueError:
                            continue
                    self._set_masters(current)
            except WatchCompacted:
                log.info("masters watch compacted; re-listing")
            except EtcdError as exc:
                outage.failed(exc)
                await asyncio.sleep(backoff.next())

    def _parse_master(self, key: str, value: bytes) -> tuple[str, MasterEntry | None]:
        try:
            mid = self.keys.id_from_key(key, self.keys.masters_prefix)
        except ValueError:
            log.warning("ignoring stray key %s under masters/", key)
            return "", None
        try:
            doc = json.loads(value)
            addr = doc["grpc"]
            if not isinstance(addr, str) or ":" not in addr:
                raise ValueError(addr)
            timing = {k: doc[k] for k in ("keepalive_s", "detect_s") if k in doc}
            for k, v in timing.items():
                # bool is an int: refuse it too; a negative or absurd time is a broken key
                if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= MAX_ADVERTISED_S:
                    raise ValueError(f"{k} {v!r}")
            ours, running = released_word(doc, self.cfg.node_id)
            entry = MasterEntry(
                addr,
                **{k: float(v) for k, v in timing.items()},
                drained=doc.get("drained") is True,
                released_stream=ours,
                released_running=running,
            )
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring master %s with unusable value %r (%s)", mid, value[:200], exc)
            return "", None
        return mid, entry

    def _set_masters(self, current: dict[str, MasterEntry]) -> None:
        now, tns = time.monotonic(), time.time_ns()
        self._entries = dict(current)
        released = False
        for mid in list(self.links):
            link = self.links[mid]
            entry = current.get(mid)
            if entry is None or (entry.address, entry.keepalive_s) != (link.address, link.keepalive_s):
                self._drop_link(mid)
        for mid, entry in current.items():
            if entry.drained:
                self.slicer.master_drained(mid)
            if entry.released_stream is not None:
                released |= self._released(mid, entry, now, tns)
            # Before the master joins the split: its slots may have to wait for it once it leaves.
            if self.slicer.allow_peer_detect(entry.detect_s):
                log.info(
                    "master %s notices a cut stream within %.2f s: slots of departed masters now wait "
                    "%.2f s for engine samples",
                    mid,
                    entry.detect_s,
                    self.slicer.peer_detect_s,
                )
            if mid not in self.links:
                link = MasterLink(mid, entry.address, entry.keepalive_s)
                self.links[mid] = link
                link.task = asyncio.create_task(self._stream(link), name=f"stream-{mid}")
        if self.slicer.set_masters(current.keys(), now, tns) or released:
            self._changed()

    def _released(self, mid: str, entry: MasterEntry, now: float, tns: int) -> bool:
        """The master's key names a stream of ours as released: if that is our last stream to it
        and it is down on our side too, what it held here beyond what it still runs is free
        (Slicer.master_released). True when the word was taken: the masters hear of the grants."""
        assert entry.released_stream is not None
        running = entry.released_running
        if not self.slicer.master_released(mid, entry.released_stream, now, tns, running):
            return False
        log.info(
            "master %s released its stream to this node: its slots here are free%s",
            mid,
            f" but the {running} its requests still run" if running else "",
        )
        return True

    def _next_stream_id(self) -> int:
        # Unique across this agent's streams and its restarts (time moves on in between).
        self._last_stream_id = max(self._last_stream_id + 1, time.time_ns())
        return self._last_stream_id

    def _drop_link(self, mid: str) -> None:
        link = self.links.pop(mid)
        if link.task is not None:
            link.task.cancel()
            # The link's gRPC calls are garbage in reference cycles of their own, and until they are
            # collected the closed channel redials the dead master once a second: in an idle agent
            # for hours, as a full collection can take that long to come by itself.
            collect_soon(DROPPED_LINK_GC_S)

    # -- streams ------------------------------------------------------------------------------
    def _grant(self, mid: str) -> pb.Grant | None:
        if not self.cfg.send_grant:
            return None
        grant = pb.Grant(capacity_share=self.slicer.share_for(mid), capacity_epoch=self.slicer.epoch)
        tokens = self.slicer.token_share_for(mid)
        if tokens is not None:
            grant.token_share = tokens
        return grant

    def _register_msg(self, mid: str, stream_id: int = 0) -> pb.AgentMessage:
        reg = pb.Register(
            node_id=self.cfg.node_id,
            role=_ROLE[self.cfg.role],
            endpoint=self.cfg.endpoint,
            running_max_req_size=self.slicer.capacity,
            start_args=self.cfg.start_args,
            agent_version=__version__,
            incarnation=self.incarnation,
            engine_down=not self.engine.up,
            engine_reason=self.engine.reason,
            stream_id=stream_id,
        )
        if self.kv_tokens:
            reg.kv_tokens = self.kv_tokens
        grant = self._grant(mid)
        if grant is not None:
            reg.grant.CopyFrom(grant)
        return pb.AgentMessage(register=reg)

    def _report_msg(self, mid: str) -> pb.AgentMessage:
        self.seq += 1
        rep = pb.Report(
            load=self.load.to_pb(),
            seq=self.seq,
            engine_down=not self.engine.up,
            engine_reason=self.engine.reason,
        )
        grant = self._grant(mid)
        if grant is not None:
            rep.grant.CopyFrom(grant)
        return pb.AgentMessage(report=rep)

    async def _stream(self, link: MasterLink) -> None:
        # Jittered: after a master restarts, a thousand agents must not reconnect in lock-step.
        backoff = Backoff(0.1, max(0.1, self.cfg.reconnect_max_backoff))
        outage = Outage(log, f"stream to master {link.master_id} ({link.address})", logging.INFO)
        # One channel for the link's life: gRPC reconnects it by itself (with its own backoff), so a
        # master that is down costs no Python work per attempt. Creating a channel and a call per
        # attempt was the agents' main cost while a killed master's key was still in etcd.
        channel = grpc_channel(link.address, self.cfg.grpc_tls, master_channel_options(link.keepalive_s))
        try:
            await self._stream_on(link, channel, backoff, outage)
        finally:
            if link.gone_check is not None:
                link.gone_check.cancel()
            await channel.close(grace=None)

    async def _stream_on(self, link: MasterLink, channel: Any, backoff: Backoff, outage: Outage) -> None:
        while not self._stopping:
            reader: asyncio.Task[None] | None = None
            try:
                if outage.ongoing:
                    # Wait until the channel connects; after a while try anyway, so that a refusal
                    # that never heals (a TLS mismatch) is still logged with its reason.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(CHANNEL_READY_WAIT_S):
                            await channel.channel_ready()
                call = pb_grpc.NodeCoordinationStub(channel).Connect()
                link.sent_epoch = self.slicer.epoch
                link.sent_share = self.slicer.share_for(link.master_id)
                link.sent_tokens = self.slicer.token_share_for(link.master_id)
                link.stream_id = self._next_stream_id()
                link.registered_kv = self.kv_tokens
                self.slicer.stream_opening(link.master_id, link.stream_id)
                await call.write(self._register_msg(link.master_id, link.stream_id))
                first = await call.read()
                if first is grpc.aio.EOF:
                    raise ConnectionError("master closed the stream before acknowledging Register")
                link.last_ack, link.acked_at = first.ack, time.monotonic()
                link.call, link.connected = call, True
                backoff.reset()
                outage.recovered()
                log.info("stream to master %s (%s) up", link.master_id, link.address)
                changed = self.slicer.stream_up(
                    link.master_id, time.monotonic(), time.time_ns(), stream_id=link.stream_id
                )
                if self._on_ack(link, first.ack) or changed:
                    self._changed()
                reader = asyncio.create_task(self._read_acks(link, call))
                last_sent = 0.0
                while True:
                    waiter = asyncio.ensure_future(link.send_now.wait())
                    try:
                        done, _ = await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()  # also when this link is cancelled: no pending task is left behind
                    if reader in done:
                        reader.result()
                        raise ConnectionError("master closed the stream")
                    if link.registered_kv != self.kv_tokens:
                        # Only a Register says the pool: a new stream tells the master the new one.
                        raise ConnectionError("the engine's KV pool changed: registering again")
                    # Coalesce: during a handover every Ack may move a grant and ask for another
                    # report; stay well below the master's per-stream report limit.
                    gap = last_sent + MIN_REPORT_GAP_S - time.monotonic()
                    if gap > 0:
                        await asyncio.sleep(gap)
                    link.send_now.clear()
                    link.sent_epoch = self.slicer.epoch
                    link.sent_share = self.slicer.share_for(link.master_id)
                    link.sent_tokens = self.slicer.token_share_for(link.master_id)
                    link.reported_at = time.monotonic()
                    msg = self._report_msg(link.master_id)
                    link.report_seq = msg.report.seq
                    await call.write(msg)
                    last_sent = self._last_report = time.monotonic()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                level = logging.WARNING if exc.code() != grpc.StatusCode.UNAVAILABLE else logging.INFO
                hint = ""
                if looks_like_tls_failure(exc.details()):
                    # a certificate problem does not heal by retrying: say so loudly
                    level, hint = (
                        logging.ERROR,
                        " (TLS: check --grpc-tls-ca/--grpc-tls-cert/--grpc-tls-server-name)",
                    )
                outage.failed(f"{exc.code().name} {exc.details()}{hint}", level)
            except (ConnectionError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                # InvalidStateError: a Report written just as the call ended (the master dropped it,
                # its reader had not seen that yet). It ended the link's task, and so its reconnects.
                outage.failed(f"ended: {exc}")
            except Exception:
                # Anything else must not end the link either: a link whose task is gone never
                # reconnects, and its master loses this node for good.
                log.exception("stream to master %s (%s) failed; retrying", link.master_id, link.address)
            finally:
                if reader is not None:
                    reader.cancel()
                    # its end (a cancel, or the call's error that this link's loop already reported)
                    # is retrieved, so that no "exception was never retrieved" follows every broken stream
                    reader.add_done_callback(_retrieved)
                was_up = link.connected
                link.call, link.connected = None, False
                if was_up:
                    now, tns = time.monotonic(), time.time_ns()
                    changed = self.slicer.stream_down(link.master_id, now, tns)
                    entry = self._entries.get(link.master_id)
                    if entry is not None and entry.released_stream == link.stream_id:
                        # the master noticed first
                        changed |= self._released(link.master_id, entry, now, tns)
                    if changed:
                        self._changed()
                self._kick.set()  # the grace deadline may have moved
            if was_up and (link.gone_check is None or link.gone_check.done()):
                # Beside the reconnects, not before them: a live master's stream comes back as
                # soon as it can, while the tries (half a second in all) find a dead one.
                link.gone_check = asyncio.create_task(self._check_gone(link), name=f"gone-{link.master_id}")
            await asyncio.sleep(backoff.next())

    async def _check_gone(self, link: MasterLink) -> None:
        """After a master's stream broke: if its address refuses connections, its process is gone
        (killed, crashed) and it leaves the split now instead of after ``--grace``. That grace is
        for a master that is alive but cut off; waiting it out for a dead one was a second of
        every SIGKILL failover."""
        target = host_port(link.address)
        if target is None:
            return
        start = time.monotonic()
        for at in GONE_PROBES_S:
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if self._stopping or link.connected or link.master_id not in self.slicer.views:
                return
            if await refuses_connections(*target):
                if not self.cfg.gone_on_refusal:
                    if self.slicer.master_refused(link.master_id):
                        log.info(
                            "master %s (%s) refuses connections: it leaves the split after the grace, "
                            "and counts as gone once its etcd key is gone too (--no-gone-on-refusal)",
                            link.master_id,
                            link.address,
                        )
                    return
                log.info(
                    "master %s (%s) refuses connections: its process is gone, it leaves the split now",
                    link.master_id,
                    link.address,
                )
                if self.slicer.master_gone(link.master_id, time.monotonic(), time.time_ns()):
                    self._changed()
                return

    async def _read_acks(self, link: MasterLink, call: Any) -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return
            if msg.WhichOneof("msg") == "ack":
                link.last_ack = msg.ack
                link.acked_at = time.monotonic()
                if self._on_ack(link, msg.ack):
                    self._changed()

    def _on_ack(self, link: MasterLink, ack: pb.Ack) -> bool:
        answers = link.reported_at if ack.seq and ack.seq == link.report_seq else -math.inf
        link.answered_seq = ack.seq
        self._acked.set()
        return self.slicer.on_ack(
            link.master_id,
            ack.applied_epoch,
            ack.active_slots,
            ack.wanted_slots,
            time.monotonic(),
            time.time_ns(),
            ack.draining,
            kept=ack.kept_slots if ack.HasField("kept_slots") else None,
            answers_sent_at=answers,
            floor=ack.floor_slots if ack.HasField("floor_slots") else None,
            active_tokens=ack.active_tokens if ack.HasField("active_tokens") else None,
            wanted_tokens=ack.wanted_tokens if ack.HasField("wanted_tokens") else None,
            kept_tokens=ack.kept_tokens if ack.HasField("kept_tokens") else None,
        )

    def _poll_connected(self) -> list[MasterLink]:
        """Ask every connected master for an Ack now; the links asked."""
        links = [link for link in self.links.values() if link.connected]
        for link in links:
            link.send_now.set()
        return links

    async def _answers(self, links: list[MasterLink], since: float, timeout: float) -> None:
        """Until each of ``links`` answered a Report begun after ``since`` (or left, or timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            self._acked.clear()
            waiting = [
                link
                for link in links
                if link.connected and not (link.reported_at >= since and link.answered_seq == link.report_seq)
            ]
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._acked.wait()

    # -- control loop -------------------------------------------------------------------------
    @property
    def _follows_pool(self) -> bool:
        """The engine's word on its pool counts: a decode node without --kv-tokens."""
        return self.cfg.role == "decode" and self.cfg.discover_kv_tokens

    @property
    def _pool_wanted(self) -> bool:
        return self.kv_tokens is None and self._follows_pool

    def _changed(self) -> None:
        """The shares changed: report at once and persist the epoch.

        A change of the split's members goes to every master (each sees the new epoch); a step of
        a handover only to the masters whose grant moved: the others need nothing new and get the
        epoch with the next heartbeat. Telling all M masters of every step made a join cost O(M²)
        messages per node (each Ack of a shrinking master is a step of the newcomer's grant).
        """
        members = frozenset(self.slicer.shares)
        everyone = members != self._members or not self.cfg.send_grant
        self._members = members
        for link in self.links.values():
            mid = link.master_id
            if (
                everyone
                or link.sent_share != self.slicer.share_for(mid)
                or link.sent_tokens != self.slicer.token_share_for(mid)
            ):
                link.send_now.set()
        self._persist_wake.set()
        if self.slicer.waits_for_engine:
            self._probe_wake.set()  # a departed master's slots wait for a fresh engine sample
        self._kick.set()

    def _report_period(self, now: float) -> float:
        if self.slicer.handover_pending and self._acks_can_help(now):
            return self.cfg.handover_poll  # Acks move the handover on: ask for them often
        if self.cfg.shares.policy == "demand" and self._demand_moving():
            # the split follows the masters' demand, which arrives in Acks: ask for it while it moves
            return min(self.cfg.report_interval, self.cfg.shares.rebalance_interval)
        return self.cfg.report_interval

    def _demand_moving(self) -> bool:
        """Whether any master runs or queues work by its last Ack. While none does there is no demand
        to follow, and polling every master each rebalance interval would cost an idle fleet two
        messages per node and master a second; a master that starts working here changes the
        engine's load, which is reported within the load interval and brings its Ack (without a
        working load signal that cannot happen, so then it keeps asking).

        An engine that is down (the liveness check's verdict) takes no new work from any master, so
        there is no demand to follow here either, whatever the last Acks said and although its load
        probe fails too: when it answers again the verdict's flip reports to every master at once, and
        their Acks bring the demand back. Asking anyway made a fleet whose engines all restart at
        once (a rollout) send a Report and get an Ack per node and master every second."""
        if not self.engine.up:
            return False
        if not self.load.probe_ok:
            return True
        for link in self.links.values():
            ack = link.last_ack
            if ack is not None and (ack.active_slots or ack.wanted_slots):
                return True
        return False

    def _acks_can_help(self, now: float) -> bool:
        """During a handover, whether polling the masters can move it on: some master is worth
        asking (see :meth:`_worth_polling`), or a report to it is about to go out or unanswered
        (its Ack may show that it is). Otherwise the handover waits for what wakes the loop by
        itself: an engine sample that frees a gone master's slots, a timer, a stream coming or
        going. In a failover that is the wait for the engine sample, during which a thousand
        agents woke at 10 Hz to find nothing to ask."""
        return any(
            link.connected
            and (link.send_now.is_set() or link.acked_at < link.reported_at or self._worth_polling(link, now))
            for link in self.links.values()
        )

    def _worth_polling(self, link: MasterLink, now: float) -> bool:
        """During a handover, ask a master for an Ack only when its answer can move the handover on
        (it has not confirmed the current grant, or still runs more than it) and its answer to the
        previous poll is in. Polling every master at 10 Hz regardless made a thousand agents flood
        the masters during every join and failover, which slowed the handover it waited for."""
        if not link.connected:
            return False
        if link.acked_at < link.reported_at and now - link.reported_at < UNANSWERED_REPOLL_S:
            # The previous report is unanswered: a busy master, or a busy agent that has not read
            # the answer yet. A live stream loses nothing, so its Ack is coming; asking again
            # only adds work where there is too much already (at 1 s, starved agents in a
            # thousand-node join sent twice the messages the join needs).
            return False
        ack = link.last_ack
        if ack is None:
            return True
        holds_more = ack.active_slots > self.slicer.share_for(link.master_id)
        tokens = self.slicer.token_share_for(link.master_id)
        if tokens is not None and ack.HasField("active_tokens"):
            holds_more = holds_more or ack.active_tokens > tokens
        return ack.applied_epoch < link.sent_epoch or holds_more

    async def _control_loop(self) -> None:
        next_report = time.monotonic()
        while True:
            now = time.monotonic()
            if self.slicer.tick(now, time.time_ns()):
                self._changed()
            interval = self._report_period(now)
            next_report = min(next_report, now + interval)
            if self._load_dirty:
                # load is only displayed by the masters: coalesce its changes
                next_report = min(next_report, self._last_report + self.cfg.load_report_interval)
            if now >= next_report:
                next_report = now + interval
                self._load_dirty = False
                polling = self.slicer.handover_pending
                for link in self.links.values():
                    if not polling or self._worth_polling(link, now):
                        link.send_now.set()
            wake = next_report
            deadline = self.slicer.next_deadline(now)  # after the tick at now: only later timers
            if deadline is not None:
                wake = min(wake, deadline + 0.001)
            self._kick.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # arrives as the event fires, and stop() would then wait for this task forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, wake - time.monotonic())):
                    await self._kick.wait()

    async def _probe_loop(self, probe: LoadProbe) -> None:
        bracket_next = False  # the last sample left slots of a master that may be alive reserved
        while True:
            self._probe_wake.clear()  # before sampling: a wake-up during the sample asks for another
            # A plain sample first (an idle engine frees everything); Acks around the next ones.
            bracket = bracket_next and self.slicer.waits_for_bracket
            if bracket:
                # A master that may be alive still holds slots here: the sample counts for the live
                # masters only between an Ack just before it and one just after (Handover.reconsider).
                asked = time.monotonic()
                await self._answers(self._poll_connected(), asked, BRACKET_ACK_WAIT_S)
                # What the masters sent before their Acks reaches the engine's queues meanwhile.
                await asyncio.sleep(START_SEEN_S)
            taken_at = time.monotonic()
            sample = await probe.sample()
            changed = (sample.running, sample.waiting) != (self.load.running, self.load.waiting)
            self.load = sample
            if isinstance(sample, EngineSample) and sample.kv_tokens and self._follows_pool:
                self.set_kv_tokens(sample.kv_tokens, "engine")
            # The engine's own count is what tells the handover that a departed master's leases ended:
            # every request it holds, those still waiting for their KV included (the masters count a
            # lease from the moment its decode request went out).
            held = sample.running + sample.waiting if sample.probe_ok else None
            if self.slicer.on_probe(held, taken_at, time.monotonic(), time.time_ns()):
                self._changed()
            if bracket and sample.probe_ok and self.slicer.waits_for_bracket:
                # Their answers close the bracket, once the masters could have read the ends of the
                # decodes the sample no longer counted.
                await asyncio.sleep(END_SEEN_S)
                if self.slicer.waits_for_bracket:
                    self._poll_connected()
            bracket_next = sample.probe_ok and self.slicer.waits_for_bracket
            if changed and not self._load_dirty:
                self._load_dirty = True
                self._kick.set()
            # Fast while a handover waits for the engine's count, so that a crashed master's slots
            # move on within about a second (strict mode); slow otherwise, a join included (the
            # masters' Acks move it on): at a thousand nodes a probe every 0.25 s is most of an
            # agent's work during a join and tells the masters nothing new.
            period = 0.25 if self.slicer.waits_for_engine else self.cfg.probe_interval
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(period):
                    await self._probe_wake.wait()
            # a wake-up right after a sample still waits a little: at most one sample per 0.1 s
            await asyncio.sleep(max(0.0, taken_at + 0.1 - time.monotonic()))

    async def _health_loop(self, session: aiohttp.ClientSession) -> None:
        """Check the engine's liveness; report to every master at once when the verdict flips. The
        streams and the etcd registration stay up while the engine is down: the masters then give
        the node no new leases, and take it back as soon as it answers again."""
        url = self.cfg.endpoint.rstrip("/") + "/health"
        while True:
            started = time.monotonic()
            error = await check_health(url, session, self.cfg.health_timeout)
            if self.engine.observe(not error, error):
                if self.engine.up:
                    log.info("engine %s answers again: reporting it up", self.cfg.endpoint)
                else:
                    log.warning("engine %s down: %s", self.cfg.endpoint, self.engine.reason)
                for link in self.links.values():
                    link.send_now.set()
            await asyncio.sleep(max(0.0, self.cfg.health_interval - (time.monotonic() - started)))

    # -- health -------------------------------------------------------------------------------
    @property
    def registered(self) -> bool:
        return self.ready.is_set() and self.registration is not None

    def status(self) -> dict[str, Any]:
        return {
            "node_id": self.cfg.node_id,
            "role": self.cfg.role,
            "endpoint": self.cfg.endpoint,
            "registered": self.registered,  # false while etcd has not answered yet (it keeps retrying)
            "running_max_req_size": self.slicer.capacity,
            # the node's KV pool in tokens (null: not known, or the engine publishes none) and so
            # whether masters place on slots and tokens here or on slots alone
            "kv_tokens": self.kv_tokens,
            "kv_tokens_source": self.kv_source or None,
            "capacity_unit": self.capacity_unit,
            "epoch": self.slicer.epoch,
            "shares": dict(self.slicer.shares),
            "token_shares": dict(self.slicer.token_shares) if self.kv_tokens else None,
            "handover": self.slicer.snapshot(),
            # how long a departed master's slots wait for engine samples (strict handover)
            "peer_detect_s": self.slicer.peer_detect_s,
            # a master whose address refuses connections is taken for a dead process (--no-gone-on-refusal)
            "gone_on_refusal": self.cfg.gone_on_refusal,
            "masters": {
                mid: {
                    "address": link.address,
                    "keepalive_s": link.keepalive_s,
                    "connected": link.connected,
                    "active_slots": link.last_ack.active_slots if link.last_ack else 0,
                    "wanted_slots": link.last_ack.wanted_slots if link.last_ack else 0,
                    "applied_epoch": link.last_ack.applied_epoch if link.last_ack else 0,
                    # null: the master counts no tokens (an earlier release), or has not acked yet
                    "active_tokens": _opt(link.last_ack, "active_tokens"),
                    "wanted_tokens": _opt(link.last_ack, "wanted_tokens"),
                    "token_share": self.slicer.token_share_for(mid),
                }
                for mid, link in sorted(self.links.items())
            },
            "engine": {"check": self.cfg.health_check, **self.engine.as_json()},
            "load": {
                **self.load.as_json(),
                # which engine endpoint the load comes from ("none": strict handover falls back to
                # --orphan-timeout for a crashed master's slots)
                "signal": self.probe.as_json() if self.probe is not None else {"signal": "off"},
            },
        }

    @property
    def capacity_unit(self) -> str:
        if self.kv_tokens:
            return "slots and kv tokens"
        if self._pool_absent or not self._follows_pool:
            return "slots only"
        return "slots (kv pool not known yet)"

    def set_kv_tokens(self, pool: int | None, source: str) -> bool:
        """The node's KV pool changed (found, or the engine now says another): token shares follow
        and every master hears the new pool in a new Register. True when it changed."""
        pool = pool or None
        if pool == self.kv_tokens:
            return False
        log.info(
            "KV pool of engine %s: %s tokens (from the %s)%s",
            self.cfg.endpoint,
            pool,
            "--kv-tokens flag" if source == "flag" else "engine",
            f", was {self.kv_tokens}" if self.kv_tokens else "",
        )
        self.kv_tokens, self.kv_source = pool, source
        self._value_stale = True
        self.slicer.set_kv_tokens(pool, time.monotonic(), time.time_ns())
        self._changed()
        for link in self.links.values():
            link.send_now.set()  # its stream registers again, with the new pool
        return True

    def _pool_unpublished(self) -> None:
        """The engine answered and publishes no KV pool: say so once."""
        if self._pool_absent:
            return
        self._pool_absent = True
        log.warning(
            "engine %s publishes no KV pool (SGLang max_total_num_tokens, vLLM vllm:cache_config_info): "
            "capacity is slots only on node %s; pass --kv-tokens to give its pool in tokens",
            self.cfg.endpoint,
            self.cfg.node_id,
        )

    async def _discover_pool(self, session: aiohttp.ClientSession, timeout: float) -> bool:
        """Ask the engine for its pool once; True when it answered (with a pool or without)."""
        try:
            info = await discover_engine(self.cfg.endpoint, session, timeout=timeout)
        except EngineUnreachable:
            return False
        if info.kv_tokens:
            self.set_kv_tokens(info.kv_tokens, "engine")
        else:
            self._pool_unpublished()
        return True

    async def _pool_loop(self, session: aiohttp.ClientSession) -> None:
        """Until the engine answers (it may still be loading its model): ask it for its KV pool."""
        backoff = Backoff(0.5, 10.0)
        while True:
            if await self._discover_pool(session, 5.0):
                return
            await asyncio.sleep(backoff.next())

    async def _start_health(self) -> None:
        """Serve /health and /status from the start, before etcd answers: /status then says the agent
        is still registering, and a port clash is a start-up error naming the flag, not a crash later."""
        if self.cfg.health_port is None:
            return
        app = web.Application()

        async def health(_r: web.Request) -> web.Response:
            ok = self.registered
            return web.json_response({"ok": ok}, status=200 if ok else 503)

        async def status(_r: web.Request) -> web.Response:
            return web.json_response(self.status())

        app.router.add_get("/health", health)
        app.router.add_get("/status", status)
        self._health = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._health.setup()
        try:
            await web.TCPSite(self._health, self.cfg.health_host, self.cfg.health_port).start()
        except OSError as exc:
            raise StartupError(
                f"--health-port: cannot listen on {self.cfg.health_host}:{self.cfg.health_port}: "
                f"{exc.strerror or exc}"
            ) from exc

    # -- lifecycle ----------------------------------------------------------------------------
    async def _restore_epoch(self) -> None:
        self.slicer.restore_epoch(await self._stored_epoch())

    async def start(self) -> None:
        """Register in etcd, retrying for as long as etcd is unreachable; then run the loops.

        Raises only on a configuration error: etcd TLS or credentials, or the node id still held by
        another live agent after ``register_wait``.
        """
        await self._start_health()
        if self._pool_wanted:
            self._http = aiohttp.ClientSession()
            # Before registering and before the streams open, so that the node's key and the
            # Registers carry the pool; an engine that is not up yet is asked again in the background
            # (its pool then goes out in new streams).
            if not await self._discover_pool(self._http, 2.0):
                self._tasks.append(asyncio.create_task(self._pool_loop(self._http), name="kv-pool"))
        registration = Registration(
            self.etcd, self.keys.node(self.cfg.node_id), self._node_value, ttl=self.cfg.etcd.lease_ttl
        )
        await register_with_retry(
            self.etcd, registration, log, held_wait=self.cfg.register_wait, before=self._restore_epoch
        )
        self.registration = registration
        self._tasks.append(asyncio.create_task(self._persist_loop(), name="persist"))
        if (self.cfg.load_urls or self.cfg.health_check) and self._http is None:
            self._http = aiohttp.ClientSession()
        if self.cfg.load_urls:
            assert self._http is not None
            probe = self.probe = LoadProbe(self.cfg.load_urls, self._http)
            self._tasks.append(asyncio.create_task(self._probe_loop(probe), name="probe"))
        if self.cfg.health_check:
            assert self._http is not None
            self._tasks.append(asyncio.create_task(self._health_loop(self._http), name="engine-health"))
        self._tasks.append(asyncio.create_task(self._watch_masters(), name="watch-masters"))
        self._tasks.append(asyncio.create_task(self._control_loop(), name="control"))
        self.ready.set()
        log.info(
            "agent %s (%s, capacity %d, %s) registered in cluster %s",
            self.cfg.node_id,
            self.cfg.role,
            self.slicer.capacity,
            self.cfg.endpoint,
            self.cfg.etcd.cluster,
        )
        print(f"nodeagent ready node_id={self.cfg.node_id}", flush=True)

    async def stop(self) -> None:
        """Graceful stop: tell every master we leave, then revoke the lease."""
        self._stopping = True
        for link in list(self.links.values()):
            if link.call is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(
                        link.call.write(pb.AgentMessage(leaving=pb.Leaving(reason="shutdown"))), 0.5
                    )
                    await asyncio.wait_for(link.call.done_writing(), 0.5)
        tasks = self._tasks + [lk.task for lk in self.links.values() if lk.task is not None]
        for task in tasks:
            task.cancel()
        # Bounded: a task that swallows its cancellation must not keep the agent (and its lease) up.
        _, stuck = await asyncio.wait(tasks, timeout=3.0) if tasks else (set(), set())
        for task in stuck:
            log.warning("task %s did not stop within 3 s of its cancellation", task.get_name())
        if self.registration is not None:
            with contextlib.suppress(EtcdError):
                await self.registration.stop(revoke=True)
        if self._health is not None:
            await self._health.cleanup()
        if self._http is not None:
            await self._http.close()
        await self.etcd.close()
