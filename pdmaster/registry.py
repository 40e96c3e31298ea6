"""The master's node registry: the pure core behind the gRPC NodeCoordination service.

It applies the protocol rules of DESIGN §5 (what a stream may register, which grants are taken,
which are stale or contradictory) and derives this master's decode shares. No I/O: the gRPC
adapter feeds it messages and turns its verdicts into statuses.

A node whose stream is down stays in the table (its share counts as 0) until it is *gone*: its agent
said ``Leaving``, or its key in etcd is gone (the master's adapter looks). A gone node with no lease
of this master left on it is forgotten (:meth:`NodeRegistry.forgettable`, :meth:`NodeRegistry.forget`):
its entry, its breaker state and, in the adapters, its metric series go, so a fleet whose agents
come and go under new ids does not fill the table up to ``max_nodes``. If it comes back it registers
anew.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from pdcoord.load import EngineLoad

PREFILL = "prefill"
DECODE = "decode"
MAX_ENDPOINT_CHARS = 2048
MAX_AGENT_VERSION_CHARS = 128
MAX_REASON_CHARS = 512


class ProtocolError(Exception):
    """A message the master refuses; ``code`` names the gRPC status the adapter answers with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class GrantResult(Enum):
    APPLIED = "applied"
    UNCHANGED = "unchanged"  # same epoch and share: a heartbeat
    STALE = "stale"  # lower epoch than held: ignored and counted


@dataclass
class Node:
    node_id: str
    role: str
    endpoint: str
    running_max_req_size: int
    start_args: dict[str, str] = field(default_factory=dict)
    agent_version: str = ""
    incarnation: int = 0
    # Register.stream_id: names the stream in this master's etcd key once the stream is gone and
    # nothing of this master runs on the node (0: an earlier agent, never named).
    stream_id: int = 0
    # When the last message on its stream came in (monotonic; set by the coordination service): the
    # link to the node's host worked then.
    heard_at: float = 0.0
    # An agent that sends no grant (older agent) grants its full capacity (old single-master behaviour).
    legacy: bool = False
    share: int = 0
    epoch: int = 0
    # The decode engine's KV pool in tokens (Register.kv_tokens; None: it publishes none, and the node
    # is bounded by its slots alone) and this master's slice of it under ``epoch`` (Grant.token_share;
    # None: no token limit here, as from an agent of an earlier release).
    kv_tokens: int | None = None
    token_share: int | None = None
    # What this master lets itself charge of ``token_share``, from the engine's own word (DESIGN §13:
    # the reports close the loop where the charges were too small): 1.0, lowered when the engine
    # retracts or preempts, raised back while it does not (``TokenFeedback``).
    token_scale: float = 1.0
    connected: bool = False
    stream: int = 0  # token of the stream that owns this entry
    load: EngineLoad = field(default_factory=EngineLoad)
    stale_reports: int = 0
    # SGLang's KV bootstrap port (prefill), parsed once from start_args at registration.
    bootstrap_port: int | None = None
    # Engine health, from two signals (DESIGN §7 "Engine faults"): the agent's liveness check
    # (reported over the stream; an older agent never reports it, so it counts as healthy) and this
    # master's circuit breaker over its own dispatches to the engine.
    engine_down: bool = False
    engine_reason: str = ""
    # closed, open or half_open. Open: no share. Half-open: at most one slot, so admission places
    # at most one lease there, which is the breaker's one trial request.
    breaker_state: str = "closed"
    breaker_reason: str = ""
    # Gone: its agent said Leaving on this stream, or its etcd key was found gone while the stream
    # was down. Cleared by a new Register (a new entry).
    leaving: bool = False
    key_gone: bool = False

    @property
    def gone(self) -> bool:
        return self.leaving or self.key_gone

    @property
    def breaker_open(self) -> bool:
        return self.breaker_state == "open"

    @property
    def usable(self) -> bool:
        """The engine answers as far as this master knows: neither signal says it is down."""
        return not self.engine_down and self.breaker_state != "open"

    @property
    def effective_share(self) -> int:
        """What this master may use on the node now: nothing without a live stream or a usable engine."""
        if not self.connected or self.engine_down:
            return 0
        state = self.breaker_state
        if state == "closed":
            return self.share
        return min(self.share, 1) if state == "half_open" else 0

    @property
    def effective_token_share(self) -> int | None:
        """The KV tokens this master may charge on the node now: None without a pool (slots alone
        bound it), 0 whenever ``effective_share`` is 0."""
        if self.token_share is None:
            return None
        if not self.effective_share:
            return 0
        return int(self.token_share * self.token_scale)

    def as_json(self) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "role": self.role,
            "endpoint": self.endpoint,
            "running_max_req_size": self.running_max_req_size,
            "share": self.share,
            "effective_share": self.effective_share,
            "kv_tokens": self.kv_tokens,
            "capacity_unit": "slots" if self.kv_tokens is None else "slots+tokens",
            "token_share": self.token_share,
            "effective_token_share": self.effective_token_share,
            "token_scale": round(self.token_scale, 3),
            "epoch": self.epoch,
            "connected": self.connected,
            "legacy": self.legacy,
            "agent_version": self.agent_version,
            "start_args": dict(self.start_args),
            "stale_reports": self.stale_reports,
            "bootstrap_port": self.bootstrap_port,
            "load": self.load.as_json(),
            "engine_up": self.usable,
            "engine_down": self.engine_down,
            "engine_reason": self.engine_reason,
            "breaker_open": self.breaker_open,
            "breaker_state": self.breaker_state,
            "breaker_reason": self.breaker_reason,
            "leaving": self.leaving,
            "key_gone": self.key_gone,
        }


def _bootstrap_port(node_id: str, text: str | None) -> int | None:
    if not text:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ProtocolError(
            "INVALID_ARGUMENT",
            f"node {node_id}: Register.start_args bootstrap_port must be a port number, got {text[:32]!r}",
        )
    return int(text)


SharesListener = Callable[[Mapping[str, int]], None]
# node_id -> (decode share, the node's running_max_req_size) for the nodes whose share changed; a share
# of 0: the node holds none any more.
ShareChanges = Mapping[str, tuple[int, int]]
ShareChangesListener = Callable[[ShareChanges], None]
# (node_id, role) of a node that stopped holding a share over a live stream.
LeftListener = Callable[[str, str], None]


def split_changes(changes: ShareChanges) -> tuple[dict[str, int], dict[str, int]]:
    """``changes`` as the two maps ``AdmissionCore.update_shares`` takes: shares, full capacities."""
    return {n: share for n, (share, _) in changes.items()}, {n: full for n, (_, full) in changes.items()}


# The engine's word on the masters' token charges (DESIGN §13). A retraction or preemption means the
# engine ran out of KV under what the masters charged it (a charge too small: text prompts estimated
# from their length, answers longer than expected): charge less of the share there at once, then
# creep back while the engine stays quiet. Multiplicative decrease, additive increase, floored, so a
# one-off does not halve a node for long.
TOKEN_SCALE_DOWN = 0.85
TOKEN_SCALE_UP = 0.02
TOKEN_SCALE_MIN = 0.5


def token_feedback(scale: float, before: int | None, now: int) -> float:
    """The next token scale of a node whose engine's cumulative retraction count went from ``before``
    (None: first report) to ``now``. A count that went down is a restarted engine: no news."""
    if before is not None and now > before:
        return max(TOKEN_SCALE_MIN, scale * TOKEN_SCALE_DOWN)
    return min(1.0, scale + TOKEN_SCALE_UP)


def kept_slots(active: int, granted: int, mark: int | None) -> int:
    """An Ack's kept_slots as masters of the previous release counted it (the protocol model's
    earlier-release masters; this release counts exactly: ``AdmissionCore.kept_since``): of the
    ``active`` slots a master runs on a node, those it held at its previous Ack on the stream, when
    its count of slots granted there stood at ``mark`` (it is ``granted`` now). At least the ones not
    granted since; 0 without a previous Ack."""
    return 0 if mark is None else max(0, active - (granted - mark))


class NodeRegistry:
    """Nodes known to this master, keyed by node id, and the decode shares derived from them."""

    def __init__(
        self,
        *,
        max_node_capacity: int = 4096,
        max_kv_tokens: int = 1 << 40,
        max_nodes: int = 10_000,
        max_start_args: int = 64,
        max_start_arg_bytes: int = 1024,
        defer: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        """``defer(fn)``: run ``fn`` soon (e.g. ``loop.call_soon``); share listeners are then told
        once per batch of changes instead of once per message. None: at once (tests, pure use)."""
        self.max_node_capacity = max_node_capacity
        self.max_kv_tokens = max_kv_tokens
        self.max_nodes = max_nodes
        self.max_start_args = max_start_args
        self.max_start_arg_bytes = max_start_arg_bytes
        self.nodes: dict[str, Node] = {}
        self._next_stream = 0
        self._listeners: list[SharesListener] = []
        self._left_listeners: list[LeftListener] = []
        self._decode_shares: dict[str, int] = {}
        # Effective token shares of the decode nodes in _decode_shares that have a pool.
        self._decode_tokens: dict[str, int] = {}
        self._change_listeners: list[ShareChangesListener] = []
        self._changes: dict[str, tuple[int, int]] = {}
        self.stale_total = 0
        self._connected = 0
        self._capacity = 0
        # State of this master's circuit breaker per node id when not closed; kept across
        # re-registrations (it is about the engine, not the stream).
        self._breaker_states: dict[str, str] = {}
        self._defer = defer
        self._notify_pending = False
        # Live nodes (share over a live stream) by role, kept per change: O(1) per agent message.
        self._live_by_role: dict[str, dict[str, Node]] = {PREFILL: {}, DECODE: {}}
        self._live_role: dict[str, str] = {}
        self._live_sorted: dict[str, list[Node] | None] = {PREFILL: [], DECODE: []}
        # Nodes whose stream is down (still in the table): what the forgetting pass looks at.
        self._disconnected: set[str] = set()
        self.forgotten_total = 0

    # -- subscription -------------------------------------------------------------------------
    def subscribe(self, listener: SharesListener) -> None:
        """Call ``listener(decode_shares)`` now and whenever an effective decode share changes."""
        self._listeners.append(listener)
        listener(dict(self._decode_shares))

    def subscribe_changes(self, listener: ShareChangesListener) -> None:
        """Call ``listener(changes)`` now with every decode share, then with the nodes whose share
        changed since the previous call: O(changes) per batch, where ``subscribe`` copies all shares
        each time (a join moves every node's share, in many small batches)."""
        self._change_listeners.append(listener)
        nodes = self.nodes
        listener({n: (s, nodes[n].running_max_req_size) for n, s in self._decode_shares.items()})

    def on_node_left(self, listener: LeftListener) -> None:
        """Call ``listener(node_id, role)`` whenever a node leaves the live set (stream gone, share 0)."""
        self._left_listeners.append(listener)

    @property
    def connected_streams(self) -> int:
        return self._connected

    @property
    def capacity(self) -> int:
        return self._capacity

    def _publish(self, node_id: str) -> None:
        """One node's stream or share changed: update the live sets and decode shares in O(1)."""
        node = self.nodes.get(node_id)
        role = node.role if node is not None and node.effective_share > 0 else None
        was = self._live_role.get(node_id)
        if was is not None and (was != role or self._live_by_role[was].get(node_id) is not node):
            del self._live_by_role[was][node_id]
            del self._live_role[node_id]
            self._live_sorted[was] = None
        if role is not None and node is not None and node_id not in self._live_role:
            self._live_by_role[role][node_id] = node
            self._live_role[node_id] = role
            self._live_sorted[role] = None
        if was is not None and was != role:
            for left in self._left_listeners:
                left(node_id, was)
        share = node.effective_share if node is not None and role == DECODE else 0
        old = self._decode_shares.get(node_id, 0)
        tokens = node.effective_token_share if node is not None and share else None
        old_tokens = self._decode_tokens.get(node_id)
        if share == old and tokens == old_tokens:
            # Epoch-only or load-only changes never disturb admission. (A node's capacity changes only
            # with a new Register, after its old stream dropped the share to 0: a change already.)
            return
        if share:
            self._decode_shares[node_id] = share
        else:
            del self._decode_shares[node_id]
        if tokens is None:
            self._decode_tokens.pop(node_id, None)
        else:
            self._decode_tokens[node_id] = tokens
        self._capacity += share - old
        full = node.running_max_req_size if share and node is not None else 0
        self._changes[node_id] = (share, full)
        if self._defer is None:
            self._notify()
        elif not self._notify_pending:
            self._notify_pending = True
            self._defer(self._notify)

    def flush(self) -> None:
        """Tell the share listeners now if a change is still waiting for its tick. Called before an
        Ack: an Ack says this master applied the grant, and strict handover hands the slots it gave
        up to another master on that word, so admission must already hold the smaller share."""
        if self._notify_pending:
            self._notify()

    def _notify(self) -> None:
        self._notify_pending = False
        changes, self._changes = self._changes, {}
        for on_changes in self._change_listeners:
            on_changes(changes)
        if self._listeners:
            shares = dict(self._decode_shares)
            for listener in self._listeners:
                listener(shares)

    # -- protocol -----------------------------------------------------------------------------
    def register(
        self,
        *,
        node_id: str,
        role: str,
        endpoint: str,
        running_max_req_size: int,
        start_args: Mapping[str, str] | None = None,
        agent_version: str = "",
        incarnation: int = 0,
        stream_id: int = 0,
        grant: tuple[int, int] | None = None,
        engine_down: bool = False,
        engine_reason: str = "",
        kv_tokens: int | None = None,
        token_share: int | None = None,
    ) -> tuple[Node, int]:
        """``kv_tokens``: the engine's KV pool (None or 0: none published, slots alone);
        ``token_share``: the grant's share of it (None: no token limit)."""
        """Admit a new stream's Register; returns the node and the stream token."""
        if not node_id or len(node_id) > 253:
            raise ProtocolError("INVALID_ARGUMENT", "Register.node_id must be 1-253 characters")
        if not node_id.isprintable() or any(c.isspace() for c in node_id):
            raise ProtocolError(
                "INVALID_ARGUMENT", f"Register.node_id {node_id!r} must be printable, without whitespace"
            )
        if role not in (PREFILL, DECODE):
            raise ProtocolError(
                "INVALID_ARGUMENT", f"node {node_id}: Register.role must be PREFILL or DECODE"
            )
        if len(endpoint) > MAX_ENDPOINT_CHARS:
            raise ProtocolError(
                "INVALID_ARGUMENT",
                f"node {node_id}: Register.endpoint is {len(endpoint)} characters, "
                f"at most {MAX_ENDPOINT_CHARS} allowed",
            )
        if not endpoint.startswith(("http://", "https://")):
            raise ProtocolError(
                "INVALID_ARGUMENT",
                f"node {node_id}: Register.endpoint must be an http(s) URL, got {endpoint!r}",
            )
        if running_max_req_size <= 0:
            raise ProtocolError(
                "INVALID_ARGUMENT", f"node {node_id}: Register.running_max_req_size must be positive"
            )
        if running_max_req_size > self.max_node_capacity:
            raise ProtocolError(
                "OUT_OF_RANGE",
                f"node {node_id}: running_max_req_size {running_max_req_size} exceeds this master's "
                f"--max-node-capacity {self.max_node_capacity}",
            )
        if len(agent_version) > MAX_AGENT_VERSION_CHARS:
            raise ProtocolError(
                "INVALID_ARGUMENT",
                f"node {node_id}: Register.agent_version longer than {MAX_AGENT_VERSION_CHARS} characters",
            )
        self._check_start_args(node_id, start_args or {})
        if kv_tokens is not None and not 0 <= kv_tokens <= self.max_kv_tokens:
            raise ProtocolError(
                "OUT_OF_RANGE",
                f"node {node_id}: Register.kv_tokens {kv_tokens} outside 0..{self.max_kv_tokens}",
            )
        bootstrap_port = _bootstrap_port(node_id, (start_args or {}).get("bootstrap_port"))
        old = self.nodes.get(node_id)
        if old is not None and old.connected:
            raise ProtocolError(
                "ALREADY_EXISTS", f"node_id {node_id!r} is already held by another live stream on this master"
            )
        if old is None and len(self.nodes) >= self.max_nodes:
            raise ProtocolError("RESOURCE_EXHAUSTED", f"this master already tracks {self.max_nodes} nodes")
        self._next_stream += 1
        node = Node(
            node_id=node_id,
            role=role,
            endpoint=endpoint.rstrip("/"),
            running_max_req_size=running_max_req_size,
            start_args=dict(start_args or {}),
            agent_version=agent_version,
            incarnation=incarnation,
            stream_id=stream_id,
            connected=True,
            stream=self._next_stream,
            bootstrap_port=bootstrap_port,
            engine_down=engine_down,
            engine_reason=engine_reason[:MAX_REASON_CHARS],
            breaker_state=self._breaker_states.get(node_id, "closed"),
            kv_tokens=kv_tokens or None,
        )
        if old is not None and old.kv_tokens == node.kv_tokens:
            node.token_scale = old.token_scale  # about the engine, not the stream
        if grant is None:
            node.legacy = True
            node.share = running_max_req_size
            node.token_share = node.kv_tokens  # as its slots: the whole node
        else:
            share, epoch = grant
            self._check_share(node, share, token_share)
            node.share, node.epoch = share, epoch
            node.token_share = token_share if node.kv_tokens is not None else None
            # A reconnect must not move the epoch backwards: keep what we held if it was higher.
            if old is not None and old.epoch > epoch:
                node.share, node.epoch = 0, old.epoch
                node.token_share = 0 if node.token_share is not None else None
                node.stale_reports = old.stale_reports + 1
                self.stale_total += 1
        if old is not None:
            node.stale_reports = max(node.stale_reports, old.stale_reports)
        self.nodes[node_id] = node
        self._connected += 1
        self._disconnected.discard(node_id)
        self._publish(node_id)
        return node, node.stream

    def _check_start_args(self, node_id: str, start_args: Mapping[str, str]) -> None:
        if len(start_args) > self.max_start_args:
            raise ProtocolError(
                "INVALID_ARGUMENT",
                f"node {node_id}: Register.start_args has {len(start_args)} entries, "
                f"this master accepts at most {self.max_start_args} (--max-start-args)",
            )
        limit = self.max_start_arg_bytes
        for key, value in start_args.items():
            if not key or len(key.encode()) > limit or len(value.encode()) > limit:
                raise ProtocolError(
                    "INVALID_ARGUMENT",
                    f"node {node_id}: Register.start_args entry {key[:64]!r} has an empty key or a key or "
                    f"value longer than {limit} bytes (--max-start-arg-bytes)",
                )

    def _check_share(self, node: Node, share: int, token_share: int | None = None) -> None:
        if share < 0 or share > node.running_max_req_size:
            raise ProtocolError(
                "INVALID_ARGUMENT",
                f"node {node.node_id}: grant share {share} outside 0..{node.running_max_req_size}",
            )
        if token_share is not None and node.kv_tokens is not None and not 0 <= token_share <= node.kv_tokens:
            raise ProtocolError(
                "INVALID_ARGUMENT",
                f"node {node.node_id}: grant token_share {token_share} outside 0..{node.kv_tokens}",
            )

    def apply_grant(
        self, node_id: str, stream: int, share: int, epoch: int, token_share: int | None = None
    ) -> GrantResult:
        """``token_share``: the grant's slice of the node's KV pool (None: no token limit; ignored on a
        node that registered no pool)."""
        node = self._owned(node_id, stream)
        self._check_share(node, share, token_share)
        if node.kv_tokens is None:
            token_share = None
        if epoch < node.epoch:
            node.stale_reports += 1
            self.stale_total += 1
            return GrantResult.STALE
        if epoch == node.epoch:
            if share != node.share or (not node.legacy and token_share != node.token_share):
                raise ProtocolError(
                    "FAILED_PRECONDITION",
                    f"node {node_id}: epoch {epoch} already granted share {node.share} "
                    f"(tokens {node.token_share}), now {share} (tokens {token_share})",
                )
            return GrantResult.UNCHANGED
        if node.legacy:
            node.legacy = False
        node.share, node.epoch, node.token_share = share, epoch, token_share
        self._publish(node_id)
        return GrantResult.APPLIED

    def set_token_scale(self, node_id: str, scale: float) -> bool:
        """Charge at most ``scale`` (0 < scale <= 1) of the node's token share (the engine's feedback,
        ``TokenFeedback``); True when the effective token share changed."""
        node = self.nodes.get(node_id)
        if node is None or node.token_scale == scale:
            return False
        before = node.effective_token_share
        node.token_scale = scale
        if node.effective_token_share == before:
            return False
        self._publish(node_id)
        return True

    def report_load(self, node_id: str, stream: int, load: EngineLoad) -> None:
        node = self._owned(node_id, stream)
        if not math.isfinite(load.kv_usage) or load.kv_usage < 0:
            raise ProtocolError(
                "INVALID_ARGUMENT", f"node {node_id}: Report.load.kv_usage must be a finite number >= 0"
            )
        before, node.load = node.load, load
        if node.token_share is not None and load.retractions is not None:
            scale = token_feedback(node.token_scale, before.retractions, load.retractions)
            self.set_token_scale(node_id, scale)

    def report_engine(self, node_id: str, stream: int, down: bool, reason: str = "") -> bool:
        """The agent's liveness verdict on its engine; True when it flipped (capacity then changes)."""
        node = self._owned(node_id, stream)
        node.engine_reason = reason[:MAX_REASON_CHARS]
        if node.engine_down == down:
            return False
        node.engine_down = down
        self._publish(node_id)
        return True

    def set_breaker(self, node_id: str, state: str, reason: str = "") -> bool:
        """This master's circuit breaker for the node's engine moved to ``state`` (closed, open,
        half_open); ``reason`` is shown in the node's JSON. True when the state changed."""
        if state not in ("closed", "open", "half_open"):
            raise ValueError(f"unknown breaker state {state!r}")
        before = self._breaker_states.get(node_id, "closed")
        if state == "closed":
            self._breaker_states.pop(node_id, None)
        else:
            self._breaker_states[node_id] = state
        node = self.nodes.get(node_id)
        if node is not None:
            node.breaker_reason = reason[:MAX_REASON_CHARS]
            node.breaker_state = state
            if state != before:
                self._publish(node_id)
        return state != before

    def disconnect(self, node_id: str, stream: int) -> None:
        """The stream ended: the node's share counts as 0 at once, until it re-registers."""
        node = self.nodes.get(node_id)
        if node is None or node.stream != stream:
            return
        node.connected = False
        self._connected -= 1
        self._disconnected.add(node_id)
        self._publish(node_id)

    # -- forgetting ---------------------------------------------------------------------------
    def mark_leaving(self, node_id: str, stream: int) -> None:
        """The agent said Leaving on this stream (it ends right after)."""
        node = self.nodes.get(node_id)
        if node is not None and node.stream == stream:
            node.leaving = True

    def mark_key_gone(self, node_id: str) -> bool:
        """Its etcd key was found gone while its stream is down; True when that is news."""
        node = self.nodes.get(node_id)
        if node is None or node.connected or node.key_gone:
            return False
        node.key_gone = True
        return True

    def disconnected(self) -> list[str]:
        """Ids of the nodes whose stream is down, in no particular order."""
        return list(self._disconnected)

    def forgettable(self, node_id: str, active_slots: int) -> bool:
        """The node may be forgotten: its stream is down, it is gone (Leaving, or its key), and this
        master runs nothing there (``active_slots``: its leases on the node)."""
        node = self.nodes.get(node_id)
        return node is not None and not node.connected and node.gone and active_slots == 0

    def forget(self, node_id: str) -> Node | None:
        """Drop a node whose stream is down from the table (and its breaker state); it registers
        anew if it comes back. Returns the entry, None when there was none or its stream is up."""
        node = self.nodes.get(node_id)
        if node is None or node.connected:
            return None
        del self.nodes[node_id]
        self._disconnected.discard(node_id)
        self._breaker_states.pop(node_id, None)
        self._publish(node_id)  # nothing left to withdraw (a stream down holds no share), kept exact
        self.forgotten_total += 1
        return node

    def _owned(self, node_id: str, stream: int) -> Node:
        node = self.nodes.get(node_id)
        if node is None or node.stream != stream or not node.connected:
            raise ProtocolError("FAILED_PRECONDITION", f"stream does not own node {node_id!r}")
        return node

    # -- views --------------------------------------------------------------------------------
    def live(self, role: str) -> list[Node]:
        """Nodes of ``role`` holding a share over a live stream with a usable engine, sorted by id
        (cached, do not mutate)."""
        if role not in self._live_by_role:
            return []
        cached = self._live_sorted[role]
        if cached is None:
            cached = sorted(self._live_by_role[role].values(), key=lambda n: n.node_id)
            self._live_sorted[role] = cached
        return cached

    def token_changes(self, changes: ShareChanges) -> tuple[dict[str, int], dict[str, int]]:
        """The token side of ``changes`` as the ``token_shares`` and ``token_full`` maps
        ``AdmissionCore.update_shares`` takes: every changed node that has a pool, with this master's
        effective token share there and the pool. A changed node without one is in neither map, which
        the core reads as "no token limit there"."""
        shares: dict[str, int] = {}
        full: dict[str, int] = {}
        for n in changes:
            tokens = self._decode_tokens.get(n)
            node = self.nodes.get(n)
            if tokens is not None and node is not None and node.kv_tokens is not None:
                shares[n], full[n] = tokens, node.kv_tokens
        return shares, full

    def decode_shares(self) -> dict[str, tuple[int, int]]:
        """Every decode share held now, as ``ShareChanges``: node -> (share, running_max_req_size)."""
        nodes = self.nodes
        return {n: (s, nodes[n].running_max_req_size) for n, s in self._decode_shares.items()}

    def snapshot(self) -> list[dict[str, object]]:
        return [n.as_json() for n in sorted(self.nodes.values(), key=lambda n: n.node_id)]
