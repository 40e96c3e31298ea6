"""Randomised protocol simulation of strict handover (DESIGN §4), in virtual time.

Real agent and master cores, simulated network and failures (see ``pdcoord/dev/protocol_model.py``). Seeds:
``PDCOORD_SIM_SEEDS`` (default 200 per mode, as CI runs).
"""

from __future__ import annotations

import os

import pytest

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
