"""Capacity in KV tokens with real processes (DESIGN §13): engines whose KV pool, not their request
slots, is the limit, long prompts from several masters, one of them killed mid-run.

The decode engines are model-mode pdsim servers with small pools (a few long prompts each) and far
more slots than the pool holds. They count every request that had to wait inside them for KV or a slot
(``pdsim_queued_total``) and every retraction; with token shares and token charges both stay 0, and
every agent's grants stay within its pool at every sample.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import openai
import pytest

from pdcoord.dev.cluster import LocalCluster
from tests.cluster.cluster_helpers import engine_metric, wait_no_leases

pytestmark = pytest.mark.cluster

MODEL = "sim"
POOL = 24_000  # tokens per decode engine: five or six requests of ~3 000 prompt tokens
SLOTS = 64  # far more than the pool holds: the slot bound never binds
DECODES = ("d1", "d2")
ENGINE = {"profile": "llama3-8b-h100", "time_scale": 4, "max_total_tokens": POOL}


def _fleet(cluster: LocalCluster, masters: list[str]) -> None:
    for m in masters:
        cluster.start_master(m, model=MODEL)
    cluster.start_node(
        "p1", "prefill", 16, fast=False, model=MODEL, engine_args=dict(ENGINE, max_total_tokens=None)
    )
    for d in DECODES:
        cluster.start_node(d, "decode", SLOTS, fast=False, model=MODEL, engine_args=ENGINE)

    def tokens_granted() -> bool:
        if not cluster.full_capacity_held(masters, {"p1": 16, **dict.fromkeys(DECODES, SLOTS)}):
            return False
        for m in masters:
            nodes = {n["node_id"]: n for n in cluster.masters[m].admission()["nodes"]}
            if any(nodes.get(d, {}).get("token_share") is None for d in DECODES):
                return False
        return True

    cluster.wait_for(tokens_granted, timeout=60, interval=0.2)


def _grants(cluster: LocalCluster) -> dict[str, int]:
    """Per decode node: Σ token grants of its agent, from one snapshot of the agent."""
    return {d: sum(cluster.agents[d].status()["handover"]["tokens"]["grants"].values()) for d in DECODES}


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 30_000) for _ in range(rng.randrange(2_000, 3_500))]


def test_long_prompts_fill_the_pools_not_the_engines_queues_through_a_master_kill(
    cluster: LocalCluster,
) -> None:
    masters = ["m1", "m2"]
    _fleet(cluster, masters)
    clients = {
        m: openai.OpenAI(base_url=cluster.masters[m].url + "/v1", api_key="x", max_retries=0) for m in masters
    }
    # A prompt no decode pool can ever hold is a bad request, named as such, before anything runs.
    with pytest.raises(openai.BadRequestError) as refused:
        clients["m1"].completions.create(model=MODEL, prompt=[7] * (POOL + 1), max_tokens=8, timeout=30)
    assert refused.value.code == "too_many_tokens", refused.value.body
    assert str(POOL) in refused.value.message, refused.value.message
    stop = threading.Event()
    outcomes: list[str] = []
    samples: list[dict[str, int]] = []

    def user(k: int) -> None:
        rng = random.Random(k)
        while not stop.is_set():
            m = masters[k % 2] if cluster.masters[masters[k % 2]].proc.alive else masters[1 - k % 2]
            try:
                clients[m].completions.create(model=MODEL, prompt=_prompt(rng), max_tokens=24, timeout=60)
                outcomes.append("ok")
            except openai.APIStatusError as exc:
                outcomes.append(str(exc.status_code))
            except openai.APIConnectionError:
                outcomes.append("conn")  # the killed master's requests

    def sampler() -> None:
        while not stop.is_set():
            try:
                samples.append(_grants(cluster))
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)

    threads = [threading.Thread(target=user, args=(k,), daemon=True) for k in range(24)]
    threads.append(threading.Thread(target=sampler, daemon=True))
    for t in threads:
        t.start()
    try:
        cluster.wait_for(lambda: outcomes.count("ok") >= 20, timeout=120, interval=0.2)
        used = max(cluster.masters["m1"].admission()["active_tokens"], 1)
        cluster.masters["m1"].proc.send_signal(signal.SIGKILL)
        cluster.wait_for(lambda: outcomes.count("ok") >= 60, timeout=180, interval=0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=90)
    queued = engine_metric(cluster, list(DECODES), "pdsim_queued_total")
    retracted = engine_metric(cluster, list(DECODES), "sglang:num_retracted_requests_total")
    peak = engine_metric(cluster, list(DECODES), "pdsim_max_running")
    leases = wait_no_leases(cluster, timeout=30)
    snap = cluster.masters["m2"].admission()
    print(
        f"\n{len(outcomes)} requests: {outcomes.count('ok')} ok, others {sorted(set(outcomes) - {'ok'})}; "
        f"m1 charged {used} tokens when killed; engines queued {queued}, retracted {retracted}, "
        f"ran at most {peak} requests at once; {len(samples)} grant samples; m2 charge {snap['token_charge']}"
    )
    assert samples, "no agent snapshot was read"
    for s in samples:
        for d, granted in s.items():
            assert granted <= POOL, f"{d}: {granted} tokens granted of a {POOL}-token pool"
    assert all(v == 0 for v in queued.values()), f"requests waited inside a decode engine: {queued}"
    assert all(v == 0 for v in retracted.values()), f"decode engines retracted: {retracted}"
    assert max(peak.values()) < SLOTS, peak  # the pool bound, not the slots, held the batch
    assert set(outcomes) <= {"ok", "429", "503", "conn"}, outcomes
    assert leases == {"m2": (0, 0)}, leases
