"""A virtual-time model of the share protocol, built from the real cores.

Agents run :class:`nodeagent.slicing.Slicer`; masters run :class:`pdmaster.registry.NodeRegistry`
and :class:`pdmaster.admission.AdmissionCore`. Only the world around them is simulated: every
(agent, master) stream is a pair of FIFO channels with random delays; streams reset (cleanly, or as
a partition that each side notices only when its keep-alive fires); masters join, drain and leave,
crash and restart; agents crash and restart; the engine's running count is what the masters' leases
really use on it. After every event the model checks, for every node,

    Σ over live masters of max(share the master may use now, leases it runs or will run there)  ≤  capacity

which is the strict-handover promise (DESIGN §4). The same harness drives the demand-policy
benchmark, with Poisson arrivals per master and leases held for a random time.

Tokens (DESIGN §13, ``kv_tokens``: a KV pool per node). Every request then charges a random number
of tokens (``lease_tokens``), and the master's admission core places it only where its token share,
less what its leases there charge, covers it (``CORE_TOKENS``; with an earlier core the model
refuses a lease the core placed where its tokens do not fit). Masters report active, wanted and
kept tokens in their Acks, and the check runs for tokens beside slots:

    Σ over live masters of the tokens their unfinished leases charge  ≤  pool
    Σ over live masters of max(token share it may use now, those tokens)  ≤  pool

A lease ends twice. Its decode ends in the engine, which stops counting it; the master learns that
when the engine's last bytes reach it, a one-way delay later, and releases it then. A lease whose
client is slow (``slow_fraction``) is released only once that client has caught up, ``relay`` seconds
after its decode ended: masters of this release (``lease_end="seen"``) stopped reading its answer
before that (``AdmissionCore.end_unseen``) and no longer count it as surely running; masters of
earlier releases (``"relay"``) count it as running until they release it.

A lease starts twice too (``prefill_mean_s`` > 0; at 0 the engine counts it from its grant). It
first goes through its prefill, and the decode engine holds its request before running it: under
SGLang's protocol (``protocol="sglang"``) the master sends the decode request at grant, and the
engine keeps it waiting for its KV (prealloc and transfer queues, outside the running count) until
the prefill is over; under vLLM's (``"vllm"``) the master sends it once the prefill is over, and the
engine keeps it waiting for the remote KV a moment more. Its decode then runs ``hold`` seconds from
when it starts, as long as it would without a prefill. What an engine sample counts
(``sample_counts``: the running requests, or every request the engine holds), how long after the
Acks that open its bracket it is taken (``start_seen_s``), from when masters count a lease in
kept_slots (``kept_from``: its grant, or its decode request) and what a master does with the
leases still in their prefill on a node it lost (``unsent_on_loss``) are options, so that the runs
show which of them the bound needs. So is which masters the agent polls during a handover
(``polling``): a Report answered between a bracket's opening Ack and its sample voids the bracket
for that master, so an agent that polls every master at 10 Hz rarely completes one once it waits
``start_seen_s``.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nodeagent.handover as _handover
from nodeagent.handover import END_SEEN_S
from nodeagent.slicing import BRACKET_ACK_WAIT_S, PEER_DETECT_S, SharePolicy, Slicer
from pdmaster.admission import AdmissionCore, AdmissionPolicy, RequestClass, Ticket, TicketState
from pdmaster.registry import DECODE, NodeRegistry, ProtocolError, ShareChanges, kept_slots, split_changes

# How long after the Ack that opens a bracket the agent's core accepts a sample as bracketed (0 for
# cores older than nodeagent.handover.START_SEEN_S, which accept any sample taken after that Ack).
CORE_START_SEEN_S: float = getattr(_handover, "START_SEEN_S", 0.0)
# Whether the master's admission core places leases by KV tokens too (AdmissionCore.submit(tokens=),
# update_shares(token_shares=)). Without it (earlier cores) the model places a lease on the node the
# core chose only if it fits the master's token share there, and refuses it otherwise.
CORE_TOKENS: bool = hasattr(AdmissionCore, "active_tokens_on")


@dataclass
class SimConfig:
    nodes: dict[str, int] = field(default_factory=lambda: {"d1": 8, "d2": 5})
    masters: tuple[str, ...] = ("m1", "m2", "m3")
    handover: str = "strict"
    policy: str = "static"
    floor: int = 1
    chaos_s: float = 30.0  # faults happen during this phase
    settle_s: float = 15.0  # then no faults, so every master must reach its target
    # The last seconds of the stable phase take no new requests: demand settles (to the leases
    # left, then 0), so demand-following targets stop moving and convergence can be judged.
    quiet_s: float = 5.0
    fault_every_s: float = 1.5  # mean time between faults in the chaos phase
    rates: dict[str, float] | None = None  # arrivals/s per master (default: 40 each)
    hold_mean_s: float = 0.3  # lease duration, exponential
    gang_fraction: float = 0.05  # requests that need 2 slots
    delay_s: tuple[float, float] = (0.0005, 0.02)  # one-way message delay, uniform
    grace_s: float = 1.0
    report_s: float = 1.0
    poll_s: float = 0.1  # report interval while a handover is pending
    # Which masters the agent asks every poll_s while a handover is pending: "all" of them (the
    # model's agent so far), or only those whose Ack can move it on, as NodeAgent._worth_polling
    # (the others hear from it every report_s, and in the Reports around bracketed samples).
    polling: str = "all"
    probe_s: float = 0.5
    # A partition is noticed by the master within this (its keep-alive) and by the agent within
    # agent_detect_s; the master's must stay within peer_detect_s for strict handover to hold.
    master_detect_s: float = 1.65
    # How long the agents allow a master to notice (Slicer.peer_detect_s): strict handover releases
    # a departed master's slots only on engine samples taken after that; it must cover master_detect_s.
    peer_detect_s: float = PEER_DETECT_S
    agent_detect_s: float = 2.0
    lease_ttl_s: float = 5.0
    watch_delay_s: tuple[float, float] = (0.001, 0.05)
    drain_timeout_s: float = 10.0
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    # Masters send Ack.kept_slots (this release); False: as masters of earlier releases.
    kept_acks: bool = True
    # How masters end a lease (see the module docstring): "seen", as this release (a slow client's
    # lease is marked end_unseen when its relay pauses, and kept_slots counts from sure_on), or
    # "relay", as earlier releases (held and counted as running until its last bytes are relayed).
    lease_end: str = "seen"
    # Leases whose client falls so far behind that the relay pauses (more than 256 KiB queued), and
    # the mean time (exponential) from the end of their decode until that client has it all.
    slow_fraction: float = 0.0
    relay_mean_s: float = 2.0
    # How long after an engine sample came back the agent sends the Reports whose Acks close its
    # bracket, and the least it accepts (nodeagent.handover.END_SEEN_S; NodeAgent._probe_loop).
    end_seen_s: float = END_SEEN_S
    # A lease's prefill, exponential (0: none, the engine counts the lease from its grant), and the PD
    # protocol, which decides when the decode engine gets its request: "sglang" (at grant, then
    # waiting for its KV until the prefill is over) or "vllm" (once the prefill is over). The decode
    # runs hold_mean_s from when it starts: a prefill does not shorten it (counted from the grant, a
    # long prefill would end the decode before it began).
    prefill_mean_s: float = 0.0
    protocol: str = "sglang"
    # What an engine sample counts: "running" (earlier agents) or "held", running and waiting: every
    # request that reached the decode engine.
    sample_counts: str = "running"
    # How long after the Acks that open a bracket came in (or the wait for them ran out) the agent
    # takes its sample, and the least it accepts (nodeagent.handover.START_SEEN_S; 0: at once).
    start_seen_s: float = 0.0
    # From when a master counts a lease in Ack.kept_slots: "grant" (masters of earlier releases: held
    # now less the slots granted since the previous Ack), or "sent" (this release: the leases in decode
    # at both Acks, from when their decode request went out, AdmissionCore.decode_sent/kept_since;
    # under vLLM's protocol after the prefill, under SGLang's at grant).
    kept_from: str = "grant"
    # What a master does with the leases still in their prefill on a node whose stream it lost:
    # "send" their decode requests there all the same (earlier releases), or "cancel" them (this
    # release refuses to send them, at send time: pdmaster.pipeline._still_held; the model drops
    # them when the loss is noticed, which frees the master's slot earlier, the engine's the same).
    unsent_on_loss: str = "send"
    # Masters of this release end a drain that timed out by cancelling what still runs, and mark their
    # key drained just before they revoke it (agents free their slots at once); False: as masters of
    # earlier releases, which revoke with requests still running and say nothing in the key.
    drained_keys: bool = True
    # Masters of this release name a node whose stream they lost in their key ("released") once they
    # hold no share there, with the slots their leases there still run (pdmaster.server._release_loop,
    # every 0.1 s); the agent frees the rest at once (Slicer.master_released). False: as masters of
    # earlier releases.
    released_keys: bool = False
    # Faults that also include "reject": a link whose packets are answered with resets for a few
    # seconds (a firewall that rejects rather than drops), so that the master's address refuses the
    # agent's connections while the master lives and goes on placing work until it notices.
    reject_faults: bool = False
    # The agent takes a refused connection for a dead master (nodeagent --gone-on-refusal, the
    # default); False: --no-gone-on-refusal, a refusal proves nothing and the grace applies.
    gone_on_refusal: bool = True
    # Masters started at the beginning (default: all of ``masters``); the others start by churn.
    start_masters: tuple[str, ...] | None = None
    # Scheduled churn after the warm-up: (time, "join" | "drain" | "die", master), time in seconds
    # from the start of the run. A master's traffic moves to the masters that take requests then
    # (``rates`` are weights: the total offered load stays the same), as a load balancer would.
    churn: tuple[tuple[float, str, str], ...] = ()
    restart_left: bool = True  # a master that left (drained) starts again, as in the chaos phase
    # A KV pool per node, in tokens (nodes not named have none: slots alone, as before), and what a
    # lease charges there, uniform (drawn from a generator of its own, so that a seed offers the
    # same slot traffic with or without pools).
    kv_tokens: dict[str, int] = field(default_factory=dict)
    lease_tokens: tuple[int, int] = (100, 1000)
    # Check the invariant after arrivals and lease ends too. They cannot raise it (a lease is
    # granted only within the master's share, a lease end lowers it), so a benchmark of a large
    # fleet may check after protocol events only; the tests check after every event.
    check_traffic_events: bool = True


@dataclass
class Stream:
    sid: int
    node: str
    master: str
    agent_inc: int
    master_inc: int
    agent_open: bool = True
    master_open: bool = True
    cut: bool = False  # the connection broke: nothing in flight arrives any more
    token: int | None = None  # registry stream token, once the master admitted the Register
    a2m_last: float = 0.0  # FIFO: a message is delivered no earlier than the previous one
    m2a_last: float = 0.0
    # The mark of the master's previous Ack here: its slots-granted count (kept_from="grant"), or
    # what AdmissionCore.kept_since returned ("sent").
    kept_mark: int | None = None
    # The leases (ticket ids) the master held here at its previous Ack: those still held count in
    # the next Ack's kept_tokens.
    token_mark: frozenset[int] = frozenset()


@dataclass
class Link:
    master: str
    stream: Stream | None = None
    up: bool = False
    next_report: float = 0.0
    backoff: float = 0.1
    report_seq: int = -1  # the last Report sent, and when (NodeAgent's MasterLink)
    report_sent_at: float = -math.inf
    answered_seq: int = -1
    sent_epoch: int = 0  # the epoch of the grant in the last message sent
    acked: tuple[int, int] | None = None  # the last Ack on this stream: (applied epoch, active slots)


@dataclass
class SimAgent:
    node: str
    capacity: int
    inc: int = 0
    alive: bool = True
    slicer: Slicer | None = None
    links: dict[str, Link] = field(default_factory=dict)
    etcd_view: set[str] = field(default_factory=set)
    seq: int = 0
    watch_last: float = 0.0  # etcd watch events arrive in order
    bracket_next: bool = False  # the next engine sample gets Acks around it (NodeAgent._probe_loop)
    polled: list[Link] | None = None  # the links asked before a bracketed sample, until it is taken
    closing: bool = False  # waiting end_seen_s to close a sample's bracket: no new sample until then
    starting: bool = False  # waiting start_seen_s after the opening Acks: no new sample until then
    # "released" in each master's key for this node, as read: (stream id, slots running)
    released_seen: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class SimMaster:
    mid: str
    inc: int = 0
    alive: bool = False
    draining: bool = False
    in_etcd: bool = False
    key_expires: float | None = None
    registry: NodeRegistry = field(default_factory=NodeRegistry)
    core: AdmissionCore | None = None
    streams: dict[str, Stream] = field(default_factory=dict)  # node -> the stream it holds
    leases: dict[int, Ticket] = field(default_factory=dict)
    # Its leases whose decode the engine has not finished (ticket ids, from grant to the decode's
    # end), and where each is: "prefill" (the engine has not got its request yet), "waiting" (the
    # engine holds it, waiting for its KV) or "running". Slots per node: of all of them (what the
    # engine will have to hold), of those the engine runs and of those it holds waiting. None of
    # these is what the master holds, which also covers the moments after a decode ended.
    decoding: dict[int, str] = field(default_factory=dict)
    unfinished_on: dict[str, int] = field(default_factory=dict)
    decoding_on: dict[str, int] = field(default_factory=dict)
    waiting_on: dict[str, int] = field(default_factory=dict)
    released: dict[str, tuple[int, int]] = field(default_factory=dict)  # node -> (stream id, running)
    # Tokens (nodes with a pool): what each lease charges, what the master's leases charge per node
    # from grant to release (its Acks' active_tokens), and from grant to the end of their decode in
    # the engine (what the engine will have to hold, as unfinished_on for slots).
    lease_tokens: dict[int, int] = field(default_factory=dict)
    tokens_held: dict[str, int] = field(default_factory=dict)
    tokens_unfinished: dict[str, int] = field(default_factory=dict)

    def engine_reset(self) -> None:
        """The process is gone, or starts afresh: the engines dropped its requests."""
        self.decoding, self.unfinished_on, self.decoding_on, self.waiting_on = {}, {}, {}, {}
        self.lease_tokens, self.tokens_held, self.tokens_unfinished = {}, {}, {}


@dataclass
class Stats:
    violations: list[tuple[float, str, int]] = field(default_factory=list)
    max_usable: dict[str, int] = field(default_factory=dict)
    # Tokens: (t, node, what was above the pool, "running" | "usable"), the highest usable sum per
    # node, and the leases a master refused for want of tokens (its share less its charges).
    token_violations: list[tuple[float, str, int, str]] = field(default_factory=list)
    max_token_usable: dict[str, int] = field(default_factory=dict)
    max_token_running: dict[str, int] = field(default_factory=dict)  # most tokens the engine held
    token_refused: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    granted: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    waits: dict[str, list[float]] = field(default_factory=dict)
    busy_slot_s: float = 0.0  # Σ over time of slots the engines run, for utilisation
    slow_leases: int = 0  # leases granted to a slow client (slow_fraction)
    cancelled_unsent: int = 0  # leases in their prefill whose master lost the node (unsent_on_loss)
    released: int = 0  # "released" words an agent took (released_keys)
    measured_s: float = 0.0
    events: int = 0
    # Per churn event: (time, kind, master, seconds until every node converged; None: not within
    # 30 s or not before the run ended).
    convergence: list[tuple[float, str, str, float | None]] = field(default_factory=list)
    left: dict[str, float] = field(default_factory=dict)  # when a master revoked its etcd key


class ProtocolSim:
    def __init__(self, cfg: SimConfig, seed: int) -> None:
        if cfg.lease_end not in ("seen", "relay"):
            raise ValueError(f"lease_end {cfg.lease_end!r}: 'seen' or 'relay'")
        for name, allowed in (
            ("protocol", ("sglang", "vllm")),
            ("sample_counts", ("running", "held")),
            ("kept_from", ("grant", "sent")),
            ("polling", ("all", "worth")),
            ("unsent_on_loss", ("send", "cancel")),
        ):
            if getattr(cfg, name) not in allowed:
                raise ValueError(f"{name} {getattr(cfg, name)!r}: one of {allowed}")
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.trng = random.Random(seed * 7919 + 17)  # token charges: the slot traffic stays the same
        # (master, incarnation, ticket id) -> the request's token charge, until granted or refused
        self._charges: dict[tuple[str, int, int], int] = {}
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._sid = itertools.count(1)
        self.stats = Stats()
        self.stored_epoch: dict[str, int] = {}
        self.agents = {n: SimAgent(n, c) for n, c in cfg.nodes.items()}
        self.masters = {m: SimMaster(m) for m in cfg.masters}
        self.etcd: set[str] = set()
        self.drained: set[str] = set()  # masters whose key said "drained" as it went (drained_keys)
        self.rejecting: dict[tuple[str, str], float] = {}  # (node, master) -> resets until then
        self.measure_from = float("inf")  # set when the stable phase starts
        self._last_t = 0.0
        self.faults_on = True
        self.arrivals_on = True
        self._skip_check = False
        started = cfg.masters if cfg.start_masters is None else cfg.start_masters
        self.routable: set[str] = set(started)  # masters the load balancer sends requests to
        # The core accepts a bracket whose opening Ack came in CORE_START_SEEN_S before the sample
        # (at least; strictly before in cores older than that constant). An agent that accepts
        # start_seen_s instead is the same comparison with the Ack's time shifted by the difference:
        # a nanosecond less, so that rounding accepts the sample taken start_seen_s after it; at 0,
        # a nanosecond more, as the earlier agents that read their Acks before taking the sample.
        if cfg.start_seen_s > 0:
            self._ack_shift = cfg.start_seen_s - 1e-9 - CORE_START_SEEN_S
        else:
            self._ack_shift = 1e-9 - CORE_START_SEEN_S if CORE_START_SEEN_S > 0 else 0.0

    # -- event loop ---------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._q, (t, next(self._seq), fn))

    def after(self, d: float, fn: Callable[[], None]) -> None:
        self.at(self.now + d, fn)

    def delay(self) -> float:
        lo, hi = self.cfg.delay_s
        return self.rng.uniform(lo, hi)

    def time_ns(self) -> int:
        return 1_700_000_000_000_000_000 + int(self.now * 1e9)

    def run_until(self, t_end: float) -> None:
        while self._q and self._q[0][0] <= t_end:
            t, _, fn = heapq.heappop(self._q)
            self._account(t)
            self.now = t
            self._skip_check = False
            fn()
            self.stats.events += 1
            if not self._skip_check:
                self.check()
        self._account(t_end)
        self.now = t_end

    def _account(self, t: float) -> None:
        if t > self._last_t:
            if self._last_t >= self.measure_from:
                # What the engines run: a lease the master still holds after its decode ended (until
                # the end reaches it, or a slow client caught up) is no work done.
                running = sum(sum(m.decoding_on.values()) for m in self.masters.values() if m.alive)
                self.stats.busy_slot_s += running * (t - self._last_t)
                self.stats.measured_s += t - self._last_t
            self._last_t = t

    # -- the invariant ------------------------------------------------------------------------
    def usable(self, node: str) -> int:
        """Σ over live masters of max(share, its leases the engine has not finished): most the
        engine may have to run at once from now on. A lease counts from its grant to the end of its
        decode in the engine, whether its request reached the engine yet or not: one in its prefill
        is on its way and will need a slot there, so a release that leaves no room for it is the
        overshoot, even before the engine has it (counting only what the engine holds would see it
        only later, if at all). A master counts its leases from grant to release, which covers that
        span, so it grants at most share - held ≤ share - unfinished more: its engine load stays
        within max(share, unfinished). The leases it still holds after their decode ended (the end
        on its way, a slow client catching up) use no engine slot, and a sample that frees them for
        another master does not oversubscribe the engine: counting them here would flag exactly the
        release strict handover is meant to make. Without a prefill it is what the engine runs."""
        total = 0
        for m in self.masters.values():
            if not m.alive or m.core is None:
                continue
            n = m.registry.nodes.get(node)
            share = n.effective_share if n is not None else 0
            if m.draining and m.core.queued_requests == 0:
                share = 0  # takes no new requests and has none waiting: it can only finish leases
            total += max(share, m.unfinished_on.get(node, 0))
        return total

    def token_share(self, m: SimMaster, node: str) -> int:
        """The tokens master ``m`` may charge on ``node`` now (0 without a live stream there)."""
        n = m.registry.nodes.get(node)
        if n is None or m.core is None:
            return 0
        share = getattr(n, "effective_token_share", None)
        if share is None:
            return 0
        if m.draining and m.core.queued_requests == 0:
            return 0  # takes no new requests and has none waiting: it can only finish leases
        return int(share)

    def token_usage(self, node: str) -> tuple[int, int]:
        """Σ over live masters of the tokens their unfinished leases charge on ``node``, and of
        max(token share, those tokens): the token counterparts of :meth:`usable`."""
        running = usable = 0
        for m in self.masters.values():
            if not m.alive or m.core is None:
                continue
            unfinished = m.tokens_unfinished.get(node, 0)
            running += unfinished
            usable += max(self.token_share(m, node), unfinished)
        return running, usable

    def check(self) -> None:
        for node, cap in self.cfg.nodes.items():
            u = self.usable(node)
            if u > self.stats.max_usable.get(node, 0):
                self.stats.max_usable[node] = u
            if u > cap:
                self.stats.violations.append((self.now, node, u))
        for node, pool in self.cfg.kv_tokens.items():
            running, usable = self.token_usage(node)
            if usable > self.stats.max_token_usable.get(node, 0):
                self.stats.max_token_usable[node] = usable
            if running > self.stats.max_token_running.get(node, 0):
                self.stats.max_token_running[node] = running
            if running > pool:
                self.stats.token_violations.append((self.now, node, running - pool, "running"))
            if usable > pool:
                self.stats.token_violations.append((self.now, node, usable - pool, "usable"))

    # -- scenario -----------------------------------------------------------------------------
    def run(self) -> Stats:
        cfg = self.cfg
        for m in cfg.masters if cfg.start_masters is None else cfg.start_masters:
            self.after(self.rng.uniform(0, 0.5), lambda m=m: self.master_start(m))  # type: ignore[misc]
        for t, kind, mid in cfg.churn:
            self.at(t, lambda kind=kind, mid=mid: self.churn(kind, mid))  # type: ignore[misc]
        for a in self.agents.values():
            self.after(self.rng.uniform(0, 0.5), lambda a=a: self.agent_start(a))  # type: ignore[misc]
        for a in self.agents.values():
            self.after(0.05, lambda a=a: self.agent_tick(a))  # type: ignore[misc]
            self.after(cfg.probe_s, lambda a=a: self.agent_probe(a))  # type: ignore[misc]
        self.after(0.1, self.master_timers)
        if cfg.chaos_s > 0 and cfg.fault_every_s > 0:
            self.after(self.rng.expovariate(1 / cfg.fault_every_s) + 2.0, self.fault)
        self.run_until(cfg.chaos_s)
        self.faults_on = False
        # Bring everything back for the stable phase.
        for a in self.agents.values():
            if not a.alive:
                self.agent_start(a)
        for sm in self.masters.values():
            if not sm.alive and not sm.draining and sm.mid in self.routable:
                self.master_start(sm.mid)
        self.measure_from = self.now
        self.run_until(cfg.chaos_s + cfg.settle_s - cfg.quiet_s)
        self.arrivals_on = False
        self.run_until(cfg.chaos_s + cfg.settle_s)
        recorded = {(t, k, m) for t, k, m, _ in self.stats.convergence}
        for t, kind, mid in cfg.churn:
            if t <= self.now and (t, kind, mid) not in recorded:
                self.stats.convergence.append((t, kind, mid, None))
        return self.stats

    def churn(self, kind: str, mid: str) -> None:
        m = self.masters[mid]
        t0 = self.now
        if kind == "join":
            self.routable.add(mid)
            self.master_start(mid)
        elif kind == "drain":
            self.routable.discard(mid)
            if m.alive:
                self.master_drain(m)
        elif kind == "die":
            self.routable.discard(mid)
            if m.alive:
                self.master_crash(m)
        else:
            raise ValueError(f"unknown churn {kind!r}")
        self.after(0.05, lambda: self._await_convergence(t0, kind, mid))

    def _await_convergence(self, t0: float, kind: str, mid: str, done: set[str] | None = None) -> None:
        done = set() if done is None else done
        done |= {a.node for a in self.agents.values() if a.node not in done and self.node_converged(a)}
        if len(done) == len(self.agents):
            self.stats.convergence.append((t0, kind, mid, self.now - t0))
        elif self.now - t0 > 30.0:
            self.stats.convergence.append((t0, kind, mid, None))
        else:
            self.after(0.05, lambda: self._await_convergence(t0, kind, mid, done))

    def node_converged(self, a: SimAgent) -> bool:
        """The node splits among exactly the masters that take requests, nothing is reserved for a
        master that left, every master holds what the agent grants it, and no slot is left free
        (every slot is granted to, or still used by, a live master: the node is work-conserving).
        A node counts as converged from the first time this holds after a churn event."""
        live = tuple(
            sorted(m for m in self.routable if self.masters[m].alive and not self.masters[m].draining)
        )
        s = a.slicer
        if s is None or s.members(self.now) != live or s._ho.orphans or s._ho.free() != 0:
            return False
        for mid in live:
            n = self.masters[mid].registry.nodes.get(a.node)
            if n is None or n.effective_share != s.share_for(mid):
                return False
        return True

    def fault(self) -> None:
        if not self.faults_on:
            return
        kinds = ["reset", "partition", "master_crash", "master_leave", "agent_crash", "master_join"]
        if self.cfg.reject_faults:
            kinds.append("reject")
        kind = self.rng.choice(kinds)
        self.stats.faults[kind] = self.stats.faults.get(kind, 0) + 1
        getattr(self, "fault_" + kind)()
        self.after(self.rng.expovariate(1 / self.cfg.fault_every_s), self.fault)

    def _open_streams(self) -> list[Stream]:
        out = []
        for a in self.agents.values():
            for link in a.links.values():
                if link.stream is not None and link.stream.agent_open:
                    out.append(link.stream)
        return out

    def fault_reset(self, partition: bool = False) -> None:
        streams = self._open_streams()
        if not streams:
            return
        s = self.rng.choice(streams)
        da = self.rng.uniform(0, self.cfg.agent_detect_s) if partition else self.delay()
        dm = self.rng.uniform(0, self.cfg.master_detect_s) if partition else self.delay()
        s_cut = s
        s_cut.cut = True
        self.after(da, lambda: self.agent_stream_closed(s_cut))
        self.after(dm, lambda: self.master_stream_closed(s_cut))

    def fault_partition(self) -> None:
        self.fault_reset(partition=True)

    def fault_reject(self) -> None:
        """A link answers with resets for a while: both ends notice when they next send (as a
        partition's keep-alives), and the master's address refuses the agent meanwhile."""
        streams = self._open_streams()
        if not streams:
            return
        s = self.rng.choice(streams)
        self.rejecting[(s.node, s.master)] = self.now + self.rng.uniform(1.0, 6.0)
        s.cut = True
        self.after(self.rng.uniform(0, self.cfg.agent_detect_s), lambda: self.agent_stream_closed(s))
        self.after(self.rng.uniform(0, self.cfg.master_detect_s), lambda: self.master_stream_closed(s))

    def _refused(self, node: str, mid: str) -> bool:
        """A connection from ``node``'s agent to the master's address is refused."""
        return not self.masters[mid].alive or self.now < self.rejecting.get((node, mid), -math.inf)

    def fault_master_crash(self) -> None:
        live = [m for m in self.masters.values() if m.alive and not m.draining]
        if len(live) <= 1:
            return
        m = self.rng.choice(live)
        self.master_crash(m)
        self.after(self.rng.uniform(0.5, 4.0), lambda: self.master_start(m.mid))

    def fault_master_leave(self) -> None:
        live = [m for m in self.masters.values() if m.alive and not m.draining]
        if len(live) <= 1:
            return
        m = self.rng.choice(live)
        self.master_drain(m)

    def fault_master_join(self) -> None:
        down = [m for m in self.masters.values() if not m.alive and not m.draining]
        if down:
            self.master_start(self.rng.choice(down).mid)

    def fault_agent_crash(self) -> None:
        live = [a for a in self.agents.values() if a.alive]
        if not live:
            return
        a = self.rng.choice(live)
        self.agent_crash(a)
        self.after(self.rng.uniform(0.2, 3.0), lambda: self.agent_start(a))

    # -- etcd ---------------------------------------------------------------------------------
    def etcd_changed(self) -> None:
        view = set(self.etcd)
        drained = frozenset(self.drained)
        # Masters count the live masters in etcd (their queue bound's floor) every couple of seconds.
        self.after(self.rng.uniform(0.0, 2.0), self.masters_counted)
        for a in self.agents.values():
            lo, hi = self.cfg.watch_delay_s
            a.watch_last = max(a.watch_last, self.now + self.rng.uniform(lo, hi))
            self.at(a.watch_last, lambda a=a, v=view, i=a.inc: self.agent_watch(a, v, i, drained))  # type: ignore[misc]

    def masters_counted(self) -> None:
        for m in self.masters.values():
            if m.alive and m.core is not None:
                m.core.set_masters(len(self.etcd))

    def etcd_expire(self, m: SimMaster, inc: int) -> None:
        if m.inc == inc and not m.alive and m.mid in self.etcd:
            self.etcd.discard(m.mid)
            m.in_etcd = False
            self.etcd_changed()

    # -- masters ------------------------------------------------------------------------------
    def master_start(self, mid: str) -> None:
        m = self.masters[mid]
        if m.alive or m.draining:
            return
        if mid in self.etcd:  # the old lease is still live: a second master with this id is refused
            self.after(0.5, lambda: self.master_start(mid))
            return
        m.inc += 1
        m.alive, m.draining = True, False
        m.registry = NodeRegistry()
        m.core = AdmissionCore(self.cfg.admission, clock=lambda: self.now)
        m.streams, m.leases, m.released = {}, {}, {}
        m.engine_reset()
        self.drained.discard(mid)  # a new process: its key says nothing of the last one's drain
        # The master's own path: the registry hands admission only the nodes whose share changed.
        m.registry.subscribe_changes(lambda changes, m=m: self.master_shares(m, changes))  # type: ignore[misc]
        self.etcd.add(mid)
        m.in_etcd = True
        m.core.set_masters(len(self.etcd))  # a master counts the masters right after registering
        self.etcd_changed()
        self.after(self.rng.expovariate(self._rate(mid)), lambda inc=m.inc: self.arrival(m, inc))  # type: ignore[misc]

    def _rate(self, mid: str) -> float:
        rates = self.cfg.rates or {}
        if self.cfg.churn and rates:
            # Weights: the offered load is spread over the masters that take requests now.
            live = [m for m in self.routable if self.masters[m].alive and not self.masters[m].draining]
            total = sum(
                rates.get(m, 0.0)
                for m in self.cfg.masters
                if m in rates and (self.cfg.start_masters is None or m in self.cfg.start_masters)
            )
            weight = sum(rates.get(m, 0.0) for m in live)
            if mid not in live or weight <= 0:
                return 1e-6
            return max(rates.get(mid, 0.0) * total / weight, 1e-6)
        return max(rates.get(mid, 40.0), 1e-6)

    def master_shares(self, m: SimMaster, changes: ShareChanges) -> None:
        if m.core is None or not m.alive:
            return
        if CORE_TOKENS and self.cfg.kv_tokens:
            token_shares, token_full = m.registry.token_changes(changes)
            m.core.update_shares(  # type: ignore[call-arg,unused-ignore]
                *split_changes(changes), token_shares=token_shares, token_full=token_full
            )
        else:
            m.core.update_shares(*split_changes(changes))
        self.master_changes(m, m.core.last_changes)

    def master_changes(self, m: SimMaster, changes: list[Ticket]) -> None:
        for t in changes:
            if t.state is TicketState.GRANTED and not t.released and t.id not in m.leases:
                self._granted(m, t)
            elif t.state not in (TicketState.GRANTED, TicketState.QUEUED):
                self._charges.pop((m.mid, m.inc, t.id), None)
                if self.now >= self.measure_from:
                    self.stats.refused[m.mid] = self.stats.refused.get(m.mid, 0) + 1

    def _granted(self, m: SimMaster, t: Ticket) -> None:
        assert t.node is not None
        pool = self.cfg.kv_tokens.get(t.node)
        charge = self._charges.pop((m.mid, m.inc, t.id), 0)
        if pool is not None and charge:
            if not CORE_TOKENS and charge > self.token_share(m, t.node) - m.tokens_held.get(t.node, 0):
                # Its token share there cannot take the lease: not placed (released at once).
                self.stats.token_refused += 1
                assert m.core is not None
                self.master_changes(m, m.core.release(t))
                return
            m.lease_tokens[t.id] = charge
            m.tokens_held[t.node] = m.tokens_held.get(t.node, 0) + charge
            m.tokens_unfinished[t.node] = m.tokens_unfinished.get(t.node, 0) + charge
        m.leases[t.id] = t
        m.decoding[t.id] = "prefill"
        m.unfinished_on[t.node] = m.unfinished_on.get(t.node, 0) + t.slots
        if self.now >= self.measure_from:
            self.stats.granted[m.mid] = self.stats.granted.get(m.mid, 0) + 1
            self.stats.waits.setdefault(m.mid, []).append(t.wait_s or 0.0)
        cfg = self.cfg
        hold = self.rng.expovariate(1 / cfg.hold_mean_s)
        relay = 0.0
        paused = None
        if cfg.slow_fraction > 0 and self.rng.random() < cfg.slow_fraction:
            self.stats.slow_leases += 1
            relay = self.rng.expovariate(1 / cfg.relay_mean_s)
            # The relay pauses once the client is far enough behind, some time during the decode.
            # Drawn in both modes, so that a seed offers the same traffic to either.
            paused = self.rng.uniform(0.0, hold)
        inc = m.inc
        if cfg.prefill_mean_s <= 0:
            # No prefill: sent, held and running at once (and no draws, so seeds keep their runs).
            self.decode_sent(m, inc, t)
            self.decode_arrived(m, inc, t)
            self.decode_started(m, inc, t, hold, relay, paused)
            return
        # Drawn after the draws above, so that a seed offers the same traffic whatever the prefill.
        prefill = self.rng.expovariate(1 / cfg.prefill_mean_s)
        to_engine, kv = self.delay(), self.delay()

        # These move the lease within the engine, not its grant or end: the invariant stays.
        def arrived() -> None:
            self._skip_check = True
            self.decode_arrived(m, inc, t)

        def start() -> None:
            self._skip_check = True
            self.decode_started(m, inc, t, hold, relay, paused)

        if cfg.protocol == "sglang":
            # The decode request goes out with the prefill's; the engine runs it once its KV is in.
            self.decode_sent(m, inc, t)
            self.after(to_engine, arrived)
            self.after(max(to_engine, prefill + kv), start)
        else:
            # The decode request goes out once the prefill answered; then the engine pulls the KV.
            def sent() -> None:
                self._skip_check = True
                self.decode_sent(m, inc, t)
                if t.sent:
                    self.after(to_engine, arrived)
                    self.after(to_engine + kv, start)

            self.after(prefill, sent)

    def _engine_has(self, m: SimMaster, inc: int, t: Ticket) -> bool:
        return m.inc == inc and m.alive and t.id in m.decoding

    def decode_sent(self, m: SimMaster, inc: int, t: Ticket) -> None:
        """The master sent the lease's decode request (kept_from="sent" counts it from now on)."""
        if self._engine_has(m, inc, t) and t.id in m.leases and m.core is not None:
            m.core.decode_sent(t)

    def decode_arrived(self, m: SimMaster, inc: int, t: Ticket) -> None:
        """The decode request reached the engine, which holds it waiting for its KV."""
        if not self._engine_has(m, inc, t) or m.decoding[t.id] != "prefill":
            return
        assert t.node is not None
        m.decoding[t.id] = "waiting"
        m.waiting_on[t.node] = m.waiting_on.get(t.node, 0) + t.slots

    def decode_started(
        self, m: SimMaster, inc: int, t: Ticket, hold: float, relay: float, paused: float | None
    ) -> None:
        """The engine runs the decode, for ``hold`` seconds."""
        if not self._engine_has(m, inc, t):
            return
        assert t.node is not None
        if m.decoding[t.id] == "waiting":
            m.waiting_on[t.node] -= t.slots
        m.decoding[t.id] = "running"
        m.decoding_on[t.node] = m.decoding_on.get(t.node, 0) + t.slots
        if paused is not None and self.cfg.lease_end == "seen":
            self.after(paused, lambda: self.lease_unseen(m, inc, t))
        self.after(hold, lambda: self.decode_end(m, inc, t, relay))

    def _engine_drop(self, m: SimMaster, t: Ticket) -> None:
        """The engine no longer has the lease's request: its decode ended, or it was cancelled."""
        stage = m.decoding.pop(t.id, None)
        if stage is None:
            return
        assert t.node is not None
        m.unfinished_on[t.node] -= t.slots
        if t.id in m.lease_tokens:
            m.tokens_unfinished[t.node] -= m.lease_tokens[t.id]
        if stage == "running":
            m.decoding_on[t.node] -= t.slots
        elif stage == "waiting":
            m.waiting_on[t.node] -= t.slots

    def lease_unseen(self, m: SimMaster, inc: int, t: Ticket) -> None:
        self._skip_check = True  # changes no share and no lease
        if m.inc == inc and m.alive and m.core is not None:
            m.core.end_unseen(t)

    def decode_end(self, m: SimMaster, inc: int, t: Ticket, relay: float) -> None:
        """The engine finished the decode: it no longer counts it. The master releases the lease once
        the last bytes reached it, and for a slow client once that client has them too."""
        self._skip_check = not self.cfg.check_traffic_events
        if not self._engine_has(m, inc, t):
            return  # the process died with its leases
        self._engine_drop(m, t)
        self.after(self.delay() + relay, lambda: self.lease_end(m, inc, t))

    def lease_end(self, m: SimMaster, inc: int, t: Ticket) -> None:
        self._skip_check = not self.cfg.check_traffic_events
        if m.inc != inc or not m.alive or m.core is None:
            return  # the process died with its leases
        self._release(m, t)
        self.master_changes(m, m.core.release(t))
        if m.draining and m.core.active == 0:
            self.master_leave(m)

    def _release(self, m: SimMaster, t: Ticket) -> None:
        """The master no longer holds the lease: neither its slot nor its tokens."""
        m.leases.pop(t.id, None)
        charge = m.lease_tokens.pop(t.id, None)
        if charge is not None and t.node is not None:
            m.tokens_held[t.node] -= charge

    def arrival(self, m: SimMaster, inc: int) -> None:
        self._skip_check = not self.cfg.check_traffic_events
        if m.inc != inc or not m.alive or m.core is None:
            return
        self.after(self.rng.expovariate(self._rate(m.mid)), lambda: self.arrival(m, inc))
        if m.draining or not self.arrivals_on:
            return
        slots = 2 if self.rng.random() < self.cfg.gang_fraction else 1
        if self.cfg.kv_tokens:
            lo, hi = self.cfg.lease_tokens
            charge = self.trng.randint(lo, hi) * slots
            if CORE_TOKENS:
                t = m.core.submit(slots, RequestClass.COLD, tokens=charge)  # type: ignore[call-arg,unused-ignore]
            else:
                t = m.core.submit(slots, RequestClass.COLD)
            self._charges[(m.mid, m.inc, t.id)] = charge
        else:
            t = m.core.submit(slots, RequestClass.COLD)
        self.master_changes(m, [t, *(x for x in m.core.last_changes if x is not t)])

    def master_timers(self) -> None:
        self._skip_check = not self.cfg.check_traffic_events  # expiry ends tickets, grants within shares
        for m in self.masters.values():
            if m.alive and m.core is not None:
                self.master_changes(m, m.core.expire())
                if self.cfg.released_keys:
                    self._master_release(m)
        self.after(0.1, self.master_timers)

    def _master_release(self, m: SimMaster) -> None:
        """As PDMaster.released_streams and _release_loop: name the nodes whose stream is down and
        where it holds no share, with the slots its leases there run; each node's agent reads the put
        by its watch."""
        assert m.core is not None
        want: dict[str, tuple[int, int]] = {}
        for node in m.registry.disconnected():
            n = m.registry.nodes.get(node)
            if n is None or not n.stream_id or m.core.share_on(node):
                continue
            want[node] = (n.stream_id, m.core.active_on(node))
        if want == m.released:
            return
        new = {k: v for k, v in want.items() if m.released.get(k) != v}
        m.released = want
        for node, word in sorted(new.items()):
            a = self.agents[node]
            lo, hi = self.cfg.watch_delay_s
            a.watch_last = max(a.watch_last, self.now + self.rng.uniform(lo, hi))
            self.at(a.watch_last, lambda a=a, w=word, inc=a.inc: self.agent_released(a, m.mid, w, inc))  # type: ignore[misc]

    def master_crash(self, m: SimMaster) -> None:
        m.alive = False
        m.core = None  # the engine cancels the dead process's requests: its leases vanish
        m.leases = {}
        m.engine_reset()
        for s in list(m.streams.values()):
            s.cut = True
            s.master_open = False
            # A dead process's sockets close: usually noticed at once, sometimes by keep-alive.
            d = self.delay() if self.rng.random() < 0.7 else self.rng.uniform(0, self.cfg.agent_detect_s)
            self.after(d, lambda s=s: self.agent_stream_closed(s))  # type: ignore[misc]
        m.streams = {}
        inc = m.inc
        self.after(self.cfg.lease_ttl_s, lambda: self.etcd_expire(m, inc))

    def master_drain(self, m: SimMaster) -> None:
        m.draining = True
        assert m.core is not None
        if m.core.active == 0:
            self.master_leave(m)
        else:
            inc = m.inc
            timeout = self.cfg.drain_timeout_s
            self.after(timeout, lambda: self.master_leave(m, timed_out=True) if m.inc == inc else None)

    def master_leave(self, m: SimMaster, timed_out: bool = False) -> None:
        if not m.alive or not m.in_etcd:
            return  # not running, or left already (a lease that ended after a drain timeout)
        if self.cfg.drained_keys and m.core is not None:
            if timed_out:
                # MasterServer.drain: what still runs is cancelled (the engines drop it) first.
                for t in list(m.leases.values()):
                    self._engine_drop(m, t)
                    self._release(m, t)
                    m.core.release(t)
            self.drained.add(m.mid)  # the key says so just before the revocation: one watch step
        # Revoke the lease, then stop: streams close cleanly; leases past the drain timeout end.
        self.stats.left[m.mid] = self.now
        self.etcd.discard(m.mid)
        m.in_etcd = False
        self.etcd_changed()
        inc = m.inc

        def stop() -> None:
            if m.inc != inc or not m.alive:
                return
            m.alive = False
            m.draining = False
            m.core = None
            m.leases = {}
            m.engine_reset()
            for s in list(m.streams.values()):
                s.master_open = False
                s.cut = True
                self.after(self.delay(), lambda s=s: self.agent_stream_closed(s))  # type: ignore[misc]
            m.streams = {}
            # Restarting in a loop; in the stable phase it comes back so every master is measured.
            if self.cfg.restart_left:
                self.after(self.rng.uniform(0.5, 2.0), lambda: self.master_start(m.mid))

        self.after(0.1, stop)

    def master_stream_closed(self, s: Stream) -> None:
        m = self.masters[s.master]
        if not s.master_open:
            return
        s.master_open = False
        if m.inc != s.master_inc or not m.alive:
            return
        if m.streams.get(s.node) is s:
            del m.streams[s.node]
        if s.token is not None:
            m.registry.disconnect(s.node, s.token)
        if self.cfg.unsent_on_loss == "cancel" and s.node not in m.streams and m.core is not None:
            # It may no longer place work there: nor the decodes of leases still in their prefill,
            # which the node's samples cannot see (the agent frees their slots once it could have
            # noticed the loss).
            for t in [t for t in m.leases.values() if t.node == s.node and not t.sent]:
                self._engine_drop(m, t)
                self._release(m, t)
                self.stats.cancelled_unsent += 1
                self.master_changes(m, m.core.release(t))
            if m.draining and m.core.active == 0:
                self.master_leave(m)

    def _abort(self, s: Stream) -> None:
        """The master refuses the stream: both ends close (the agent hears it after a delay)."""
        self.master_stream_closed(s)
        s.cut = True
        self.after(self.delay(), lambda: self.agent_stream_closed(s))

    def master_receive(self, s: Stream, kind: str, grant: tuple[int, int, int | None], seq: int) -> None:
        m = self.masters[s.master]
        if s.cut or not s.master_open or not m.alive or m.inc != s.master_inc or m.core is None:
            return
        if kind == "register" and m.draining:
            self._abort(s)  # a draining master refuses new streams
            return
        pool = self.cfg.kv_tokens.get(s.node)
        # Token fields only where the node has a pool: the registry calls of a slots-only run stay
        # those of the model before tokens.
        tokens = {} if pool is None else {"kv_tokens": pool, "token_share": grant[2]}
        try:
            if kind == "register":
                _, token = m.registry.register(
                    node_id=s.node,
                    role=DECODE,
                    endpoint=f"http://{s.node}",
                    running_max_req_size=self.cfg.nodes[s.node],
                    grant=(grant[0], grant[1]),
                    stream_id=s.sid if self.cfg.released_keys else 0,
                    **tokens,  # type: ignore[arg-type]
                )
                s.token = token
                m.streams[s.node] = s
            else:
                assert s.token is not None
                if pool is None:
                    m.registry.apply_grant(s.node, s.token, grant[0], grant[1])
                else:
                    m.registry.apply_grant(s.node, s.token, grant[0], grant[1], grant[2])
        except ProtocolError:
            self._abort(s)
            return
        node = m.registry.nodes[s.node]
        active = m.core.active_on(s.node)
        live = max(1, len(m.registry.live(DECODE)))
        wanted = -(-m.core.wanted_slots() // live)
        kept = None
        if self.cfg.kept_acks and self.cfg.kept_from == "sent":
            # As CoordinationService._ack: the leases in decode at both Acks (their decode request
            # went out, their end in sight).
            kept, s.kept_mark = m.core.kept_since(s.node, s.kept_mark)
        elif self.cfg.kept_acks:
            # As the previous release: the leases held now (only those whose end it sees, as of
            # end_unseen) less the slots granted since the previous Ack.
            granted = m.core.granted_on(s.node)
            sure = min(active, m.core.sure_on(s.node)) if self.cfg.lease_end == "seen" else active
            kept = kept_slots(sure, granted, s.kept_mark)
            s.kept_mark = granted
        toks = None
        if pool is not None:
            # As CoordinationService._ack with a token provider: what its leases here charge, what
            # its queue wants (its wanted slots at the mean charge), and the charges of the leases it
            # held at its previous Ack here and holds still.
            here = frozenset(i for i, t in m.leases.items() if t.node == s.node)
            lo, hi = self.cfg.lease_tokens
            kept_t = sum(m.lease_tokens.get(i, 0) for i in here & s.token_mark)
            active_t, wanted_t = m.tokens_held.get(s.node, 0), wanted * (lo + hi) // 2
            if CORE_TOKENS:
                core: Any = m.core
                active_t, wanted_t = core.active_tokens_on(s.node), -(-core.wanted_tokens() // live)
                if self.cfg.kept_acks and self.cfg.kept_from == "sent":
                    kept_t = core.last_kept_tokens(s.node)  # of the leases kept_since just counted
            toks = (active_t, wanted_t, kept_t)
            s.token_mark = here
        self._send_m2a(s, node.epoch, active, wanted, m.draining, seq, kept, toks)

    def _send_m2a(
        self,
        s: Stream,
        epoch: int,
        active: int,
        wanted: int,
        draining: bool,
        seq: int,
        kept: int | None,
        toks: tuple[int, int, int] | None = None,
    ) -> None:
        if s.cut:
            return
        t = max(self.now + self.delay(), s.m2a_last)
        s.m2a_last = t
        self.at(t, lambda: self.agent_receive(s, epoch, active, wanted, draining, seq, kept, toks))

    # -- agents -------------------------------------------------------------------------------
    def agent_start(self, a: SimAgent) -> None:
        if a.alive and a.slicer is not None:
            return
        a.inc += 1
        a.alive = True
        a.links = {}
        a.polled, a.bracket_next, a.closing, a.starting = None, False, False, False
        a.released_seen = {}
        a.slicer = Slicer(
            node_id=a.node,
            capacity=a.capacity,
            policy=SharePolicy(
                grace=self.cfg.grace_s,
                handover=self.cfg.handover,
                policy=self.cfg.policy,
                floor=self.cfg.floor,
            ),
            peer_detect_s=self.cfg.peer_detect_s,
            now=self.now,
            kv_tokens=self.cfg.kv_tokens.get(a.node),
        )
        a.slicer.restore_epoch(self.stored_epoch.get(a.node, 0))
        self.agent_watch(a, set(self.etcd))

    def agent_crash(self, a: SimAgent) -> None:
        a.alive = False
        a.slicer = None
        for link in a.links.values():
            s = link.stream
            if s is not None:
                s.agent_open = False
                s.cut = True
                d = self.delay() if self.rng.random() < 0.7 else self.rng.uniform(0, self.cfg.master_detect_s)
                self.after(d, lambda s=s: self.master_stream_closed(s))  # type: ignore[misc]
        a.links = {}

    def _changed(self, a: SimAgent) -> None:
        assert a.slicer is not None
        self.stored_epoch[a.node] = a.slicer.epoch
        for link in a.links.values():
            if link.up:
                self.agent_send(a, link, "report")

    def agent_watch(
        self, a: SimAgent, view: set[str], inc: int | None = None, drained: frozenset[str] = frozenset()
    ) -> None:
        if not a.alive or a.slicer is None or (inc is not None and inc != a.inc):
            return  # events from before a restart: the new incarnation listed etcd afresh
        # The put that marked a key drained comes before its deletion (NodeAgent._set_masters).
        for mid in sorted(drained):
            a.slicer.master_drained(mid)
        a.etcd_view = view
        for mid in list(a.links):
            if mid not in view:
                link = a.links.pop(mid)
                self._agent_close(a, link)
        for mid in sorted(view):  # sorted: the same seed gives the same run in every process
            if mid not in a.links:
                a.links[mid] = Link(mid)
                self.agent_connect(a, a.links[mid])
        if a.slicer.set_masters(view, self.now, self.time_ns()):
            self._changed(a)

    def _agent_close(self, a: SimAgent, link: Link) -> None:
        s = link.stream
        if s is None:
            return
        s.agent_open = False
        s.cut = True
        self.after(self.delay(), lambda: self.master_stream_closed(s))
        if link.up and a.slicer is not None:
            link.up = False
            if a.slicer.stream_down(link.master, self.now, self.time_ns()):
                self._changed(a)
        link.stream = None

    def agent_connect(self, a: SimAgent, link: Link) -> None:
        if not a.alive or a.links.get(link.master) is not link or link.stream is not None:
            return
        m = self.masters[link.master]
        if self._refused(a.node, m.mid):
            # Connection refused: retry with backoff.
            self.after(link.backoff, lambda: self.agent_connect(a, link))
            link.backoff = min(link.backoff * 2, 1.0)
            return
        s = Stream(next(self._sid), a.node, m.mid, a.inc, m.inc)
        link.stream = s
        if a.slicer is not None:
            a.slicer.stream_opening(m.mid, s.sid)
        link.acked = None
        self.agent_send(a, link, "register")

    def agent_send(self, a: SimAgent, link: Link, kind: str) -> None:
        s = link.stream
        if s is None or s.cut or not s.agent_open or a.slicer is None:
            return
        a.seq += 1
        seq = a.seq
        if kind == "report":
            link.report_seq, link.report_sent_at = seq, self.now
        token_share = a.slicer.token_share_for(link.master) if a.node in self.cfg.kv_tokens else None
        grant = (a.slicer.share_for(link.master), a.slicer.epoch, token_share)
        link.sent_epoch = a.slicer.epoch
        link.next_report = self.now + (self.cfg.poll_s if a.slicer.handover_pending else self.cfg.report_s)
        t = max(self.now + self.delay(), s.a2m_last)
        s.a2m_last = t
        self.at(t, lambda: self.master_receive(s, kind, grant, seq if kind == "report" else 0))

    def agent_receive(
        self,
        s: Stream,
        epoch: int,
        active: int,
        wanted: int,
        draining: bool = False,
        seq: int = 0,
        kept: int | None = None,
        toks: tuple[int, int, int] | None = None,
    ) -> None:
        a = self.agents[s.node]
        if s.cut or not a.alive or a.inc != s.agent_inc or not s.agent_open or a.slicer is None:
            return
        link = a.links.get(s.master)
        if link is None or link.stream is not s:
            return
        changed = False
        if not link.up:
            link.up = True
            link.backoff = 0.1
            changed |= a.slicer.stream_up(s.master, self.now, self.time_ns(), stream_id=s.sid)
        answers = link.report_sent_at if seq and seq == link.report_seq else -math.inf
        # The handover accepts a closing Ack only for a Report sent END_SEEN_S after the sample came
        # back; an agent that waits (and accepts) end_seen_s instead is the same comparison with
        # the send time shifted by the difference.
        answers += END_SEEN_S - self.cfg.end_seen_s
        link.answered_seq = seq
        link.acked = (epoch, active)
        token_acks: dict[str, int] = {}
        if toks is not None:
            token_acks = {"active_tokens": toks[0], "wanted_tokens": toks[1], "kept_tokens": toks[2]}
        changed |= a.slicer.on_ack(
            s.master,
            epoch,
            active,
            wanted,
            self.now,
            self.time_ns(),
            draining,
            kept=kept,
            answers_sent_at=answers,
            **token_acks,
        )
        h = a.slicer._ho.holders.get(s.master)
        if self._ack_shift and h is not None and h.acked_at == self.now:
            h.acked_at += self._ack_shift
        if changed:
            self._changed(a)
        if a.polled is not None and all(not x.up or x.answered_seq == x.report_seq for x in a.polled):
            self._bracket_sample(a)

    def agent_stream_closed(self, s: Stream) -> None:
        a = self.agents[s.node]
        if not s.agent_open:
            return
        s.agent_open = False
        if not a.alive or a.inc != s.agent_inc or a.slicer is None:
            return
        link = a.links.get(s.master)
        if link is None or link.stream is not s:
            return
        link.stream = None
        if link.up:
            link.up = False
            changed = a.slicer.stream_down(s.master, self.now, self.time_ns())
            seen = a.released_seen.get(s.master)
            if (
                seen is not None
                and seen[0] == s.sid
                and a.slicer.master_released(s.master, s.sid, self.now, self.time_ns(), seen[1])
            ):  # the master's key named it first
                self.stats.released += 1
                changed = True
            if changed:
                self._changed(a)
            # The agent tries the master's address (NodeAgent._check_gone): a round trip.
            self.after(2 * self.delay(), lambda: self.agent_check_gone(a, link))
        self.after(link.backoff, lambda: self.agent_connect(a, link))
        link.backoff = min(link.backoff * 2, 1.0)

    def agent_released(self, a: SimAgent, mid: str, word: tuple[int, int], inc: int) -> None:
        """The agent's watch brings a put of the master's key that names a stream released."""
        if not a.alive or a.slicer is None or a.inc != inc:
            return
        a.released_seen[mid] = word
        if a.slicer.master_released(mid, word[0], self.now, self.time_ns(), word[1]):
            self.stats.released += 1
            self._changed(a)

    def agent_check_gone(self, a: SimAgent, link: Link) -> None:
        """A connection to the master's address (a round trip): refused when its process is dead, or
        while its link rejects (reject_faults), which the agent takes for the same."""
        if not a.alive or a.slicer is None or a.links.get(link.master) is not link or link.up:
            return
        if not self._refused(a.node, link.master):
            return
        if not self.cfg.gone_on_refusal:
            a.slicer.master_refused(link.master)  # gone once its key is gone too
        elif a.slicer.master_gone(link.master, self.now, self.time_ns()):
            self._changed(a)

    def agent_tick(self, a: SimAgent) -> None:
        self.after(0.05, lambda: self.agent_tick(a))
        if not a.alive or a.slicer is None:
            return
        if a.slicer.tick(self.now, self.time_ns()):
            self._changed(a)
        polling = self.cfg.polling == "worth" and a.slicer.handover_pending
        for link in a.links.values():
            if not link.up or self.now < link.next_report:
                continue
            heartbeat = self.now >= link.report_sent_at + self.cfg.report_s
            if polling and not heartbeat and not self._worth_polling(a, link):
                continue
            self.agent_send(a, link, "report")

    def _worth_polling(self, a: SimAgent, link: Link) -> bool:
        """As NodeAgent._worth_polling: its Ack can move the handover on (it has not confirmed the
        current grant, or runs more than it), and its answer to the previous Report is in."""
        assert a.slicer is not None
        if link.answered_seq != link.report_seq and self.now - link.report_sent_at < 5.0:
            return False
        if link.acked is None:
            return True
        applied, active = link.acked
        return applied < link.sent_epoch or active > a.slicer.share_for(link.master)

    def agent_probe(self, a: SimAgent) -> None:
        self.after(self.cfg.probe_s, lambda: self.agent_probe(a))
        if not a.alive or a.slicer is None or a.polled is not None or a.closing or a.starting:
            return
        if a.bracket_next and a.slicer.waits_for_bracket:
            # As NodeAgent._probe_loop: Acks from every connected master first, then the sample.
            polled = [link for link in a.links.values() if link.up]
            if not polled:
                self.agent_sample(a)
                return
            a.polled = polled
            for link in polled:
                self.agent_send(a, link, "report")
            inc = a.inc
            self.after(
                BRACKET_ACK_WAIT_S,
                lambda: self._bracket_sample(a) if a.inc == inc and a.polled is not None else None,
            )
            return
        self.agent_sample(a, bracket=False)

    def _bracket_sample(self, a: SimAgent) -> None:
        """The Acks asked before a bracketed sample came in (or the wait for them ran out): the
        sample, start_seen_s later, so that what the masters sent before their Acks is in the
        engine's queues by then."""
        if self.cfg.start_seen_s <= 0:
            self.agent_sample(a)
            return
        a.polled, a.starting = None, True
        inc = a.inc

        def take() -> None:
            if a.inc == inc:
                a.starting = False
                self.agent_sample(a)

        self.after(self.cfg.start_seen_s, take)

    def agent_sample(self, a: SimAgent, bracket: bool = True) -> None:
        a.polled = None
        if not a.alive or a.slicer is None:
            return
        taken = self.now
        live = [m for m in self.masters.values() if m.alive]
        running = sum(m.decoding_on.get(a.node, 0) for m in live)
        if self.cfg.sample_counts == "held":
            running += sum(m.waiting_on.get(a.node, 0) for m in live)
        inc = a.inc

        def deliver() -> None:
            alive = a.alive and a.inc == inc and a.slicer is not None
            if not alive:
                return
            assert a.slicer is not None
            if a.slicer.on_probe(running, taken, self.now, self.time_ns()):
                self._changed(a)
            if bracket and a.slicer.waits_for_bracket:
                a.closing = True
                self.after(self.cfg.end_seen_s, close)
            else:
                a.bracket_next = a.slicer.waits_for_bracket

        def close() -> None:
            # Their answers close the bracket, once the masters could have read the ends of the
            # decodes the sample no longer counted.
            if not a.alive or a.inc != inc or a.slicer is None:
                return
            a.closing = False
            waits = a.slicer.waits_for_bracket
            if waits:
                for link in a.links.values():
                    if link.up:
                        self.agent_send(a, link, "report")
            a.bracket_next = waits

        self.after(self.delay(), deliver)

    # -- results ------------------------------------------------------------------------------
    def converged(self) -> list[str]:
        """Why the stable phase did not reach the targets (empty when it did)."""
        problems = []
        for a in self.agents.values():
            s = a.slicer
            if s is None:
                problems.append(f"{a.node}: agent down")
                continue
            live = sorted(m.mid for m in self.masters.values() if m.alive and not m.draining)
            if list(s.members(self.now)) != live:
                problems.append(f"{a.node}: members {s.members(self.now)} != live masters {live}")
            if dict(s.shares) != dict(s.targets):
                problems.append(f"{a.node}: grants {dict(s.shares)} != targets {dict(s.targets)}")
            if sum(s.targets.values()) != a.capacity:
                problems.append(f"{a.node}: targets {dict(s.targets)} do not sum to {a.capacity}")
            for mid in live:
                n = self.masters[mid].registry.nodes.get(a.node)
                held = n.effective_share if n is not None else 0
                if held != s.share_for(mid):
                    problems.append(f"{a.node}: master {mid} holds {held}, agent grants {s.share_for(mid)}")
            pool = self.cfg.kv_tokens.get(a.node)
            if pool is not None:
                if dict(s.token_shares) != dict(s.token_targets) or sum(s.token_targets.values()) != pool:
                    problems.append(
                        f"{a.node}: token grants {dict(s.token_shares)} != targets {dict(s.token_targets)} "
                        f"(pool {pool})"
                    )
                for mid in live:
                    n = self.masters[mid].registry.nodes.get(a.node)
                    held_t = getattr(n, "token_share", None) if n is not None else None
                    granted_t = s.token_share_for(mid)
                    if held_t != granted_t:
                        problems.append(
                            f"{a.node}: master {mid} holds {held_t} tokens, agent grants {granted_t}"
                        )
        return problems

    def utilisation(self) -> float:
        cap = sum(self.cfg.nodes.values())
        return self.stats.busy_slot_s / (cap * self.stats.measured_s) if self.stats.measured_s else 0.0

    def traffic(self) -> dict[str, float]:
        """What the benches report of a run: utilisation, the share of requests served, the
        admission wait of the granted ones (p50, p99) and the strict-handover violations."""
        st = self.stats
        waits = sorted(w for ws in st.waits.values() for w in ws)
        granted = sum(st.granted.values())
        refused = sum(st.refused.values())
        return {
            "utilisation": self.utilisation(),
            "served": granted / max(1, granted + refused),
            "wait_p50_ms": 1000 * waits[len(waits) // 2] if waits else 0.0,
            "wait_p99_ms": 1000 * waits[min(len(waits) - 1, int(0.99 * len(waits)))] if waits else 0.0,
            "violations": len(st.violations),
        }
