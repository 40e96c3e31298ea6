"""Every Prometheus instrument of the master (one registry per master): the control plane
(``MasterMetrics``), the request path (``RequestMetrics``) and admission (``AdmissionMetrics``)."""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdmaster.registry import DECODE, NodeRegistry


class MasterMetrics:
    def __init__(self, registry: CollectorRegistry, master_id: str) -> None:
        self.registry = registry
        self.info = Gauge(
            "pdcoord_master_info",
            "Constant 1, labelled with this master's id",
            ["master_id"],
            registry=registry,
        )
        self.info.labels(master_id=master_id).set(1)
        self.capacity = Gauge(
            "pdcoord_decode_capacity_slots",
            "Sum of this master's decode shares over nodes with a live stream",
            registry=registry,
        )
        # Whoever holds them: under demand shares a master's own capacity follows its traffic, so a
        # drop in it says nothing about the fleet; this does (the capacity alert reads it).
        self.fleet_capacity = Gauge(
            "pdcoord_fleet_decode_capacity_slots",
            "Decode slots of the fleet as this master sees it: running_max_req_size summed over decode "
            "nodes with a live stream and an engine that answers, whichever master holds them",
            registry=registry,
        )
        self.node_share = Gauge(
            "pdcoord_node_share_slots", "This master's share on a node", ["node", "role"], registry=registry
        )
        self.node_epoch = Gauge(
            "pdcoord_node_epoch", "Capacity epoch held for a node", ["node"], registry=registry
        )
        self.node_connected = Gauge(
            "pdcoord_node_connected", "1 while the node's agent stream is up", ["node"], registry=registry
        )
        self.node_engine_up = Gauge(
            "pdcoord_node_engine_up",
            "1 while the node's engine counts as answering: its agent's liveness check passes and this "
            "master's circuit breaker for it is not open (0: no new leases there)",
            ["node", "role"],
            registry=registry,
        )
        self.breaker_open = Gauge(
            "pdcoord_engine_breaker_open",
            "1 while this master's circuit breaker for the node's engine is open or half-open",
            ["node"],
            registry=registry,
        )
        self.pauses = Counter(
            "pdcoord_master_pauses",
            "Times this process was found to have stood still for more than a second (stopped, a paused "
            "VM, starved of CPU); after each, new leases waited for the keep-alive's detection time",
            registry=registry,
        )
        self.engine_failures = Counter(
            "pdcoord_engine_failures",
            "Failed exchanges with a node's engine counted by the circuit breaker, by kind",
            ["node", "kind"],
            registry=registry,
        )
        self.streams = Gauge("pdcoord_node_streams", "Live agent streams", registry=registry)
        self.nodes_forgotten = Counter(
            "pdcoord_nodes_forgotten",
            "Nodes dropped from this master's table (their agent left or their etcd key is gone, and "
            "no lease of this master ran there any more), with their per-node series",
            registry=registry,
        )
        self.lease_held = Gauge(
            "pdcoord_master_lease_held",
            "1 while this master can prove its etcd lease alive (a renewal confirmed in time); 0 while "
            "registering or after a lease loss, when it admits nothing new",
            registry=registry,
        )
        self.lease_losses = Counter(
            "pdcoord_master_lease_losses",
            "Times this master stopped counting on its etcd lease (no renewal confirmed in time, or etcd "
            "said it was gone) and so stopped admitting until etcd confirmed it again",
            registry=registry,
        )
        self.stale_reports = Counter(
            "pdcoord_stale_reports",
            "Grants ignored because their epoch was lower than the one held",
            registry=registry,
        )
        self.protocol_rejections = Counter(
            "pdcoord_protocol_rejections",
            "Agent streams refused, by gRPC status",
            ["reason"],
            registry=registry,
        )
        self.agent_messages = Counter(
            "pdcoord_agent_messages",
            "Messages on the agent streams, by direction (received, sent) and kind",
            ["direction", "kind"],
            registry=registry,
        )
        # Bound once: a label lookup per message is measurable at a thousand nodes.
        self.received = {
            kind: self.agent_messages.labels(direction="received", kind=kind)
            for kind in ("register", "report", "leaving", "other")
        }
        self.acks_sent = self.agent_messages.labels(direction="sent", kind="ack")
        self._stale_seen = 0
        self._known: dict[str, str] = {}  # node id -> the role its series carry
        self._last: dict[str, tuple[int, int, bool, bool]] = {}
        self._failure_kinds: dict[str, set[str]] = {}  # node id -> kinds counted for it
        self._fleet: dict[str, int] = {}  # decode node id -> its slots counted in fleet_capacity
        self._fleet_total = 0

    def engine_failed(self, node_id: str, kind: str) -> None:
        self.engine_failures.labels(node=node_id, kind=kind).inc()
        self._failure_kinds.setdefault(node_id, set()).add(kind)

    def forget_node(self, node_id: str) -> None:
        """Remove every series labelled with the node (it was dropped from the table): a scrape no
        longer shows it, so alerts on it resolve instead of firing for a node that is no more."""
        role = self._known.pop(node_id, None)
        self._last.pop(node_id, None)
        self._count_in_fleet(node_id, 0)
        if role is not None:
            for gauge in (self.node_share, self.node_engine_up):
                _remove(gauge, node_id, role)
        for gauge in (self.node_epoch, self.node_connected, self.breaker_open):
            _remove(gauge, node_id)
        for kind in self._failure_kinds.pop(node_id, ()):
            _remove(self.engine_failures, node_id, kind)
        self.nodes_forgotten.inc()

    def observe_node(self, reg: NodeRegistry, node_id: str) -> None:
        """Mirror one node's entry and the totals: O(1) per agent message."""
        node = reg.nodes.get(node_id)
        self.capacity.set(reg.capacity)
        self.streams.set(reg.connected_streams)
        if reg.stale_total > self._stale_seen:
            self.stale_reports.inc(reg.stale_total - self._stale_seen)
            self._stale_seen = reg.stale_total
        if node is None:
            return  # forgotten: forget_node removed its series
        up = node.role == DECODE and node.connected and node.usable and not node.gone
        self._count_in_fleet(node_id, node.running_max_req_size if up else 0)
        known = self._known.get(node_id)
        if known != node.role:
            if known is not None:  # it came back under another role: its old series go
                for gauge in (self.node_share, self.node_engine_up):
                    _remove(gauge, node_id, known)
            self._known[node_id] = node.role
            self._last.pop(node_id, None)
        state = (node.effective_share, node.epoch, node.connected, node.usable)
        if self._last.get(node_id) == state:
            return  # a heartbeat: skip three label lookups per message
        self._last[node_id] = state
        self.node_share.labels(node=node.node_id, role=node.role).set(node.effective_share)
        self.node_epoch.labels(node=node.node_id).set(node.epoch)
        self.node_connected.labels(node=node.node_id).set(1 if node.connected else 0)
        self.node_engine_up.labels(node=node.node_id, role=node.role).set(1 if node.usable else 0)

    def _count_in_fleet(self, node_id: str, slots: int) -> None:
        old = self._fleet.get(node_id, 0)
        if slots == old:
            return
        if slots:
            self._fleet[node_id] = slots
        else:
            del self._fleet[node_id]
        self._fleet_total += slots - old
        self.fleet_capacity.set(self._fleet_total)


def _remove(metric: Any, *labels: str) -> None:
    """Remove one labelled series if it exists (prometheus_client before 0.21 raises KeyError for a
    series it does not have)."""
    with contextlib.suppress(KeyError):
        metric.remove(*labels)


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RequestMetrics:
    """Client requests: outcomes by endpoint and status, TTFT, duration, relayed events, classes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "pdcoord_requests", "Client requests by endpoint and HTTP status", ["endpoint", "status"],
            registry=registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "pdcoord_time_to_first_token_seconds", "Arrival to first streamed byte", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.duration = Histogram(
            "pdcoord_request_duration_seconds", "Arrival to end of response", ["endpoint"],
            buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.tokens = Counter(
            "pdcoord_tokens_streamed", "Stream events relayed to clients", ["endpoint"], registry=registry
        )
        self.classes = Counter(
            "pdcoord_requests_classified", "Requests by admission class", ["class"], registry=registry
        )
        self.spilled = Counter(
            "pdcoord_spilled_requests",
            "Requests offered to a peer master (--spill-peers), by its answer: taken, refused, unreachable",
            ["result"], registry=registry,
        )  # fmt: skip
        self._per_endpoint: dict[str, EndpointMetrics] = {}
        self._per_class: dict[str, Any] = {}

    def endpoint(self, endpoint: str) -> EndpointMetrics:
        """The children of one route, looked up once: labels() costs a lock and a dict per call."""
        em = self._per_endpoint.get(endpoint)
        if em is None:
            em = self._per_endpoint[endpoint] = EndpointMetrics(self, endpoint)
        return em

    def classified(self, name: str) -> None:
        child = self._per_class.get(name)
        if child is None:
            child = self._per_class[name] = self.classes.labels(**{"class": name})
        child.inc()

    def failed(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()


class EndpointMetrics:
    __slots__ = ("duration", "ok", "tokens", "ttft")

    def __init__(self, m: RequestMetrics, endpoint: str) -> None:
        self.ok = m.requests.labels(endpoint=endpoint, status="200")
        self.ttft = m.ttft.labels(endpoint=endpoint)
        self.duration = m.duration.labels(endpoint=endpoint)
        self.tokens = m.tokens.labels(endpoint=endpoint)


class AdmissionMetrics:
    """The admission queue's instruments: gauges of its state, outcomes and wait time per class."""

    WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0)

    def __init__(
        self, registry: CollectorRegistry, classes: tuple[str, ...], outcomes: tuple[str, ...]
    ) -> None:
        self.registry = registry
        self.queued = Gauge(
            "pdcoord_admission_queued_requests", "Requests waiting for decode slots", registry=registry
        )
        self.queued_slots = Gauge(
            "pdcoord_admission_queued_slots", "Decode slots wanted by waiters", registry=registry
        )
        self.active = Gauge(
            "pdcoord_admission_active_slots", "Decode slots held by leases", registry=registry
        )
        self.capacity = Gauge(
            "pdcoord_admission_capacity_slots", "This master's decode capacity", registry=registry
        )
        self.outcomes = Counter(
            "pdcoord_admission_outcomes_total",
            "Admission outcomes per request class",
            ["class", "outcome"],
            registry=registry,
        )
        self.wait = Histogram(
            "pdcoord_admission_wait_seconds",
            "Time from arrival to grant",
            ["class"],
            buckets=self.WAIT_BUCKETS,
            registry=registry,
        )
        # children resolved once: ``labels()`` is a locked dict lookup, too slow for every grant
        self.outcome = {(c, o): self.outcomes.labels(c, o) for c in classes for o in outcomes}
        self.wait_of = {c: self.wait.labels(c) for c in classes}
        self.gauges = (self.queued, self.queued_slots, self.active, self.capacity)
