"""Randomised protocol simulation of strict handover (DESIGN §4), in virtual time.

Real agent and master cores, simulated network and failures (see ``pdcoord/dev/protocol_model.py``). Seeds:
``PDCOORD_SIM_SEEDS`` (default 200 per mode, as CI runs).
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from nodeagent.slicing import PEER_DETECT_S, PEER_DETECT_SLACK_S
from pdcoord.dev.protocol_model import ProtocolSim, SimConfig

SEEDS = int(os.environ.get("PDCOORD_SIM_SEEDS", "200"))
CHUNK = 20
CHUNKS = [range(i, min(i + CHUNK, SEEDS)) for i in range(0, SEEDS, CHUNK)]


def _config(policy: str, handover: str = "strict") -> SimConfig:
    return SimConfig(handover=handover, policy=policy, chaos_s=20.0, settle_s=15.0)


@pytest.mark.parametrize("policy", ["static", "demand"])
@pytest.mark.parametrize("seeds", CHUNKS, ids=lambda r: f"seeds{r.start}-{r.stop - 1}")
def test_strict_handover_never_oversubscribes_and_converges(policy: str, seeds: range) -> None:
    for seed in seeds:
        sim = ProtocolSim(_config(policy), seed)
        stats = sim.run()
        assert not stats.violations, (
            f"seed {seed}: Σ usable above capacity {sim.cfg.nodes} at (t, node, usable) "
            f"{stats.violations[:5]}; faults {stats.faults}"
        )
        problems = sim.converged()
        assert not problems, f"seed {seed}: not converged after the stable phase: {problems}"
        assert sum(stats.faults.values()) > 0 and sum(stats.granted.values()) > 0


def test_the_model_catches_overshoot_in_fast_mode() -> None:
    """Fast handover overlaps old and new shares: the same scenarios must show it, or the check is blind."""
    violating = 0
    for seed in range(10):
        sim = ProtocolSim(_config("static", handover="fast"), seed)
        stats = sim.run()
        violating += bool(stats.violations)
        assert not sim.converged(), f"seed {seed}: fast mode did not converge: {sim.converged()}"
    assert violating >= 5, f"only {violating}/10 fast-mode runs overshot"


def test_the_agents_allow_masters_as_long_as_their_keep_alive_needs() -> None:
    """Strict handover frees a departed master's slots only on engine samples taken after the master
    could have noticed the lost stream (``peer_detect_s``). Allowing the previous second against
    today's detection (up to 1.65 s) oversubscribes in this scenario (two partitions, crashes,
    leaves); the default allowance does not. Found by searching 100 seeds; it keeps the check seeing."""
    cfg = SimConfig(handover="strict", policy="static", chaos_s=20.0, settle_s=5.0, master_detect_s=1.65)
    assert ProtocolSim(dataclasses.replace(cfg, peer_detect_s=1.0), 62).run().violations
    assert not ProtocolSim(cfg, 62).run().violations


def test_a_master_with_a_longer_keepalive_is_allowed_what_it_advertises() -> None:
    """A master with ``--keepalive 3`` notices a cut stream within 4 s and says so in etcd; agents
    that allow it that (plus slack) keep strict handover exact, agents that allow the default 1.75 s
    (an older release, which does not read it) do not. Seeds found by searching 40."""
    cfg = SimConfig(
        handover="strict",
        policy="static",
        chaos_s=20.0,
        settle_s=5.0,
        master_detect_s=4.0,
        agent_detect_s=3.35 + 1.0,  # the agents ping such a master after 3.35 s (master_channel_options)
        peer_detect_s=4.0 + PEER_DETECT_SLACK_S,
    )
    for seed in (17, 18, 19, 0, 1, 2):
        assert not ProtocolSim(cfg, seed).run().violations, seed
    assert ProtocolSim(dataclasses.replace(cfg, peer_detect_s=PEER_DETECT_S), 17).run().violations


@pytest.mark.parametrize("policy", ["static", "demand"])
def test_scheduled_churn_under_skewed_load_keeps_the_invariant_and_converges(policy: str) -> None:
    """The demand benchmark's scenario, small: a master joins, one drains, the busiest dies."""
    for seed in range(3):
        cfg = SimConfig(
            nodes={"d1": 16, "d2": 8, "d3": 5},
            masters=("m1", "m2", "m3", "mj"),
            start_masters=("m1", "m2", "m3"),
            policy=policy,
            chaos_s=5.0,
            settle_s=40.0,
            fault_every_s=0.0,
            quiet_s=0.0,
            rates={"m1": 70.0, "m2": 20.0, "m3": 10.0, "mj": 20.0},
            churn=((10.0, "join", "mj"), (20.0, "drain", "m2"), (30.0, "die", "m1")),
            restart_left=False,
        )
        sim = ProtocolSim(cfg, seed)
        stats = sim.run()
        assert not stats.violations, f"seed {seed}: {stats.violations[:5]}"
        assert [(k, m) for _, k, m, _ in stats.convergence] == [
            ("join", "mj"),
            ("drain", "m2"),
            ("die", "m1"),
        ]
        assert all(c is not None and c < 15.0 for *_, c in stats.convergence), stats.convergence
        # The dead master's traffic went to the survivors; the drained one took none after it left.
        assert not sim.masters["m1"].alive and not sim.masters["m2"].alive
        assert stats.granted.get("mj", 0) > 0


def test_known_gap_decode_length_leases_and_stale_acks_oversubscribe() -> None:
    """Pins a known gap (``nodeagent/handover.py``, "Known gap"). The scenarios above hold leases
    for 0.3 s on average, so a departed master's leases have ended before an engine sample may free
    its slots, and the gap stays hidden. With leases as long as decodes (3 s here, the same offered
    load) a sample compared with a live master's Ack that predates some of its lease ends frees slots
    the departed master still uses: seed 9 puts 6 on d2's 5 slots (4 seeds in 100 do; 6 to 8 with
    10 s leases). When the release rule is fixed, make this a guarantee over many seeds."""
    cfg = SimConfig(
        handover="strict",
        policy="static",
        chaos_s=20.0,
        settle_s=15.0,
        hold_mean_s=3.0,
        rates=dict.fromkeys(("m1", "m2", "m3"), 4.0),
    )
    violations = ProtocolSim(cfg, 9).run().violations
    assert violations and violations[0][1:] == ("d2", 6)
