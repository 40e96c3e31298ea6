"""Randomised protocol simulation of strict handover (DESIGN §4), in virtual time.

Real agent and master cores, simulated network and failures (see ``pdcoord/dev/protocol_model.py``). Seeds:
``PDCOORD_SIM_SEEDS`` (default 200 per mode, as CI runs).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

from nodeagent.handover import START_SEEN_S
from nodeagent.slicing import PEER_DETECT_S, PEER_DETECT_SLACK_S
from pdcoord.dev.protocol_model import ProtocolSim, SimConfig

# The scenario bench/handover_long_leases.py counts (it defines it so that it runs on older trees too).
sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from handover_long_leases import config as decode_length_config

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


def test_a_master_with_a_longer_keepalive_is_allowed_what_it_advertises() -> None:
    """Strict handover frees a departed master's slots only on engine samples taken after the master
    could have noticed the lost stream (``peer_detect_s``). A master with ``--keepalive 3`` notices a
    cut stream within 4 s and says so in etcd; agents that allow it that (plus slack) keep strict
    handover exact, agents that allow the default 1.75 s (an older release, which does not read it)
    do not: 12 of seeds 0-299 overshoot (7, 73, 153, ...), none with the allowance. (At the default
    detection of 1.65 s the model no longer finds a shorter allowance that overshoots since samples
    count only leases kept across them: none in seeds 0-199 at 1 s, 2 at 0.1 s; the earlier Acks
    overshot with 1 s in seed 62.)"""
    cfg = SimConfig(
        handover="strict",
        policy="static",
        chaos_s=20.0,
        settle_s=5.0,
        master_detect_s=4.0,
        agent_detect_s=3.35 + 1.0,  # the agents ping such a master after 3.35 s (master_channel_options)
        peer_detect_s=4.0 + PEER_DETECT_SLACK_S,
    )
    for seed in (7, 73, 0, 1, 2):
        assert not ProtocolSim(cfg, seed).run().violations, seed
    for seed in (7, 73):
        assert ProtocolSim(dataclasses.replace(cfg, peer_detect_s=PEER_DETECT_S), seed).run().violations, seed


def churn_config(policy: str) -> SimConfig:
    """The demand benchmark's scenario, small: a master joins, one drains, the busiest dies."""
    return SimConfig(
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


@pytest.mark.parametrize("policy", ["static", "demand"])
def test_scheduled_churn_under_skewed_load_keeps_the_invariant_and_converges(policy: str) -> None:
    """A master joins, one drains, the busiest dies: strict handover holds and every node reaches
    its targets within 15 s of each event (all 40 runs of seeds 0-19 with either policy do)."""
    for seed in range(3):
        sim = ProtocolSim(churn_config(policy), seed)
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


def test_known_gap_a_master_of_an_earlier_release_that_drained_unannounced_holds_its_slots() -> None:
    """A master whose drain ends before any of its Acks told an agent it drains (nothing had changed
    to report) and that revokes its key without marking it drained (an earlier release) leaves its
    slots reserved as for a master that may still be alive; under this steady stream of short leases
    the bracketed samples rarely free the last of them: 10 of the 40 runs of seeds 0-19 did not
    converge within 15 s of the drain (static 2, 15-18; demand 0, 2, 13, 15, 19). This release marks
    its key drained just before the revocation, and none of the 40 stays unconverged."""
    old = dataclasses.replace(churn_config("static"), drained_keys=False)
    stats = ProtocolSim(old, 2).run()
    assert [c for _, k, _, c in stats.convergence if k == "drain"] == [None]
    stats = ProtocolSim(dataclasses.replace(old, drained_keys=True), 2).run()
    assert all(c is not None and c < 15.0 for *_, c in stats.convergence), stats.convergence


LONG_SEEDS = int(os.environ.get("PDCOORD_SIM_LONG_SEEDS", "20"))


@pytest.mark.parametrize("hold_s", [3.0, 10.0])
@pytest.mark.parametrize("policy", ["static", "demand"])
def test_strict_handover_holds_with_decode_length_leases(policy: str, hold_s: float) -> None:
    """The scenarios above hold leases for 0.3 s, so a departed master's leases have ended before an
    engine sample may free its slots. With leases as long as decodes a sample set against the live
    masters' acked counts freed slots a cut-off master still used, whenever a live master's Ack
    predated some of its lease ends (4 to 8 seeds in 100). A sample now counts for a live master only
    the leases it kept between an Ack just before the sample and one just after (Ack.kept_slots)."""
    for seed in range(LONG_SEEDS):
        sim = ProtocolSim(decode_length_config(policy, hold_s), seed)
        stats = sim.run()
        assert not stats.violations, f"seed {seed}: {stats.violations[:3]}; faults {stats.faults}"
        assert not sim.converged(), f"seed {seed}: not converged: {sim.converged()}"


def test_known_gap_masters_of_an_earlier_release_leave_a_stale_ack_unbracketed() -> None:
    """Masters of an earlier release send no kept_slots: their acked counts stand in, as before, and
    an Ack older than one of their lease ends can still free a cut-off master's running slots
    (``nodeagent/handover.py``, "Known gap"): 3 of seeds 60-199 overshoot (8 before a master that
    came back was granted the leases it still runs at once, which moved every run). The same scenario
    with this release's masters holds in all of them."""
    old = dataclasses.replace(
        decode_length_config("static", 10.0), settle_s=15.0, quiet_s=5.0, kept_acks=False, drained_keys=False
    )
    assert ProtocolSim(old, 108).run().violations
    new = dataclasses.replace(old, kept_acks=True, drained_keys=True)
    assert not ProtocolSim(new, 108).run().violations


# Leases whose client falls behind until the relay pauses, and how long after the decode such a client
# has the answer: more and slower than in practice, so that many runs have such leases at a failover.
SLOW_CLIENTS = {"slow_fraction": 0.1, "relay_mean_s": 2.0}


@pytest.mark.parametrize("hold_s", [3.0, 10.0])
@pytest.mark.parametrize("policy", ["static", "demand"])
def test_strict_handover_holds_with_slow_clients(policy: str, hold_s: float) -> None:
    """A master learns that a decode ended only when the engine's last bytes reach it, and releases a
    slow client's lease once that client has caught up, seconds later; the engine stopped counting
    it at the last token. This release leaves such leases out of kept_slots from the moment its
    relay paused (end_unseen), and the Reports that close a sample's bracket go END_SEEN_S after the
    sample, so a sample never counts a lease as surely running after its decode ended. (In seeds
    0-99 no bracketed sample counted more of a live master's leases than the engine ran at it;
    masters of the earlier release did so in 35 to 64 of them: see the next test.)"""
    cfg = dataclasses.replace(decode_length_config(policy, hold_s), **SLOW_CLIENTS)
    slow = 0
    for seed in range(LONG_SEEDS):
        sim = ProtocolSim(cfg, seed)
        stats = sim.run()
        assert not stats.violations, f"seed {seed}: {stats.violations[:3]}; faults {stats.faults}"
        assert not sim.converged(), f"seed {seed}: not converged: {sim.converged()}"
        slow += stats.slow_leases
    assert slow > LONG_SEEDS  # (a run with little traffic may have none)


def test_known_gap_masters_of_an_earlier_release_count_a_relayed_lease_as_running() -> None:
    """Masters of the earlier release hold a lease until a slow client has its last bytes and count
    it in kept_slots until then: a sample after its decode ended sees it no longer running, sets the
    master's kept count against it and frees slots a cut-off master still uses. In seeds 0-99 of
    this scenario 3 overshoot (17, 49, 58; 17 and 58 by this), and bracketed samples counted a lease
    the engine had finished in 35 of them; with this release's masters none did (49 overshot by
    another cause, fixed since: see the next test). Here seed 17: a master kept 3 leases, the engine
    ran 2 of them."""
    old = dataclasses.replace(decode_length_config("static", 10.0), lease_end="relay", **SLOW_CLIENTS)
    assert ProtocolSim(old, 17).run().violations
    assert not ProtocolSim(dataclasses.replace(old, lease_end="seen"), 17).run().violations


def test_known_gap_a_drain_timeout_of_an_earlier_release_frees_slots_its_requests_use() -> None:
    """A master of an earlier release whose drain timed out revoked its key with requests still
    running, and agents that had an Ack saying it drains with nothing queued set what it left
    reserved against the acked counts, as for a master whose requests all ended. This release
    cancels them first and marks the key drained once nothing runs. The window is a fraction of a
    second; with the bracket closed at once (end_seen_s=0) the model finds it in seed 80 of 100
    (decode-length leases of 3 s), and not with this release's masters."""
    old = dataclasses.replace(decode_length_config("static", 3.0), end_seen_s=0.0, drained_keys=False)
    assert ProtocolSim(old, 80).run().violations
    assert not ProtocolSim(dataclasses.replace(old, drained_keys=True), 80).run().violations


@pytest.mark.parametrize(
    ("policy", "hold_s", "extra", "seed"),
    [
        ("static", 10.0, SLOW_CLIENTS, 49),
        ("demand", 10.0, {"end_seen_s": 0.0}, 5),
        ("static", 3.0, {"end_seen_s": 0.0}, 58),
    ],
)
def test_orphans_cut_together_stay_reserved_together(
    policy: str, hold_s: float, extra: dict[str, float], seed: int
) -> None:
    """A sample that cuts several orphans bounds what their masters run together, and the cut goes
    in name order, so what is left of one may cover another's leases. These seeds overshot when one
    of those masters came back (or said what it still ran) and its orphan went with it alone, taking
    slots that covered the other's leases (the agent's startup reservation and m1 in seed 49). Its
    slots now stay reserved under the pool's name (``Handover._unpool``) until a sample frees them."""
    cfg = dataclasses.replace(decode_length_config(policy, hold_s), **extra)
    sim = ProtocolSim(cfg, seed)
    stats = sim.run()
    assert not stats.violations, stats.violations[:3]
    assert not sim.converged(), sim.converged()


# Agents and masters of this release: a sample counts every request the engine holds, taken
# START_SEEN_S after the Acks that open its bracket, and masters count a lease in kept_slots from its
# decode request and send none to a node whose stream they lost. The agent polls during a handover
# only the masters whose Ack can move it on, as NodeAgent does: polling all of them at 10 Hz voids
# most brackets once the sample waits.
THIS_RELEASE: dict[str, object] = {
    "sample_counts": "held",
    "start_seen_s": START_SEEN_S,
    "kept_from": "sent",
    "polling": "worth",
    "unsent_on_loss": "cancel",
    "released_keys": True,
}
# The release before: the running count, taken as soon as the Acks are in; leases from their grant.
EARLIER_RELEASE: dict[str, object] = {
    "sample_counts": "running",
    "start_seen_s": 0.0,
    "kept_from": "grant",
    "polling": "worth",
    "unsent_on_loss": "send",
}


def prefill_config(policy: str, hold_s: float, protocol: str, release: dict[str, object]) -> SimConfig:
    """Decode-length leases with a prefill of 1 s on average before each decode."""
    return dataclasses.replace(
        decode_length_config(policy, hold_s), prefill_mean_s=1.0, protocol=protocol, **release
    )


@pytest.mark.parametrize("hold_s", [3.0, 10.0])
@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_strict_handover_holds_with_leases_in_their_prefill(protocol: str, hold_s: float) -> None:
    """A lease's decode request reaches the engine at grant (SGLang) or once its prefill is over
    (vLLM), and waits there for its KV before it runs. A sample that counts every request the engine
    holds, START_SEEN_S after the opening Acks, and masters that count a lease once its decode request
    went out, and send none to a node whose stream they lost, keep strict handover exact: in seeds
    0-99 of each of these scenarios (static or demand, 3 or 10 s) none overshoots under either
    protocol (see the last test for vLLM's cut-off master). Agents and masters of the
    earlier release overshoot in 9 to 13 of 100 under SGLang and 12 to 16 under vLLM; their bracketed
    samples counted more of a live master's leases than the engine held in 79 to 88 of 100, this
    release's in none."""
    cfg = prefill_config("demand", hold_s, protocol, THIS_RELEASE)
    for seed in range(LONG_SEEDS):
        sim = ProtocolSim(cfg, seed)
        stats = sim.run()
        assert not stats.violations, f"seed {seed}: {stats.violations[:3]}; faults {stats.faults}"
        assert not sim.converged(), f"seed {seed}: not converged: {sim.converged()}"


@pytest.mark.parametrize(("protocol", "seed"), [("sglang", 12), ("vllm", 43)])
def test_known_gap_agents_of_an_earlier_release_count_only_running_requests(protocol: str, seed: int) -> None:
    """Earlier agents sampled only the engine's running requests, and masters counted a lease in
    kept_slots from its grant: a live master's lease kept across both Acks but still in its prefill,
    or waiting for its KV, counted as running at the sample, which the engine did not count, and the
    sample freed slots a cut-off master still used. Under vLLM's protocol the engine does not know
    such a lease at all, so the masters' part is needed too: with the agents' part alone (the held
    count, START_SEEN_S) 24 to 39 of 100 still overshoot (seed 43 here), with both 1 (the next test).
    Seeds 0-99, static or demand, leases of 3 or 10 s."""
    old = prefill_config("static", 3.0, protocol, EARLIER_RELEASE)
    assert ProtocolSim(old, seed).run().violations
    new = prefill_config("static", 3.0, protocol, THIS_RELEASE)
    assert not ProtocolSim(new, seed).run().violations
    if protocol == "vllm":
        agents_only = dataclasses.replace(new, kept_from="grant", unsent_on_loss="send", released_keys=False)
        assert ProtocolSim(agents_only, seed).run().violations


def test_a_cut_off_master_sends_no_decode_request_to_the_node_it_lost_under_vllm() -> None:
    """Under vLLM's protocol a master sends a lease's decode request once its prefill is over. Masters
    of the earlier release sent it even to a node whose stream they had lost meanwhile: a lease
    granted before the loss and still in its prefill when the agent may free the master's slots
    (peer_detect_s after the stream was last up) is in no engine count, and the sample frees its slot
    (1 run in 100 in each scenario with decode leases of 3 or 10 s and a mean prefill of 1 s, seed 43
    here; none at 0.3 s). This release's masters refuse to send it (``pipeline._still_held``; the
    request goes round again on another pair). With that, 4 of these 800 runs overshot by another
    cause, fixed since (seed 82 with 3 s leases and 1 s of prefill, 96 with 10 s and 0.3 s, under
    either policy): an orphan cut together with another master's was set, once its own master was
    found gone, against the acked counts as if it covered only its own leases, and those counts
    include leases still in their prefill. It now stays with the live ones (``Handover._gone``)."""
    cfg = prefill_config("static", 3.0, "vllm", THIS_RELEASE)
    assert ProtocolSim(dataclasses.replace(cfg, unsent_on_loss="send"), 43).run().violations
    for seed in (43, 82):
        assert not ProtocolSim(cfg, seed).run().violations, seed


@pytest.mark.parametrize("policy", ["static", "demand"])
@pytest.mark.parametrize("seeds", CHUNKS, ids=lambda r: f"seeds{r.start}-{r.stop - 1}")
def test_released_streams_free_slots_at_once_and_keep_strict_handover_exact(
    policy: str, seeds: range
) -> None:
    """Masters of this release name a node whose stream they lost in their etcd key once they hold no
    share there, with the slots their leases there still run, and the agent frees the rest on that
    word (short leases, resets, partitions, crashes, joins and leaves). The first version accepted a
    word that came in after the agent had opened the next stream with the master's grant of the
    moment: 9 of seeds 0-199 overshot under the even split, 12 under demand shares; the word now
    names the last stream opened."""
    released = 0
    for seed in seeds:
        sim = ProtocolSim(dataclasses.replace(_config(policy), **THIS_RELEASE), seed)
        stats = sim.run()
        assert not stats.violations, f"seed {seed}: {stats.violations[:3]}; faults {stats.faults}"
        problems = sim.converged()
        assert not problems, f"seed {seed}: not converged after the stable phase: {problems}"
        released += stats.released
    assert released > 0, "no master's word freed anything: the test exercised nothing"


def _behind_resets(policy: str) -> SimConfig:
    """Faults that include a link answering with resets for 1-6 s (reject_faults)."""
    return dataclasses.replace(_config(policy), **THIS_RELEASE, reject_faults=True)


def test_known_gap_an_agent_that_takes_a_refusal_for_death_overshoots_behind_resets() -> None:
    """An agent takes a master whose address refuses connections for a dead process (the default:
    SIGKILL failover in a fraction of a second), and sets its slots against the acked counts. Behind a
    firewall that rejects, a live master refuses too, and until it notices the cut it goes on placing
    work under its share: 25 of seeds 0-199 overshoot under the even split, 23 under demand shares
    (seed 6 here). ``--no-gone-on-refusal`` leaves such a master to the grace (the next test)."""
    cfg = _behind_resets("demand")
    assert ProtocolSim(cfg, 6).run().violations
    assert not ProtocolSim(dataclasses.replace(cfg, gone_on_refusal=False), 6).run().violations


@pytest.mark.parametrize("policy", ["static", "demand"])
@pytest.mark.parametrize("seeds", CHUNKS, ids=lambda r: f"seeds{r.start}-{r.stop - 1}")
def test_behind_resets_an_agent_that_distrusts_refusals_keeps_strict_handover_exact(
    policy: str, seeds: range
) -> None:
    """With --no-gone-on-refusal a refused connection proves nothing: none of seeds 0-199 overshoots,
    with links that reject besides the other faults."""
    rejects = 0
    for seed in seeds:
        sim = ProtocolSim(dataclasses.replace(_behind_resets(policy), gone_on_refusal=False), seed)
        stats = sim.run()
        assert not stats.violations, f"seed {seed}: {stats.violations[:3]}; faults {stats.faults}"
        problems = sim.converged()
        assert not problems, f"seed {seed}: not converged after the stable phase: {problems}"
        rejects += stats.faults.get("reject", 0)
    assert rejects > 0, "no link rejected: the test exercised nothing"


# Nodes with a KV pool (DESIGN §13): leases charge 100-1000 tokens each, so a node's tokens run out
# before its slots about as often as not (d1: 8 slots, 4000 tokens; d2: 5 slots, 2500 tokens).
POOLS = {"d1": 4000, "d2": 2500}
TOKEN_SEEDS = int(os.environ.get("PDCOORD_SIM_TOKEN_SEEDS", "20"))


@pytest.mark.parametrize("policy", ["static", "demand"])
def test_token_shares_never_oversubscribe_the_pool_and_converge(policy: str) -> None:
    """Σ of the token charges the engine will hold, and Σ max(token share, those charges), stay within
    every node's pool through the same failovers, drains, partitions and agent restarts as slots."""
    fullest = 0.0
    for seed in range(TOKEN_SEEDS):
        sim = ProtocolSim(dataclasses.replace(_config(policy), kv_tokens=POOLS), seed)
        stats = sim.run()
        assert not stats.violations, f"seed {seed}: slots above capacity {stats.violations[:5]}"
        assert not stats.token_violations, (
            f"seed {seed}: tokens above the pool {POOLS} at (t, node, excess, what) "
            f"{stats.token_violations[:5]}; faults {stats.faults}"
        )
        problems = sim.converged()
        assert not problems, f"seed {seed}: not converged after the stable phase: {problems}"
        assert sum(stats.granted.values()) > 0
        fullest = max([fullest, *(stats.max_token_running.get(n, 0) / p for n, p in POOLS.items())])
    assert fullest > 0.8  # the pools did fill: tokens, not slots, bounded the leases at times


def test_the_model_catches_token_overshoot_in_fast_mode() -> None:
    """Fast handover hands tokens on at once: the same scenarios must show the token overshoot."""
    cfg = dataclasses.replace(_config("static", "fast"), kv_tokens=POOLS)
    violating = sum(bool(ProtocolSim(cfg, seed).run().token_violations) for seed in range(10))
    assert violating >= 3, f"only {violating}/10 fast-mode runs overshot the pool"
