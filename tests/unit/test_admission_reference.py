"""The admission core against the core before the re-check caches (same decisions, same answers).

The blocked request and the backfill candidate are asked about again only where a node's room grew
(``Placement.still_none``), ClassQueue.peek_head keeps its answer when a head joins behind a live one,
and the pooled heap updates are inlined: none of this may change a decision. The same random walks
(pools and nodes without one, token- and slot-bound, sessions, gangs, resubmissions, hand-offs,
promotions, share changes, timeouts) and the admission bench's token-bound steady state run through
this core and through the admission modules of ``REFERENCE`` (taken from git into a temporary
directory), and must leave the same trace. Skipped where that commit is not available (a shallow or
exported tree). A later change that alters decisions on purpose moves ``REFERENCE`` past it.
"""

from __future__ import annotations

import importlib
import io
import random
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import pdmaster.admission as current

REFERENCE = "3a22968e94a172e6b223a0fd06a354bf52b57ffe"
MODULES = (
    "ack_ledger",
    "admission",
    "admission_policy",
    "admission_queue",
    "backfill",
    "drr",
    "placement",
    "ticket",
    "wait_estimate",
)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    try:
        tar = subprocess.run(
            ["git", "-C", str(ROOT), "archive", REFERENCE, *(f"pdmaster/{m}.py" for m in MODULES)],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip(f"commit {REFERENCE[:12]} not available")
    pkg = tmp_path_factory.mktemp("ref") / "pdmaster_ref"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        for m in tf.getmembers():
            f = tf.extractfile(m)
            if f is not None:
                src = f.read().decode().replace("pdmaster.", "pdmaster_ref.")
                (pkg / Path(m.name).name).write_text(src)
    sys.path.insert(0, str(pkg.parent))
    try:
        mod: ModuleType = importlib.import_module("pdmaster_ref.admission")
        yield mod
    finally:
        sys.path.remove(str(pkg.parent))
        for name in [n for n in sys.modules if n == "pdmaster_ref" or n.startswith("pdmaster_ref.")]:
            del sys.modules[name]


@pytest.mark.parametrize("seeds", [range(i, i + 25) for i in range(0, 150, 25)], ids=lambda r: f"{r[0]}")
def test_random_walks_decide_as_the_reference(reference: Any, seeds: range) -> None:
    for seed in seeds:
        assert _walk(current, seed, 800) == _walk(reference, seed, 800), f"seed {seed}"


@pytest.mark.parametrize(("capacity", "waiters"), [(64, 10), (64, 1000), (4096, 3000)])
def test_the_token_bound_bench_decides_as_the_reference(reference: Any, capacity: int, waiters: int) -> None:
    assert _bench_like(current, 1, capacity, waiters, 2500) == _bench_like(
        reference, 1, capacity, waiters, 2500
    )


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _walk(mod: Any, seed: int, ops: int) -> list[Any]:
    """``mod``: an admission module (AdmissionCore, AdmissionPolicy, CLASS_ORDER, TicketState)."""
    rng = random.Random(seed)
    clock = _Clock()
    classes = list(mod.CLASS_ORDER)
    G = mod.TicketState.GRANTED
    Q = mod.TicketState.QUEUED
    n_nodes = rng.choice([1, 3, 8, 16, 24])
    nodes = [f"n{i}" for i in range(n_nodes)]
    regime = rng.random()
    pools = regime < 0.85
    poolless_p = rng.choice([0.0, 0.0, 0.2])
    per_slot = rng.choice([100, 500, 2000, 20000])
    tok_unit = per_slot if rng.random() < 0.6 else max(1, per_slot // 10)
    policy = mod.AdmissionPolicy(
        max_wait_s={c: rng.choice([0.5, 2.0, 50.0]) for c in classes},
        queue_waves=rng.choice([1.0, 4.0, 50.0]),
        backfill_waves=rng.choice([0.0, 0.5, 1.0, 3.0]),
    )
    core = mod.AdmissionCore(policy, clock=clock)
    trace: list[Any] = []
    live: dict[int, Any] = {}
    sessions = [f"s{i}" for i in range(rng.choice([1, 4, 20]))]

    def note(tag: str, changes: list[Any]) -> None:
        trace.append(
            (
                tag,
                [
                    (
                        t.id,
                        t.state.value,
                        t.node,
                        None if t.reason is None else (t.reason.code, t.reason.retry_after_s),
                    )
                    for t in changes
                ],
            )
        )

    def shares(partial: bool) -> None:
        chosen = [n for n in nodes if not partial or rng.random() < 0.3]
        slots = {n: rng.choice([0, 1, 2, 4, 8, 16]) for n in chosen}
        ts = None
        tf = None
        if pools:
            ts = {
                n: s * per_slot * rng.choice([1, 1, 2])
                for n, s in slots.items()
                if rng.random() >= poolless_p
            }
            tf = {n: v * rng.choice([1, 2]) for n, v in ts.items()}
        cap = {n: s * rng.choice([1, 2]) for n, s in slots.items()}
        if partial:
            note("update", core.update_shares(slots, cap, ts, tf))
        else:
            note("set", core.set_shares(slots, cap, ts, tf))

    shares(False)
    for step in range(ops):
        clock.now += rng.random() * 0.05
        r = rng.random()
        if r < 0.45:
            slots = rng.choice([1, 1, 1, 1, 2, 4])
            tokens = rng.choice([0, tok_unit // 2, tok_unit, 2 * tok_unit, 4 * tok_unit]) if pools else 0
            kw: dict[str, Any] = {"tokens": tokens}
            x = rng.random()
            if x < 0.05:
                kw["avoid"] = frozenset(rng.sample(nodes, min(len(nodes), rng.choice([1, 2]))))
            elif x < 0.08:
                kw["deadline"] = clock.now + rng.choice([-1.0, 0.5, 3.0])
            elif x < 0.10:
                kw["at_once"] = True
            elif x < 0.13:
                kw["lead_s"] = rng.random()
            t = core.submit(slots, rng.choice(classes), rng.choice([None, None, None, *sessions]), **kw)
            live[t.id] = t
            note("submit", core.last_changes)
        elif r < 0.78:
            granted = [t for t in live.values() if t.state is G and not t.released]
            if granted:
                t = rng.choice(granted)
                if rng.random() < 0.3:
                    core.decode_sent(t)
                note("release", core.release(t))
        elif r < 0.83:
            queued = [t for t in live.values() if t.state is Q]
            if queued:
                note("cancel", core.cancel(rng.choice(queued)))
        elif r < 0.86:
            shares(rng.random() < 0.5)
        elif r < 0.90:
            note("promote", core.promote_session(rng.choice(sessions)))
        elif r < 0.92:
            h = core.handoffs(rng.choice([1, 4]), 3)
            trace.append(("handoffs", [t.id for t in h]))
            if h:
                note("hand_off", core.hand_off(h[0]))
        elif r < 0.94:
            trace.append(
                (
                    "probe",
                    core.can_start_now(1, None, rng.choice([0, per_slot])),
                    core.free_now(),
                    core.expected_wait(rng.choice(classes), 1),
                )
            )
        else:
            note("expire", core.expire())
        if step % 50 == 0:
            live = {i: t for i, t in live.items() if t.state is Q or (t.state is G and not t.released)}
    snap = core.snapshot()
    snap.pop("placement_held_s", None)
    trace.append(("snapshot", repr(snap)))
    return trace


def _bench_like(mod: Any, seed: int, capacity: int, waiters: int, steps: int) -> list[Any]:
    """The admission bench's token-bound steady state, traced."""
    rng = random.Random(seed)
    clock = _Clock()
    classes = list(mod.CLASS_ORDER)
    G = mod.TicketState.GRANTED
    per_node = 8 if capacity <= 64 else 64
    shares = {f"d{i}": per_node for i in range(capacity // per_node)}
    policy = mod.AdmissionPolicy(
        max_wait_s=dict.fromkeys(classes, 1e9), queue_waves=(2 * waiters + 64) / capacity + 1
    )
    core = mod.AdmissionCore(policy, clock=clock)
    core.set_shares(shares, token_shares={n: s * 2000 for n, s in shares.items()})
    sess = [f"s{i}" for i in range(max(1, waiters // 10))]
    trace: list[Any] = []
    leases: list[Any] = []

    def submit() -> None:
        t = core.submit(
            4 if rng.random() < 0.05 else 1,
            rng.choice(classes),
            rng.choice(sess) if rng.random() < 0.2 else None,
            tokens=rng.choice((500, 1000, 2000, 4000, 8000)),
        )
        trace.append((t.id, [(x.id, x.state.value, x.node) for x in core.last_changes]))
        leases.extend(x for x in core.last_changes if x.state is G)

    while core.active < capacity - 4 and core.queued_requests == 0:
        submit()
    while core.queued_requests < waiters:
        submit()
    for _ in range(steps):
        clock.now += 0.001
        if leases:
            i = rng.randrange(len(leases))
            leases[i], leases[-1] = leases[-1], leases[i]
            ch = core.release(leases.pop())
            trace.append(("r", [(x.id, x.state.value, x.node) for x in ch]))
            leases.extend(x for x in ch if x.state is G)
        while core.queued_requests < waiters:
            submit()
    return trace
