"""Token shares (DESIGN §13): split like slots under the same epoch, handed over strictly.

The token handover rests on the masters' Acks (applied epoch and active tokens) and on the slot
handover: a departed master's tokens stay reserved while any of its slots may still be running
(its slot reservation, or a pool it was cut into), since every lease holds a slot."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from nodeagent.handover import STARTUP
from nodeagent.slicing import SharePolicy, Slicer, demand_shares, slice_shares


def started(capacity: int, pool: int | None, masters: list[str], **kw: object) -> Slicer:
    """A strict slicer with a KV pool whose startup reservation an idle engine sample released;
    every master acks with token counts (this release)."""
    kw.setdefault("grace", 1.0)
    kw.setdefault("policy", "static")
    s = Slicer(
        node_id="d1",
        capacity=capacity,
        policy=SharePolicy(**kw),  # type: ignore[arg-type]
        peer_detect_s=1.0,
        kv_tokens=pool,
    )
    s.set_masters(masters, 0.0, 1)
    for m in masters:
        s.stream_up(m, 0.0, 2)
        s.on_ack(m, s.epoch, 0, 0, 0.0, 3, active_tokens=0, wanted_tokens=0)
    s.on_probe(0, 1.0, 1.0, 4)
    return s


def test_tokens_split_like_slots_under_one_epoch() -> None:
    s = started(8, 1000, ["a", "b", "c"])
    assert dict(s.shares) == slice_shares(8, ["a", "b", "c"], "d1")
    assert dict(s.token_shares) == slice_shares(1000, ["a", "b", "c"], "d1")
    assert {m: s.token_share_for(m) for m in "abc"} == dict(s.token_shares)
    snap = s.snapshot()
    assert snap["kv_tokens"] == 1000
    assert snap["tokens"]["grants"] == dict(s.token_shares)  # type: ignore[index]
    # a change of the pool alone advances the one epoch
    epoch = s.epoch
    assert s.set_kv_tokens(1200, 2.0, 5)
    assert s.epoch > epoch and dict(s.shares) == slice_shares(8, ["a", "b", "c"], "d1")
    assert sum(s.token_shares.values()) == 1200


def test_no_pool_means_no_token_share_as_before() -> None:
    s = started(8, None, ["a", "b"])
    assert s.token_share_for("a") is None and not s.token_shares
    assert "tokens" not in s.snapshot()
    assert not s.set_kv_tokens(None, 2.0, 5)
    assert not s.set_kv_tokens(0, 2.0, 5)


def test_a_master_of_an_earlier_release_gets_no_token_share_and_its_slots_stand_in() -> None:
    s = started(8, 800, ["a", "b"])
    epoch = s.epoch
    s.on_ack("b", s.epoch, 3, 0, 2.0, 5)  # no token counts: an earlier release
    assert s.token_share_for("b") is None and s.token_share_for("a") is not None
    # its grant loses its token share under a new epoch (never another share under the same one)
    assert s.epoch > epoch
    # its 3 slots reserve 3 x 800 / 8 tokens while it runs them
    assert s.snapshot()["tokens"]["bounds"]["b"] >= 300  # type: ignore[index]
    assert s.snapshot()["tokens"]["slots_only_masters"] == ["b"]  # type: ignore[index]


def test_tokens_follow_token_demand_not_slot_demand() -> None:
    s = started(8, 1000, ["a", "b"], policy="demand", floor=1, rebalance_hysteresis=1)
    t = 10.0  # past the join window
    s.on_ack("a", s.epoch, 1, 0, t, 10, active_tokens=900, wanted_tokens=0)
    s.on_ack("b", s.epoch, 3, 0, t, 10, active_tokens=50, wanted_tokens=0)
    s.tick(t + 2, 11)
    s.tick(t + 4, 12)  # a bounded step per rebalance: two of them
    floors = {"a": 125, "b": 125}  # one slot's worth of the pool each
    want = demand_shares(1000, {"a": 900, "b": 50}, "d1", floors)
    assert dict(s.token_targets) == want
    assert s.token_targets["a"] > s.token_targets["b"]
    assert s.targets["b"] >= s.targets["a"]  # slots follow slot demand


def test_a_departed_master_s_tokens_wait_for_its_slots_to_be_free() -> None:
    s = started(4, 1000, ["a", "b"])
    s.on_ack("b", s.epoch, 2, 0, 1.0, 5, active_tokens=480, wanted_tokens=0, kept_tokens=480)
    s.stream_down("b", 1.0, 6)
    s.tick(2.5, 7)  # past the grace: b leaves the split
    assert s.members(2.5) == ("a",)
    assert s.snapshot()["tokens"]["orphans"] == {"b": 500}  # type: ignore[index]
    assert s.token_shares["a"] == 500  # a cannot grow into what b may still use
    # a sample (taken after b could have noticed) shows b's 2 leases still running: nothing moves
    s.on_probe(2, 2.6, 2.6, 8)
    assert s.token_shares["a"] == 500
    # one lease ended: one slot may still run, so all of b's tokens stay reserved
    s.on_probe(1, 2.8, 2.8, 9)
    assert s.snapshot()["orphans"] == {"b": 1}
    assert s.token_shares["a"] == 500
    # none runs: its slots and its tokens are free
    s.on_probe(0, 3.0, 3.0, 10)
    assert s.snapshot()["orphans"] == {} and s.snapshot()["tokens"]["orphans"] == {}  # type: ignore[index]
    s.on_ack("a", s.epoch, 0, 0, 3.1, 11, active_tokens=0, wanted_tokens=0)
    assert s.token_shares["a"] == 1000 and s.shares["a"] == 4


def test_the_released_word_frees_tokens_too() -> None:
    s = started(4, 1000, ["a", "b"])
    s.stream_opening("b", 77)
    s.stream_up("b", 1.0, 5, stream_id=77)
    s.on_ack("b", s.epoch, 1, 0, 1.0, 6, active_tokens=300, wanted_tokens=0)
    s.stream_down("b", 1.1, 7)
    assert s.master_released("b", 77, 1.2, 8, running=1)
    assert s.snapshot()["tokens"]["orphans"] == {"b": 500}  # type: ignore[index]
    assert s.master_released("b", 77, 1.3, 9, running=0)
    assert s.snapshot()["tokens"]["orphans"] == {}  # type: ignore[index]


def test_a_smaller_pool_shrinks_token_grants_at_once_and_grows_only_as_leases_end() -> None:
    s = started(4, 1000, ["a", "b"])
    s.on_ack("a", s.epoch, 1, 0, 1.0, 5, active_tokens=450, wanted_tokens=0)
    s.on_ack("b", s.epoch, 1, 0, 1.0, 5, active_tokens=450, wanted_tokens=0)
    assert s.set_kv_tokens(600, 1.1, 6)
    assert dict(s.token_shares) == {"a": 300, "b": 300}
    assert sum(s.token_shares.values()) <= 600
    # the grants stay below what runs until the leases end (no master grows meanwhile)
    s.on_ack("a", s.epoch, 0, 0, 1.2, 7, active_tokens=0, wanted_tokens=0)
    assert dict(s.token_shares) == {"a": 300, "b": 300}


def test_startup_reserves_the_whole_pool_until_the_slots_are_known_free() -> None:
    s = Slicer(node_id="d1", capacity=4, policy=SharePolicy(grace=1.0), peer_detect_s=1.0, kv_tokens=400)
    s.set_masters(["a"], 0.0, 1)
    s.stream_up("a", 0.0, 2)
    s.on_ack("a", s.epoch, 0, 0, 0.0, 3, active_tokens=0, wanted_tokens=0)
    assert s.snapshot()["tokens"]["orphans"] == {STARTUP: 400}  # type: ignore[index]
    assert s.token_share_for("a") == 0
    s.on_probe(1, 1.0, 1.0, 4)  # the previous incarnation's master runs one lease: tokens unknown
    assert s.token_share_for("a") == 0
    s.on_probe(0, 1.5, 1.5, 5)
    assert s.token_share_for("a") == 400 and s.share_for("a") == 4


def test_a_pool_found_later_reserves_it_while_departed_masters_may_run() -> None:
    s = started(4, None, ["a", "b"])
    s.on_ack("b", s.epoch, 2, 0, 1.0, 5, active_tokens=200, wanted_tokens=0)
    s.on_ack("a", s.epoch, 1, 0, 1.0, 5, active_tokens=100, wanted_tokens=0)
    s.stream_down("b", 1.0, 6)
    s.tick(2.5, 7)  # b leaves the split; its 2 slots stay reserved
    assert s.set_kv_tokens(1000, 2.6, 8)
    assert s.token_share_for("a") == 0  # what b ran is not known in tokens
    s.on_probe(1, 2.7, 2.7, 9)  # a's lease alone? not proven: the sample cannot tell whose it is
    s.on_probe(0, 2.8, 2.8, 10)
    assert s.token_share_for("a") == 1000


# -- a random walk: acks, joins, leaves, stream drops, drains, releases, pool changes -------------


@dataclass
class Master:
    mid: str
    alive: bool = True
    draining: bool = False
    sid: int = 0  # the stream the master holds (0: none)
    known: tuple[int, int, int] = (0, 0, 0)  # the grant it applied: (epoch, slots, tokens)
    leases: dict[int, tuple[int, int]] = field(default_factory=dict)  # id -> (slots, tokens)
    prev_ack_leases: set[int] = field(default_factory=set)

    def use(self) -> tuple[int, int]:
        return sum(s for s, _ in self.leases.values()), sum(t for _, t in self.leases.values())


class World:
    """Real Slicer, masters that obey the grant they applied, FIFO messages with random delays."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self.cap = self.rng.choice([4, 6, 8])
        self.pool = self.rng.choice([600, 1000, 4000])
        self.s = Slicer(
            node_id="d1",
            capacity=self.cap,
            policy=SharePolicy(grace=0.5, policy=self.rng.choice(["static", "demand"]), orphan_timeout=30.0),
            peer_detect_s=0.2,
            kv_tokens=self.pool,
        )
        self.masters = {m: Master(m) for m in ("m1", "m2", "m3")}
        # In some runs m3 is of an earlier release: its Acks count no tokens and it charges none.
        self.old = {"m3"} if self.rng.random() < 0.3 else set()
        self.by_epoch: dict[tuple[str, int], tuple[int, int | None]] = {}
        self.etcd = set(self.masters)
        self.agent_up: dict[str, int] = {}  # master -> stream the agent has up
        self.to_master: list[tuple[float, str, int, tuple[int, int, int | None]]] = []
        self.to_agent: list[tuple[float, str, int, tuple[int | None, ...]]] = []
        self.sent: dict[str, tuple[int, int, int | None]] = {}
        self.sids = iter(range(1, 10**9))
        self.lease_ids = iter(range(1, 10**9))
        self.shrunk = False
        self.over = 0
        self.last: dict[tuple[str, int], float] = {}
        self.s.set_masters(self.etcd, 0.0, self.tns())

    def at(self, channel: tuple[str, int]) -> float:
        """When a message sent now arrives: a random delay, in order on its stream (FIFO)."""
        t = max(self.now + self.rng.uniform(0, 0.05), self.last.get(channel, 0.0))
        self.last[channel] = t
        return t

    def tns(self) -> int:
        return 1_000_000_000 + int(self.now * 1e9)

    def grant(self, mid: str) -> tuple[int, int, int | None]:
        return (self.s.epoch, self.s.share_for(mid), self.s.token_share_for(mid))

    def send_grants(self) -> None:
        for mid, sid in self.agent_up.items():
            g = self.grant(mid)
            # A master refuses an equal epoch with another share, slots or tokens.
            assert self.by_epoch.setdefault((mid, g[0]), (g[1], g[2])) == (g[1], g[2]), (mid, g)
            if mid in self.old:
                assert g[2] is None or mid not in self.s._token_aware
            if self.sent.get(mid) != g:
                self.sent[mid] = g
                self.to_master.append((self.at(("m", sid)), mid, sid, g))

    def connect(self, mid: str) -> None:
        m = self.masters[mid]
        if not m.alive or m.sid or m.draining or mid not in self.etcd:
            return
        sid = next(self.sids)
        m.sid, m.known, m.prev_ack_leases = sid, (0, 0, 0), set(m.leases)
        self.s.stream_opening(mid, sid)
        self.agent_up[mid] = sid
        self.s.stream_up(mid, self.now, self.tns(), stream_id=sid)
        self.sent.pop(mid, None)
        self.send_grants()

    def drop(self, mid: str) -> None:
        """The stream breaks; the master notices at once and places nothing more there."""
        m = self.masters[mid]
        if mid in self.agent_up:
            del self.agent_up[mid]
            self.s.stream_down(mid, self.now, self.tns())
        m.sid, m.known = 0, (0, 0, 0)

    def ack(self, mid: str) -> None:
        m = self.masters[mid]
        if not m.sid or not m.alive:
            return
        slots, tokens = m.use()
        kept_ids = m.prev_ack_leases & set(m.leases)
        m.prev_ack_leases = set(m.leases)
        kept = sum(m.leases[i][0] for i in kept_ids)
        kept_t = sum(m.leases[i][1] for i in kept_ids)
        wanted = self.rng.randint(0, 3) if not m.draining else 0
        payload: tuple[int | None, ...] = (
            m.known[0],
            slots,
            wanted,
            int(m.draining),
            kept,
            tokens,
            wanted * 150,
            kept_t,
        )
        if mid in self.old:
            payload = payload[:5] + (None, None, None)
        self.to_agent.append((self.at(("a", m.sid)), mid, m.sid, payload))

    def deliver(self) -> None:
        for q in (self.to_master, self.to_agent):
            q.sort(key=lambda x: x[0])  # stable: a stream's messages keep their order
        while self.to_master and self.to_master[0][0] <= self.now:
            _, mid, sid, g = self.to_master.pop(0)
            m = self.masters[mid]
            if m.alive and m.sid == sid and g[0] >= m.known[0]:
                m.known = (g[0], g[1], g[2] or 0)
                self.ack(mid)
        while self.to_agent and self.to_agent[0][0] <= self.now:
            _, mid, sid, p = self.to_agent.pop(0)
            if self.agent_up.get(mid) != sid:
                continue
            self.s.on_ack(
                mid, p[0], p[1], p[2], self.now, self.tns(), bool(p[3]),  # type: ignore[arg-type]
                kept=p[4], active_tokens=p[5], wanted_tokens=p[6], kept_tokens=p[7],
            )  # fmt: skip

    def step(self) -> None:
        rng = self.rng
        self.now += rng.expovariate(20.0)
        self.deliver()
        r = rng.random()
        live = [m for m in self.masters.values() if m.alive]
        if r < 0.35 and live:  # a lease: within the grant the master applied, slots and tokens
            m = rng.choice(live)
            if m.sid and not m.draining:
                slots, tokens = m.use()
                want = rng.randint(20, max(21, self.pool // 3))
                if m.mid in self.old:  # it places by slots alone and charges no tokens
                    want = 0
                if slots + 1 <= m.known[1] and (m.mid in self.old or tokens + want <= m.known[2]):
                    m.leases[next(self.lease_ids)] = (1, want)
        elif r < 0.55 and live:  # a lease ends
            m = rng.choice(live)
            if m.leases:
                del m.leases[rng.choice(sorted(m.leases))]
                if m.draining and not m.leases:
                    self.leave(m)
        elif r < 0.65 and live:
            self.ack(rng.choice(live).mid)
        elif r < 0.72:  # engine sample: every lease of a live master holds one slot
            running = sum(m.use()[0] for m in self.masters.values() if m.alive)
            self.s.on_probe(running, self.now, self.now, self.tns())
        elif r < 0.77 and live:
            self.drop(rng.choice(live).mid)
        elif r < 0.85:
            self.connect(rng.choice(sorted(self.masters)))
        elif r < 0.88 and len(live) > 1:  # crash: its leases end with it, its address refuses
            m = rng.choice(live)
            self.drop(m.mid)
            m.alive, m.leases = False, {}
            self.s.master_gone(m.mid, self.now, self.tns())
            self.etcd.discard(m.mid)
            self.s.set_masters(self.etcd, self.now, self.tns())
        elif r < 0.90:  # a master (re)starts
            down = [m for m in self.masters.values() if not m.alive]
            if down:
                m = rng.choice(down)
                m.alive, m.draining = True, False
                self.etcd.add(m.mid)
                self.s.set_masters(self.etcd, self.now, self.tns())
                self.connect(m.mid)
        elif r < 0.92 and len(live) > 1:  # drain
            m = rng.choice(live)
            m.draining = True
            self.ack(m.mid)
            if not m.leases:
                self.leave(m)
        elif r < 0.95:  # a disconnected master names its stream released, with what still runs
            for m in live:
                if not m.sid and m.mid in self.s.views:
                    sid = self.s.views[m.mid].stream_id
                    self.s.master_released(m.mid, sid, self.now, self.tns(), m.use()[0])
        elif r < 0.97:  # the pool changes
            new = rng.choice([self.pool // 2, self.pool, self.pool * 2, 500, 3000])
            self.shrunk = self.shrunk or new < self.pool
            self.pool = new
            # the shrink itself: grants the masters hold or may still receive (those the agent has
            # issued) and the leases they run may now exceed it
            self.over = max(self.over, self.usable_tokens() - new, self.issued_tokens() - new)
            self.s.set_kv_tokens(new, self.now, self.tns())
        self.s.tick(self.now, self.tns())
        self.send_grants()
        self.check()

    def leave(self, m: Master) -> None:
        """A drained master revokes its key and stops."""
        self.drop(m.mid)
        m.alive = False
        self.s.master_drained(m.mid)
        self.etcd.discard(m.mid)
        self.s.set_masters(self.etcd, self.now, self.tns())

    def usable(self, dim: int) -> int:
        """Σ over live masters of max(the grant it applied, what its leases use); a draining master
        takes no new work: only its leases count."""
        return sum(
            max(0 if m.draining else m.known[1 + dim], m.use()[dim]) for m in self.masters.values() if m.alive
        )

    def issued_tokens(self) -> int:
        """What the agent counts as possibly used: every grant it issued that a master may hold, the
        masters' acked use, the reservations of departed masters."""
        tho = self.s._tho
        assert tho is not None
        return sum(h.bound for h in tho.holders.values()) + tho.orphan_slots()

    def usable_tokens(self) -> int:
        return self.usable(1)

    def check(self) -> None:
        s = self.s
        assert sum(s.token_shares.values()) <= self.pool
        assert sum(s.shares.values()) <= self.cap
        # what masters may use: the grant each applied, or what its leases use if more
        usable = self.usable_tokens()
        over = usable - self.pool
        if not self.shrunk:
            assert over <= 0, (self.now, usable, self.pool, s.snapshot())
        else:
            # after a shrink what runs may exceed the pool until it ends; never more than it did
            assert over <= max(0, self.over), (self.now, usable, self.pool, self.over)
        self.over = max(over, self.issued_tokens() - self.pool) if self.shrunk else over
        if self.over <= 0:
            self.shrunk = False
        assert self.usable(0) <= self.cap


@pytest.mark.parametrize("seed", range(40))
def test_random_walk_never_grants_more_tokens_than_the_pool(seed: int) -> None:
    w = World(seed)
    for m in sorted(w.masters):
        w.connect(m)
    for _ in range(1500):
        w.step()
