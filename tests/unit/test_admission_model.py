"""Randomized walks over the admission core, checking its invariants after every step.

PDCOORD_MODEL_SEEDS (default 200) and PDCOORD_MODEL_OPS (default 500) scale the search.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from typing import Any

import pytest

from pdmaster.admission import (
    CLASS_ORDER,
    AdmissionCore,
    AdmissionPolicy,
    RequestClass,
    Ticket,
    TicketState,
)

SEEDS = int(os.environ.get("PDCOORD_MODEL_SEEDS", "200"))
OPS = int(os.environ.get("PDCOORD_MODEL_OPS", "500"))
Q, G = TicketState.QUEUED, TicketState.GRANTED
NODES = ("d1", "d2", "d3")
FAILURES = {
    "queue_full",
    "timeout",
    "evicted",
    "cancelled",
    "unsatisfiable",
    "no_capacity",
    "cannot_fit_now",
    "invalid",
}


def share_of(snap: dict[str, Any], node: str) -> int:
    return int(snap["nodes"].get(node, {}).get("share", 0))


def max_free(snap: dict[str, Any]) -> int:
    return max([0, *(n["share"] - n["active"] for n in snap["nodes"].values())])


def done(t: Ticket) -> bool:
    return t.state is not Q and (t.state is not G or t.released)


class Walk:
    def __init__(self, seed: int) -> None:
        self.rng = rng = random.Random(seed)
        self.now = 0.0
        waits = {c: rng.choice([0.5, 1.0, 3.0]) for c in CLASS_ORDER}
        self.policy = AdmissionPolicy(
            max_wait_s=waits,
            queue_waves=rng.choice([0.5, 1.0, 2.0]),
            backfill_waves=rng.choice([0.0, 0.5, 1.0]),
        )
        self.core = AdmissionCore(self.policy, clock=lambda: self.now)
        self.live: dict[int, Ticket] = {}  # tickets that have not ended
        self.prev: dict[int, tuple[TicketState, bool]] = {}
        self.all: list[Ticket] = []
        self.over: dict[str, int] = {}  # node -> active count allowed above share (pre-shrink leases)
        self.sessions = [f"s{i}" for i in range(rng.choice([2, 6]))]
        self.grant_order: dict[str, list[int]] = {}
        self.retries: set[int] = set()  # ids of resubmitted tickets
        self.set_random_shares()

    # --- operations -------------------------------------------------------------------------

    def set_random_shares(self) -> list[Ticket]:
        rng = self.rng
        shares = {n: rng.choice([0, 1, 2, 3, 4]) for n in NODES if rng.random() < 0.8}
        full = {n: s + rng.choice([0, 0, 2]) for n, s in shares.items()}
        snap = self.core.snapshot()
        before = {n: share_of(snap, n) for n in NODES}
        changes = self.core.set_shares(shares, full)
        snap = self.core.snapshot()
        for n in NODES:
            if share_of(snap, n) < before[n]:
                self.over[n] = max(self.over.get(n, 0), self.core.active_on(n))
        return changes

    def step(self) -> None:
        rng = self.rng
        core = self.core
        r = rng.random()
        new: Ticket | None = None
        if r < 0.42:
            slots = 1 if rng.random() < 0.75 else rng.randint(2, 5)
            cls = rng.choice(CLASS_ORDER)
            sid = rng.choice(self.sessions) if rng.random() < 0.5 else None
            if rng.random() < 0.1:  # a retry: avoids the nodes that failed it, keeps its deadline
                avoid = frozenset(rng.sample(NODES, rng.choice([1, 1, 2])))
                deadline = self.now + rng.choice([-0.5, 0.0, 0.5, 2.0, 5.0])
                new = core.submit(slots, cls, sid, avoid=avoid, deadline=deadline)
                self.retries.add(new.id)
            else:
                new = core.submit(slots=slots, request_class=cls, session_id=sid)
            changes = core.last_changes
            self.all.append(new)
            self.live[new.id] = new
            self.prev[new.id] = (Q, False)
        elif r < 0.62:
            granted = [t for t in self.live.values() if t.state is G]
            changes = core.release(rng.choice(granted)) if granted else []
        elif r < 0.70:
            queued = [t for t in self.live.values() if t.state is Q]
            changes = core.cancel(rng.choice(queued)) if queued else []
        elif r < 0.82:
            self.now += rng.choice([0.05, 0.3, 1.0, 2.5])
            changes = core.expire()
            for t in self.live.values():
                assert t.state is not Q or t.deadline > self.now, f"{t} outlived its deadline"
        elif r < 0.87:
            changes = core.promote_session(rng.choice(self.sessions))
        elif r < 0.95:
            changes = self.set_random_shares()
        else:
            # same shares again: nothing may change, not even DRR/backfill state
            snap = core.snapshot()
            changes = core.set_shares(
                {n: v["share"] for n, v in snap["nodes"].items()},
                {n: v["full_capacity"] for n, v in snap["nodes"].items()},
            )
            assert changes == []
            assert core.snapshot() == snap
        # a release of a granted ticket is not a state change, only a flag
        self.check(changes, new)

    # --- invariants -------------------------------------------------------------------------

    def check(self, changes: list[Ticket], new: Ticket | None) -> None:
        core = self.core
        snap = core.snapshot()
        changed_ids = {t.id for t in changes}
        assert len(changed_ids) == len(changes), "a ticket reported twice in one call"
        granted_now: list[Ticket] = []
        for tid, t in list(self.live.items()):
            st, rel = self.prev[tid]
            if t.state is not st:
                assert st is Q, f"{t} left a final state {st}"
                assert tid in changed_ids, f"{t} changed state without being reported"
                if t.state is G:
                    granted_now.append(t)
                    assert t.node is not None and t.reason is None
                    assert t.node not in t.avoid, f"{t} placed on a node it avoids"
                else:
                    assert t.reason is not None and t.reason.code in FAILURES
            else:
                assert tid not in changed_ids or (new is not None and tid == new.id), (
                    f"{t} reported unchanged"
                )
            if st is G:
                assert t.state is G, "a granted ticket changed state"
                assert not (rel and not t.released), "un-released"
            self.prev[tid] = (t.state, t.released)
            if done(t):
                del self.live[tid]
        for t in changes:
            assert t.id in self.prev, "unknown ticket reported"
        # bookkeeping is exact (no leaked slot) and placement respects shares
        per_node: Counter[str] = Counter()
        queued_slots = 0
        leases: Counter[str] = Counter()
        for t in self.live.values():
            if t.state is G:
                assert t.node is not None
                per_node[t.node] += t.slots
                if t.session_id is not None:
                    leases[t.session_id] += 1
            elif t.state is Q:
                queued_slots += t.slots
        assert snap["active"] == sum(per_node.values())
        for n in set(per_node) | set(NODES):
            a = core.active_on(n)
            assert a == per_node[n], (n, a, per_node[n])
            share = share_of(snap, n)
            allowed = max(share, self.over.get(n, 0))
            assert a <= allowed, (
                f"node {n}: active {a} > share {share} (pre-shrink allowance {self.over.get(n)})"
            )
            self.over[n] = a if a > share else 0  # above the share it may only drain
        assert snap["queued_slots"] == queued_slots
        assert queued_slots <= snap["queue_bound_slots"], (queued_slots, snap["queue_bound_slots"])
        assert all(v <= 1 for v in leases.values()), f"more than one lease per session: {leases}"
        if core.capacity == 0:
            assert queued_slots == 0
        # session FIFO: a grant never passes an older queued request of the same session
        for t in granted_now:
            if t.session_id is None:
                continue
            for o in self.live.values():
                if o.session_id == t.session_id and o.state is Q:
                    assert o.id > t.id, f"{t} granted before older {o}"
            order = self.grant_order.setdefault(t.session_id, [])
            assert not order or order[-1] < t.id
            order.append(t.id)
        # every queued gang can still fit a share
        max_share = max((share_of(snap, n) for n in NODES), default=0)
        for t in self.live.values():
            if t.state is Q:
                assert t.slots <= max_share
        self.check_work_conserving(snap)
        # lazily deleted entries stay bounded
        for q in core._qlist:
            assert len(q.arrivals) <= 2 * q.n + 65
            assert len(q.moved_newest) <= 2 * q.n + 65
            for h in q.heads.values():
                assert len(h.fifo) + len(h.late) <= 2 * h.n + 65

    def check_work_conserving(self, snap: dict) -> None:
        """No slot is left idle that an eligible waiter could use, unless a gang holds a reservation."""
        # a queued retry waits only while no node it may use has room (it goes before everyone)
        for t in self.live.values():
            if t.state is Q and t.id in self.retries:
                for n, v in snap["nodes"].items():
                    assert n in t.avoid or v["share"] - v["active"] < t.slots, f"{t} could run on {n}"
        bf = snap["backfill"]
        if bf["reserved"]:
            return
        free = max_free(snap)
        if free <= 0:
            return
        limit = free
        if bf["gang_ticket"] is not None:
            limit = min(free, bf["budget_slots"] - bf["used_slots"])
            if limit <= 0:
                return
        busy = {t.session_id for t in self.live.values() if t.state is G and t.session_id is not None}
        seen_sessions: set[str] = set()
        oldest: dict[RequestClass, Ticket] = {}
        fitting: list[Ticket] = []
        for t in sorted((t for t in self.live.values() if t.state is Q), key=lambda t: t.id):
            if t.id in self.retries:
                continue  # checked above
            if t.session_id is not None:
                if t.session_id in busy or t.session_id in seen_sessions:
                    seen_sessions.add(t.session_id)
                    continue
                seen_sessions.add(t.session_id)
            if t.id == bf["gang_ticket"]:
                continue
            oldest.setdefault(t.request_class, t)
            if t.slots <= limit:
                fitting.append(t)
        for c, t in oldest.items():
            if bf["gang_ticket"] is None:
                raise AssertionError(f"eligible {t} waits while {free} slots are free ({c})")
        if bf["gang_ticket"] is not None:
            for t in fitting:
                raise AssertionError(f"eligible {t} could backfill {limit} free slots")

    def finish(self) -> None:
        core = self.core
        for t in list(self.live.values()):
            if t.state is Q:
                core.cancel(t)
        for t in list(self.live.values()):
            if t.state is G:
                core.release(t)
                core.release(t)  # idempotent
        for t in list(self.live.values()):  # releases may have granted queued ones: none are left
            assert done(t) or t.state is G
            core.release(t)
        assert core.active == 0 and core.queued_slots == 0 and core.queued_requests == 0
        assert all(core.active_on(n) == 0 for n in NODES)
        assert core.snapshot()["sessions"] == 0
        assert all(done(t) for t in self.all)
        outcomes = core.snapshot()["outcomes"]
        assert sum(sum(v.values()) for v in outcomes.values()) == len(self.all), "each ticket ends once"


@pytest.mark.timeout(120)
def test_random_walks_keep_invariants() -> None:
    for seed in range(SEEDS):
        w = Walk(seed)
        try:
            for _ in range(OPS):
                w.step()
            w.finish()
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc


def _saturated_shares(seed: int, sizes: tuple[int, ...]) -> dict[RequestClass, float]:
    rng = random.Random(seed)
    now = [0.0]
    core = AdmissionCore(AdmissionPolicy(queue_waves=50.0), clock=lambda: now[0])
    core.set_shares({"d1": 4, "d2": 4})
    granted: list[Ticket] = []
    slots: Counter[RequestClass] = Counter()
    queued: Counter[RequestClass] = Counter()

    def note(changes: list[Ticket], new: Ticket | None, count: bool) -> None:
        for g in changes:
            assert g.state is G
            granted.append(g)
            if g is not new:
                queued[g.request_class] -= 1
            if count:
                slots[g.request_class] += g.slots

    def top_up(count: bool) -> None:
        for c in CLASS_ORDER:
            while queued[c] < 12:
                t = core.submit(slots=rng.choice(sizes), request_class=c)
                if t.state is Q:
                    queued[c] += 1
                note(core.last_changes, t, count)

    top_up(False)
    for i in range(6000):
        t = granted.pop(rng.randrange(len(granted)))
        note(core.release(t), None, i >= 200)
        top_up(i >= 200)
    total = sum(slots.values())
    return {c: slots[c] / total for c in CLASS_ORDER}


@pytest.mark.parametrize("sizes", [(1,), (1, 1, 1, 2), (1, 2, 3)])
def test_long_run_saturated_shares_follow_weights(sizes: tuple[int, ...]) -> None:
    got = _saturated_shares(7, sizes)
    want = {
        RequestClass.CONTINUATION: 8 / 12,
        RequestClass.PROBABLE_CACHE_HIT: 3 / 12,
        RequestClass.COLD: 1 / 12,
    }
    for c in CLASS_ORDER:
        assert abs(got[c] - want[c]) <= 0.05 * want[c], f"{c.name}: {got[c]:.4f} vs {want[c]:.4f} ({got})"
