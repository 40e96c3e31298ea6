"""Assembles one master from its ``MasterConfig`` and runs its lifecycle: etcd registration, the gRPC
NodeCoordination server, the HTTP servers, draining on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import grpc.aio
from aiohttp import web
from prometheus_client import CollectorRegistry

from pdcoord import __version__
from pdcoord.etcd import EtcdClient, EtcdError
from pdcoord.gctuning import tune_gc
from pdcoord.keepalive import (
    DEFAULT_DETECT_S,
    DEFAULT_KEEPALIVE_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    UNADVERTISED_DETECT_S,
)
from pdcoord.keys import Keys
from pdcoord.registration import AlreadyRegistered, Registration
from pdcoord.retry import Outage, register_with_retry
from pdcoord.v1 import coordination_pb2_grpc as pb_grpc
from pdmaster.admission import PeerLoad
from pdmaster.anchor import Anchor
from pdmaster.api import ControlRoutes, OpenAIRoutes, api_key_middleware, harden_aiohttp, load_api_keys
from pdmaster.config import MasterConfig
from pdmaster.coordination import CoordinationService
from pdmaster.engine import EnginePool, make_dispatch
from pdmaster.engine.health import BreakerState, CircuitBreaker, EngineBreakers
from pdmaster.engine_priority import class_priorities
from pdmaster.lifecycle import Lifecycle
from pdmaster.metrics import MasterMetrics, RequestMetrics
from pdmaster.pausewatch import PauseWatch
from pdmaster.pipeline import RequestPipeline
from pdmaster.registry import DECODE, NodeRegistry, ShareChanges, split_changes
from pdmaster.routing import POLICIES, Router
from pdmaster.spill import ROOM_PATH, Spill, peers_from_etcd
from pdmaster.staged_admission import StagedAdmission, make_admission
from pdmaster.token_charge import TokenCharge

log = logging.getLogger(__name__)

# How often a master counts the live masters in etcd (the floor of its admission queue bound, see
# AdmissionCore._queue_bound): one small range read; a count a few seconds old only moves a bound.
MASTERS_POLL_S = 2.0
# After a drain timeout, how long the cancelled requests get to end before the key is revoked.
CANCEL_WAIT_S = 2.0
# How often the master looks at the nodes whose stream is down: it forgets those that are gone (their
# agent said Leaving or their etcd key is gone) once no lease of its own runs there.
FORGET_POLL_S = 1.0
# How often it asks etcd whether a disconnected node's key is still there (first after this long):
# a killed agent's key goes one lease TTL after its last renewal.
KEY_CHECK_S = 10.0
# More keys than this due in one pass: one range read of nodes/ instead of one read each.
KEY_CHECK_MAX_GETS = 16
# While a node's stream is down: how often the master looks at what it still runs there, to name the
# stream in its etcd key ("released"); the node's agent then frees the rest at once instead of waiting
# for engine samples, which short requests under load rarely let prove anything. While every stream is
# up the loop sleeps until one closes.
RELEASE_POLL_S = 0.1
# A request the master abandoned (client gone, engine error, timeout) may run on in the engine: its
# cancellation reaches the engine only over a working link. One abandoned at least this long before
# the last message on the agent's stream (same host, so the link then worked) has been stopped; one
# abandoned later keeps the stream from being named released (the agent waits for engine samples).
RELEASE_ABORT_MARGIN_S = 2.0
# While the etcd lease is lost: how often the master looks for nodes where its last lease ended, to
# tell their agents at once that it drains there (CoordinationService.push_draining).
LOST_DRAIN_POLL_S = 0.05


# Keep-alive, so that a silently cut agent stream is noticed within --keepalive + --keepalive-timeout
# (2 + 1 s by default) even when it carries nothing. Strict handover relies on the agents allowing
# a master that long before an engine sample may free what it held there: the master advertises the
# sum in its etcd key (``detect_s``), and the agents never allow less than
# nodeagent.slicing.PEER_DETECT_S (1.75 s; the protocol model checks the pair). The answer time was
# 0.25 s: on a loaded machine agents missed it by the thousand (1 000 agents in five processes:
# 11 444 pings unanswered in time, each a stream dropped and re-opened, and joins never converged).
# Pings are per connection and are most of a master's idle control-plane CPU; the agents ping only
# after a longer silence (``keepalive_s`` in the key), as the master's pings reset their timer.
# gRPC (1.85) closes a connection on an unanswered ping only after ``grpc.http2.ping_timeout_ms``
# (default one minute); ``keepalive_timeout_ms`` alone does not.
def grpc_server_options(
    keepalive: float = DEFAULT_KEEPALIVE_S, keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT_S
) -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", round(keepalive * 1000)),
        ("grpc.keepalive_timeout_ms", round(keepalive_timeout * 1000)),
        ("grpc.http2.ping_timeout_ms", round(keepalive_timeout * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 500),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_receive_message_length", 1 << 20),
        ("grpc.max_send_message_length", 1 << 20),
        # Control messages are a few hundred bytes: flow-control window probing (BDP pings on received
        # data) buys nothing here and costs wake-ups per stream.
        ("grpc.http2.bdp_probe", 0),
    ]


GRPC_SERVER_OPTIONS = grpc_server_options()


class StartupError(Exception):
    """A reason the master cannot start, phrased for the operator."""


# -- the addresses this master advertises in etcd ------------------------------------------------------
# A listener on a wildcard address (the default --grpc-host 0.0.0.0) cannot be advertised as such: an
# agent on another host would dial its own machine. The master advertises the address of the interface
# its default route uses instead -- the address other hosts see when this one talks to them, and in a
# container the pod's address -- and, when there is no default route, what its host name resolves to.
# Not the host name first: Debian and Ubuntu map it to 127.0.1.1 in /etc/hosts. Loopback and link-local
# addresses do not count; with none left the master refuses to start, naming --advertise-host.
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
# Documentation addresses (RFC 5737, RFC 3849): routed nowhere, so the kernel answers a route lookup
# for them with the default route. A UDP connect only looks the route up; no packet is sent.
_ROUTE_PROBES: dict[int, str] = {socket.AF_INET: "203.0.113.1", socket.AF_INET6: "2001:db8::1"}


def is_wildcard(host: str) -> bool:
    return host.strip() in WILDCARD_HOSTS


def default_route_address(family: int) -> str | None:
    """The local address of the interface the default route of *family* leaves by, None without one."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((_ROUTE_PROBES[family], 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def hostname_address() -> str | None:
    """What this host's name resolves to (IPv4), None when it does not resolve."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def _reachable(address: str | None) -> bool:
    """An address other hosts can use: not loopback, unspecified or link-local (which needs a zone)."""
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    return not (ip.is_loopback or ip.is_unspecified or ip.is_link_local)


def advertised_host(
    bind_host: str,
    advertise_host: str | None,
    flag: str,
    *,
    route_address: Callable[[int], str | None],
    hostname_address: Callable[[], str | None],
) -> str:
    """The host to put into etcd for a listener bound to *bind_host* (given with *flag*).

    ``--advertise-host`` wins; a specific bind address is itself; a wildcard one becomes the default
    route's interface address (IPv6 first for ``::``), else the host name's address. StartupError,
    naming ``--advertise-host``, when none of them is reachable from another host.
    """
    if advertise_host:
        return advertise_host
    if not is_wildcard(bind_host):
        return bind_host
    families = [socket.AF_INET6, socket.AF_INET] if ":" in bind_host else [socket.AF_INET]
    tried: list[str] = []
    for family in families:
        address = route_address(family)
        if _reachable(address):
            return str(address)
        tried.append(f"default route: {address or 'none'}")
    address = hostname_address()
    if _reachable(address):
        return str(address)
    tried.append(f"host name: {address or 'does not resolve'}")
    raise StartupError(
        f"{flag} {bind_host or '(empty)'} listens on every address, and no address of this host that "
        f"other hosts can reach was found to advertise in etcd ({'; '.join(tried)}): pass --advertise-host "
        "with the address agents and clients should use (127.0.0.1 when everything runs on this machine)"
    )


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class MasterServer:
    def __init__(self, config: MasterConfig) -> None:
        self.config = cfg = config
        self.master_id = cfg.master_id
        # Whether admission may count on the shares the agents grant: only while this master can prove
        # its etcd lease alive (see _on_lease_held).
        self._lease_held = False
        self._lease_losses = 0
        self._lost_drain_task: asyncio.Task[None] | None = None
        self.keys = Keys.for_cluster(cfg.etcd.cluster, cfg.etcd.prefix)
        self.metrics_registry = CollectorRegistry()
        self.metrics = MasterMetrics(self.metrics_registry, self.master_id)
        self.lifecycle = Lifecycle()
        # Credentials are read and checked before anything listens: a bad file fails the start.
        try:
            self.api_keys = load_api_keys(cfg.api_keys, cfg.api_keys_file)
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
        self.registry = NodeRegistry(
            max_node_capacity=cfg.max_node_capacity,
            max_nodes=cfg.max_nodes,
            max_start_args=cfg.max_start_args,
            max_start_arg_bytes=cfg.max_start_arg_bytes,
            # Admission hears of share changes once per event-loop tick: a failover moves the
            # shares of every node, and re-reading all shares per message would be O(n²).
            defer=lambda fn: asyncio.get_running_loop().call_soon(fn),
        )
        self.admission = make_admission(
            cfg.admission, registry=self.metrics_registry, master_id=self.master_id
        )
        # After this process stood still, place nothing until the agents' verdicts are read.
        self.pause_watch = PauseWatch(on_pause=lambda _gap: self.metrics.pauses.inc())
        self.admission.watch_pauses(self.pause_watch.resumed_at, cfg.detect_s)
        self.registry.subscribe_changes(self._on_shares)
        self.anchor = Anchor(self.master_id)
        self.coordination = CoordinationService(
            self.master_id,
            self.registry,
            self.metrics,
            self.lifecycle,
            slots=self._slots,
            floor=self._floor,
            max_reports_per_s=cfg.max_reports_per_s,
            on_engine=self._on_agent_engine,
            kept=lambda node, mark: self.admission.core.kept_since(node, mark),
            tokens=self._tokens,
            on_closed=self._node_closed,
        )
        self.breakers = EngineBreakers(cfg.breaker, on_change=self._on_breaker)
        self.request_metrics = RequestMetrics(self.metrics_registry)
        self.spill = Spill(
            self.master_id,
            cfg.spill_peers,
            metric=self.request_metrics.spilled,
            # a draining master takes no new work: it has no room for its peers either
            load_now=lambda: PeerLoad() if self.lifecycle.draining else self.admission.load(),
            api_key=self.api_keys[0] if self.api_keys else None,
        )
        self.pipeline = RequestPipeline(
            router=Router(self.registry, POLICIES[cfg.prefill_selection]()),
            admission=self.admission,
            dispatch_factory=lambda pool: make_dispatch(cfg.engine_protocol, pool),
            lifecycle=self.lifecycle,
            metrics=self.request_metrics,
            breakers=self.breakers,
            on_engine_failure=self._on_engine_failure,
            max_retries=cfg.max_retries,
            spill=self.spill,
            engine_priority=class_priorities(cfg.engine_priority),
            engine_priority_auto=cfg.engine_priority == "auto",
            charges=TokenCharge(cfg.token_charge),
            pool_factory=lambda: EnginePool(
                connect_timeout_s=cfg.engine_connect_timeout,
                first_byte_timeout_s=cfg.engine_first_byte_timeout,
                idle_timeout_s=cfg.engine_idle_timeout,
            ),
        )
        self.etcd = EtcdClient(cfg.etcd.endpoints, **cfg.etcd.options)
        self.registration: Registration | None = None
        self._key_doc: dict[str, object] = {}  # the value of masters/<id>
        self.grpc_server: grpc.aio.Server | None = None
        self.http_runner: web.AppRunner | None = None
        self.admin_runner: web.AppRunner | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.admin_port = 0
        self._stop = asyncio.Event()
        self._count_task: asyncio.Task[None] | None = None
        self._forget_task: asyncio.Task[None] | None = None
        self._key_check_at: dict[str, float] = {}  # disconnected node -> next look at its etcd key
        self._release_task: asyncio.Task[None] | None = None
        self._handoff_task: asyncio.Task[None] | None = None
        # node -> {"stream": Register.stream_id of its gone stream, "running": slots}, as in the key
        self._released: dict[str, dict[str, int]] = {}
        self._stream_closed = asyncio.Event()  # wakes _release_loop, which sleeps while every stream is up

    # -- lifecycle ----------------------------------------------------------------------------
    def _on_shares(self, changes: ShareChanges) -> None:
        if self._lease_held:  # otherwise admission holds nothing; the registry keeps the shares
            self.admission.update_shares(*split_changes(changes), *self.registry.token_changes(changes))

    def _on_lease_held(self, held: bool) -> None:
        """This master can prove its etcd lease alive again (``held``), or can no longer.

        Its key goes from etcd at the earliest one TTL after the last renewal etcd confirmed, and the
        agents then hand its shares to the other masters. Strict handover makes that safe where this
        master's stream to the agent is up (the agent lowers its grant and waits for the Ack); where
        the stream is down too the agent counts this master's slots as an orphan's, which it frees on
        engine samples on the assumption that a master whose key is gone places nothing new. So a
        margin before that moment (``Registration.held``) admission drops to capacity 0: queued
        requests are refused (503), new ones too, readiness fails. Running requests finish: they are
        covered by strict handover or counted as the orphan's, exactly as those of a master cut from
        an agent while registered. Meanwhile, wherever none of its leases runs any more, its Acks say
        it drains and go out at once (CoordinationService.push_draining): the agent takes it out of
        the split with nothing reserved and hands its share to the other masters without waiting for
        an engine sample, before its key expires. Once etcd confirms the lease again, or the key is
        re-created under a new lease, the streams whose Acks said so are closed first (the agents
        re-register it with what they grant now, through strict handover), then admission takes the
        shares the agents grant it on the others.
        """
        if held == self._lease_held:
            return
        self._lease_held = held
        self.metrics.lease_held.set(1 if held else 0)
        if held:
            if self._lost_drain_task is not None:
                self._lost_drain_task.cancel()
                self._lost_drain_task = None
            # Before reading the shares: a stream whose Ack said draining may hold grants the agent
            # gave before it took this master out of the split; it is closed and counts 0.
            closed = self.coordination.lease_back()
            if closed:
                log.info(
                    "master %s: closed the streams of %d node(s) it drained from while its lease was "
                    "lost; their agents re-register it with what they grant now",
                    self.master_id,
                    len(closed),
                )
            shares = self.registry.decode_shares()
            if self._lease_losses:
                log.warning(
                    "master %s: etcd confirms its registration again; admitting on the %d decode slots "
                    "the agents grant it now",
                    self.master_id,
                    sum(s for s, _ in shares.values()),
                )
            self.admission.set_shares(*split_changes(shares), *self.registry.token_changes(shares))
        else:
            self._lease_losses += 1
            self.metrics.lease_losses.inc()
            log.warning(
                "master %s: cannot prove its etcd lease alive (no renewal confirmed in time: etcd "
                "unreachable?); its key may go and the agents hand its shares on, so it admits nothing "
                "new (queued requests refused, running ones finish) until etcd confirms it again",
                self.master_id,
            )
            self.admission.set_shares({})
            # Only now (nothing can be granted any more): its Acks say it drains wherever none of
            # its leases runs, so the agents hand those shares on before its key expires.
            self.coordination.lease_lost = True
            self.coordination.push_draining()
            self._lost_drain_task = asyncio.get_running_loop().create_task(
                self._lost_drain_loop(), name="lost-drain"
            )

    async def _lost_drain_loop(self) -> None:
        """While the lease is lost: tell each agent as soon as this master's last lease there ended."""
        while self.coordination.lease_lost:
            await asyncio.sleep(LOST_DRAIN_POLL_S)
            self.coordination.push_draining()

    # -- engine faults --------------------------------------------------------------------------
    def _on_breaker(self, node_id: str, breaker: CircuitBreaker) -> None:
        """A breaker moved: an open one takes the node out of placement until its trial time; a
        half-open one offers one slot there (the trial)."""
        state = breaker.current
        is_open = state is BreakerState.OPEN
        reason = breaker.last_error if state is not BreakerState.CLOSED else ""
        self.registry.set_breaker(node_id, state.value, reason)
        self.metrics.breaker_open.labels(node=node_id).set(0 if state is BreakerState.CLOSED else 1)
        self.metrics.observe_node(self.registry, node_id)
        if is_open:
            log.warning(
                "node %s: circuit breaker open for %.3g s after %s; no new leases there",
                node_id,
                breaker.backoff,
                breaker.last_error or "failures",
            )
            asyncio.get_running_loop().call_later(
                breaker.seconds_to_trial() + 0.001, self.breakers.refresh, node_id
            )
        else:
            log.info("node %s: circuit breaker %s", node_id, state.value)

    def _on_engine_failure(self, node_id: str, kind: str) -> None:
        self.metrics.engine_failed(node_id, kind)

    # -- forgetting nodes that are gone ---------------------------------------------------------
    def _node_closed(self, node_id: str) -> None:
        """A node's stream ended: forget it at once if it said Leaving and nothing of ours runs there."""
        self._stream_closed.set()
        self._try_forget(node_id)

    def _try_forget(self, node_id: str) -> bool:
        """Forget a node that is gone and runs nothing of this master's (no decode lease, no prefill
        in flight): its table entry, breaker, prefix index entries and metric series."""
        router = self.pipeline.router
        prefills = router.prefill_in_flight.get(node_id, 0)
        if prefills or not self.registry.forgettable(node_id, self.admission.active_on(node_id)):
            return False
        node = self.registry.forget(node_id)
        if node is None:
            return False
        self._key_check_at.pop(node_id, None)
        router.prefill_in_flight.pop(node_id, None)
        router.prefill_tokens.pop(node_id, None)
        router.index.remove_node(node_id)
        self.breakers.breakers.pop(node_id, None)
        self.anchor.forget(node_id)
        self.admission.forget_node(node_id)  # it holds no share there already (its stream is down)
        self.metrics.forget_node(node_id)
        log.info(
            "node %s (%s) forgotten: %s, and no request of this master runs there",
            node_id,
            node.role,
            "its agent left" if node.leaving else "its etcd key is gone",
        )
        return True

    async def _forget_loop(self) -> None:
        outage = Outage(log, "looking up the etcd keys of disconnected nodes", level=logging.INFO)
        while True:
            await asyncio.sleep(FORGET_POLL_S)
            try:
                await self._forget_pass()
            except EtcdError as exc:
                outage.failed(exc)  # nothing is forgotten on a key not seen gone
            else:
                outage.recovered()

    async def _forget_pass(self) -> None:
        """Forget the gone nodes whose last request ended; look up the keys of the others when due."""
        now = time.monotonic()
        checks = self._key_check_at
        down = self.registry.disconnected()
        for node_id in set(checks).difference(down):
            del checks[node_id]  # reconnected (or forgotten) meanwhile
        due: list[str] = []
        for node_id in down:
            if self._try_forget(node_id):
                continue
            node = self.registry.nodes.get(node_id)
            if node is None or node.gone:
                checks.pop(node_id, None)  # waits for its requests to end only
                continue
            if now >= checks.setdefault(node_id, now + KEY_CHECK_S):
                due.append(node_id)
        if not due:
            return
        present = await self._node_keys_present(due)
        later = time.monotonic() + KEY_CHECK_S
        for node_id in due:
            checks[node_id] = later
            if node_id not in present and self.registry.mark_key_gone(node_id):
                log.info("node %s: its stream is down and its etcd key is gone", node_id)
                self._try_forget(node_id)

    async def _node_keys_present(self, node_ids: list[str]) -> set[str]:
        """Which of ``node_ids`` have a key under nodes/ in etcd now."""
        keys = self.keys
        if len(node_ids) <= KEY_CHECK_MAX_GETS:
            found = await asyncio.gather(*(self.etcd.get(keys.node(n)) for n in node_ids))
            return {n for n, kv in zip(node_ids, found, strict=True) if kv is not None}
        kvs, _ = await self.etcd.get_prefix(keys.nodes_prefix)
        present = set()
        for kv in kvs:
            try:
                present.add(keys.id_from_key(kv.key, keys.nodes_prefix))
            except ValueError:
                continue
        return present

    # -- naming gone streams on which nothing of this master runs -------------------------------
    def released_streams(self) -> dict[str, dict[str, int]]:
        """Nodes whose stream is down and where this master holds no share, each with the id of that
        stream and the slots its requests there still run (decode leases; prefills on a prefill
        node). It places nothing there until a new stream brings a new grant, so its agent may hand
        on at once what it held beyond them, and the rest as they end. Not a node where a request it
        abandoned may still run in the engine (RELEASE_ABORT_MARGIN_S): it cannot count that one."""
        down = self.registry.disconnected()
        if not down:
            return {}
        self.registry.flush()  # admission must already hold no share there
        router = self.pipeline.router
        out: dict[str, dict[str, int]] = {}
        for node_id in down:
            node = self.registry.nodes.get(node_id)
            if node is None or not node.stream_id:
                continue  # an agent of an earlier release names no stream
            if (
                self.admission.share_on(node_id)
                or self.admission.unfinished_end_at(node_id) >= node.heard_at - RELEASE_ABORT_MARGIN_S
            ):
                continue
            running = self.admission.active_on(node_id) + router.prefill_in_flight.get(node_id, 0)
            out[node_id] = {"stream": node.stream_id, "running": running}
        return out

    async def _release_loop(self) -> None:
        outage = Outage(log, "naming released streams in this master's etcd key", level=logging.INFO)
        while True:
            if not self._released and not self.registry.disconnected():
                self._stream_closed.clear()
                await self._stream_closed.wait()  # nothing to name until a stream closes
            await asyncio.sleep(RELEASE_POLL_S)
            if self.registration is None or self.lifecycle.draining:
                continue
            want = self.released_streams()
            if want == self._released:
                continue
            doc = {**self._key_doc, "released": want} if want else self._key_doc
            try:
                # Not registered at the moment: the value is kept for the key's re-creation.
                await self.registration.update(json.dumps(doc))
            except EtcdError as exc:
                outage.failed(exc)  # the agents wait for their engine samples, as without it
                continue
            outage.recovered()
            if want.keys() - self._released.keys():
                log.info("released in etcd: the lost streams of %s", sorted(want))
            self._released = want

    def _on_agent_engine(self, node_id: str, down: bool) -> None:
        if not down:
            # The agent sees the engine answer again: that is the evidence a trial would give.
            self.breakers.reset(node_id)

    def _slots(self, node_id: str) -> tuple[int, int]:
        # The queue can be served by any decode node: spread its demand over them, so agents that
        # follow demand hand this master about what it is missing in all, not that much per node.
        wanted = self.admission.wanted_slots()
        if wanted:
            nodes = max(1, len(self.registry.live(DECODE)))
            wanted = -(-wanted // nodes)
        return self.admission.active_on(node_id), wanted

    def _tokens(self, node_id: str) -> tuple[int, int, int]:
        """(active_tokens, wanted_tokens, kept_tokens) for an Ack on a decode node, as ``_slots`` and
        ``kept`` give its slots (the kept tokens are those of the leases the kept slots counted)."""
        core = self.admission.core
        wanted = core.wanted_tokens()
        if wanted:
            wanted = -(-wanted // max(1, len(self.registry.live(DECODE))))
        return core.active_tokens_on(node_id), wanted, core.last_kept_tokens(node_id)

    def _floor(self, node_id: str) -> int:
        """Ack.floor_slots on a decode node: 1 on this master's anchor, 0 elsewhere (pdmaster/anchor.py)."""
        return self.anchor.floor_on(node_id, self._anchor_candidates(), time.monotonic())

    def _anchor_candidates(self) -> Iterator[str]:
        """Decode nodes that can take work from this master, whatever its share there now."""
        for n in self.registry.nodes.values():
            if (
                n.role == DECODE
                and n.connected
                and n.usable
                and not (n.leaving or n.key_gone or n.legacy)
                and n.running_max_req_size > 0
            ):
                yield n.node_id

    def admission_snapshot(self) -> dict[str, Any]:
        snap = self.admission.snapshot()
        snap["ttft_slo"] = self.config.ttft_slo or None
        snap["engine_priority"] = self.config.engine_priority
        charges = self.pipeline.charges
        snap["token_charge"] = None if charges is None else charges.snapshot()
        # Decode nodes that publish no KV pool: bounded by their slots alone (DESIGN §13).
        snap["slots_only_nodes"] = sorted(
            n.node_id for n in self.registry.nodes.values() if n.role == DECODE and n.kv_tokens is None
        )
        return snap

    def _control_routes(self) -> ControlRoutes:
        return ControlRoutes(
            master_id=self.master_id,
            registry=self.registry,
            metrics_registry=self.metrics_registry,
            admission_snapshot=self.admission_snapshot,
            lifecycle=self.lifecycle,
        )

    def build_app(self) -> web.Application:
        middlewares = []
        if self.api_keys:
            # Probes carry no credentials; everything else on the public port needs a key.
            middlewares.append(api_key_middleware(self.api_keys, open_paths={"/health", "/readiness"}))
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=middlewares)
        self._control_routes().install(app, admin=not self.config.separate_admin)
        OpenAIRoutes(
            pipeline=self.pipeline,
            registry=self.registry,
            limits=self.config.limits,
            lifecycle=self.lifecycle,
            metrics=self.request_metrics,
            engine_protocol=self.config.engine_protocol,
        ).install(app)
        app.router.add_get(ROOM_PATH, self.spill.room)  # peers' hand-offs (pdmaster/spill.py)
        return app

    def build_admin_app(self) -> web.Application:
        """/metrics and /admission (and /health) for the admin listener: meant for a private network."""
        app = web.Application(client_max_size=64 * 1024)
        routes = self._control_routes()
        routes.install(app, probes=False)
        app.router.add_get("/health", routes.health)
        return app

    def _runner(self, app: web.Application) -> web.AppRunner:
        return web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,  # a client that goes away cancels its handler: lease released
            shutdown_timeout=2.0,  # the drain already waited for in-flight requests
            max_line_size=self.config.max_header_bytes,
            max_field_size=self.config.max_header_bytes,
            max_headers=self.config.max_headers,
        )

    async def _listen(self, runner: web.AppRunner, host: str, port: int, flag: str) -> int:
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            raise StartupError(f"{flag}: cannot listen on {host}:{port}: {exc}") from exc
        sockets = getattr(site._server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else port

    def _advertised(self, bind_host: str, flag: str) -> str:
        return advertised_host(
            bind_host,
            self.config.advertise_host,
            flag,
            route_address=default_route_address,
            hostname_address=hostname_address,
        )

    async def start(self) -> None:
        cfg = self.config
        # Before anything listens: a master that could not tell others where it is fails at once.
        advertise = self._advertised(cfg.grpc_host, "--grpc-host")
        http_advertise = self._advertised(cfg.http_host, "--http-host")
        admin_host = cfg.admin_host or cfg.http_host
        admin_advertise = self._advertised(admin_host, "--admin-host") if cfg.separate_admin else ""
        self.grpc_server = grpc.aio.server(options=grpc_server_options(cfg.keepalive, cfg.keepalive_timeout))
        pb_grpc.add_NodeCoordinationServicer_to_server(self.coordination, self.grpc_server)
        address = f"{cfg.grpc_host}:{cfg.grpc_port}"
        if cfg.grpc_tls is not None:
            self.grpc_port = self.grpc_server.add_secure_port(address, cfg.grpc_tls.credentials())
        else:
            self.grpc_port = self.grpc_server.add_insecure_port(address)
        if self.grpc_port == 0:
            raise StartupError(f"--grpc-port: cannot listen on {cfg.grpc_host}:{cfg.grpc_port}")
        await self.grpc_server.start()
        self.pause_watch.start()

        harden_aiohttp()
        self.http_runner = self._runner(self.build_app())
        self.http_port = await self._listen(self.http_runner, cfg.http_host, cfg.http_port, "--http-port")
        if cfg.admin_port is not None:
            self.admin_runner = self._runner(self.build_admin_app())
            self.admin_port = await self._listen(
                self.admin_runner, admin_host, cfg.admin_port, "--admin-port"
            )

        self._key_doc = {
            "master_id": self.master_id,
            "grpc": host_port(advertise, self.grpc_port),
            "http": f"http://{host_port(http_advertise, self.http_port)}",
            "version": __version__,
            "started_at": time.time(),
            # how often this master pings an idle agent stream, and how soon it notices one cut
            "keepalive_s": cfg.keepalive,
            "detect_s": cfg.detect_s,
        }
        if cfg.separate_admin:  # where /admission and /metrics went (pdcoord status reads them there)
            self._key_doc["admin"] = f"http://{host_port(admin_advertise, self.admin_port)}"
        key = self.keys.master(self.master_id)
        value = json.dumps(self._key_doc).encode()
        registration = Registration(
            self.etcd, key, value, ttl=cfg.etcd.lease_ttl, on_held=self._on_lease_held
        )
        try:
            # Retries for as long as etcd is unreachable; raises only on a configuration error.
            await register_with_retry(self.etcd, registration, log)
            self.registration = registration
            self.lifecycle.registered_while(lambda: registration.held)
            self.lifecycle.lease_lost_while(lambda: not registration.held)
            self._on_lease_held(registration.held)
        except AlreadyRegistered as exc:
            raise StartupError(
                f"--master-id {self.master_id!r} is live in etcd under another lease; "
                f"refusing to start a second master with the same id ({exc})"
            ) from exc
        log.info(
            "master %s ready: http %s:%d grpc %s:%d (advertised %s, %s), cluster %s, %s",
            self.master_id,
            cfg.http_host,
            self.http_port,
            cfg.grpc_host,
            self.grpc_port,
            advertise,
            "plaintext" if cfg.grpc_tls is None else ("mTLS" if cfg.grpc_tls.mutual else "TLS"),
            cfg.etcd.cluster,
            f"{len(self.api_keys)} API key(s)" if self.api_keys else "open API (no API keys)",
        )
        if cfg.detect_s > DEFAULT_DETECT_S:
            log.warning(
                "--keepalive %g s + --keepalive-timeout %g s: a cut agent stream is noticed within %.2f s, "
                "later than the default %.2f s",
                cfg.keepalive,
                cfg.keepalive_timeout,
                cfg.detect_s,
                DEFAULT_DETECT_S,
            )
        if cfg.detect_s > UNADVERTISED_DETECT_S:
            log.info(
                "--keepalive %g s + --keepalive-timeout %g s: a cut agent stream is noticed within %.2f s; "
                "agents that do not read detect_s from this master's etcd key (releases before it was "
                "added) allow a master 1.75 s only, so after a silent network cut their strict "
                "handover could hand this master's slots on too early: upgrade agents first, or run "
                "--keepalive 0.65 until the last of them is gone",
                cfg.keepalive,
                cfg.keepalive_timeout,
                cfg.detect_s,
            )
        self._count_task = asyncio.create_task(self._count_masters(), name="count-masters")
        self._forget_task = asyncio.create_task(self._forget_loop(), name="forget-nodes")
        self._release_task = asyncio.create_task(self._release_loop(), name="release-streams")
        if cfg.spill_peers and not isinstance(self.admission, StagedAdmission):
            # Two-stage admission waits for its decode lease after the prefill: nothing to hand off.
            self._handoff_task = asyncio.create_task(
                self.spill.run_handoffs(self.admission), name="hand-offs"
            )
        tune_gc()  # start-up is done: what it allocated is never scanned again
        print(
            f"pdmaster ready master_id={self.master_id} "
            f"http_port={self.http_port} grpc_port={self.grpc_port}"
            + (f" admin_port={self.admin_port}" if cfg.separate_admin else ""),
            flush=True,
        )

    async def _count_masters(self) -> None:
        outage = Outage(log, "counting the masters in etcd", level=logging.INFO)
        while True:
            try:
                kvs, _ = await self.etcd.get_prefix(self.keys.masters_prefix)
            except EtcdError as exc:
                outage.failed(exc)  # the last count stays
            else:
                outage.recovered()
                self.admission.set_masters(len(kvs))
                if self.spill.max_peers:
                    self.spill.peers = peers_from_etcd({kv.key: kv.value for kv in kvs}, self.master_id)
            await asyncio.sleep(MASTERS_POLL_S)

    async def drain(self) -> None:
        """Stop taking new work, let in-flight requests finish, then give the shares back."""
        if not self.lifecycle.start_draining():
            return
        idle = await self.lifecycle.wait_idle(self.config.drain_timeout)
        if not idle:
            # Agents free a drained master's slots against the other masters' counts once its key
            # is gone, so its requests must have ended by then: cancelled, their engine connections
            # close and the engines drop them (they would be cut off at exit a moment later anyway).
            n = self.lifecycle.cancel_in_flight()
            log.warning("drain timeout: cancelling %d requests still in flight", n)
            idle = await self.lifecycle.wait_idle(CANCEL_WAIT_S)
        if self.registration is not None:
            if idle:
                # Nothing of this master runs any more: agents may free its slots at once, even
                # those that never had an Ack saying it drains (DESIGN §4).
                try:
                    await self.registration.update(json.dumps({**self._key_doc, "drained": True}))
                except EtcdError as exc:  # the agents then wait for their samples, as before
                    log.warning("could not mark the key drained: %s", exc)
            # Revoking deletes masters/<id> at once: agents re-slice without waiting for a TTL.
            self.lifecycle.lease_lost_while(lambda: False)
            await self.registration.stop(revoke=True)
            self.registration = None
            self.lifecycle.registered_while(lambda: False)

    async def close(self) -> None:
        for task in (
            self._count_task,
            self._forget_task,
            self._release_task,
            self._handoff_task,
            self._lost_drain_task,
        ):
            if task is not None:
                task.cancel()
        try:
            await self.drain()
        except Exception:  # etcd may be gone; the lease then expires by itself
            log.exception("drain failed")
        # Keep answering (503 "draining", Connection: close) a little longer, so clients and load
        # balancers that have not yet noticed the shutdown get an explicit answer, not a reset.
        await asyncio.sleep(self.config.shutdown_linger)
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=0.5)
        if self.http_runner is not None:
            await self.http_runner.cleanup()
        if self.admin_runner is not None:
            await self.admin_runner.cleanup()
        await self.etcd.close()
        self.pause_watch.stop()

    def request_stop(self) -> None:
        self._stop.set()

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            # etcd may be unreachable for long at start-up (start retries): a stop must still work.
            starting = asyncio.create_task(self.start())
            stopping = asyncio.create_task(self._stop.wait())
            try:
                await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
                if not starting.done():
                    starting.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await starting
            if not self._stop.is_set():
                starting.result()
                await self._stop.wait()
            log.info("master %s: stop requested, draining", self.master_id)
        finally:
            await self.close()
