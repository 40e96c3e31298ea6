"""A time-to-first-token target (``--admission-target-includes-prefill``) on real processes: the master
learns what its streamed requests take from grant to first token, shows it in ``/admission``, and
refuses a request whose wait plus that would break the target while it still serves what fits."""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest

from pdcoord.dev.cluster import LocalCluster

pytestmark = pytest.mark.cluster


def _stream(client: openai.OpenAI, words: int, tokens: int) -> tuple[str, float | None]:
    """('ok' and the time to the first token) or (the error code, None)."""
    start = time.monotonic()
    try:
        stream = client.completions.create(
            model="pdsim-model", prompt=" ".join(f"w{i}" for i in range(words)), max_tokens=tokens,
            stream=True,
        )  # fmt: skip
        first = None
        for _ in stream:
            if first is None:
                first = time.monotonic() - start
        return "ok", first
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return str(body.get("code") or exc.status_code), None


def test_the_master_learns_the_prefill_and_refuses_what_would_break_the_target(cluster: LocalCluster) -> None:
    c = cluster
    m = c.start_master(
        "m1", admission_target_wait="1.5", admission_target_includes_prefill=True, admission_queue_waves=10
    )
    c.start_node("p1", "prefill", 4)
    c.start_node("d1", "decode", 2, engine_args={"decode_base_ms": 50})  # 10 tokens: 0.5 s
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"p1": 4, "d1": 2}), timeout=30)
    client = openai.OpenAI(base_url=m.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    # Learn: short requests one after another (each runs at once: nothing to refuse yet).
    for i in range(12):
        code, ttft = _stream(client, 20 + 40 * (i % 3), 10)
        assert code == "ok" and ttft is not None
    pt = m.admission()["prefill_time"]
    assert pt["samples"] >= 12 and pt["base_s"] is not None and pt["base_s"] >= 0
    # Overload: 30 arrivals at once for 2 slots that free one every ~0.25 s: those whose expected
    # wait plus the learned prefill passes 1.5 s are told so at once, the rest served or timed out.
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        outcomes = list(pool.map(lambda _: _stream(client, 50, 10), range(30)))
    codes = [code for code, _ in outcomes]
    assert "ok" in codes and "expected_wait" in codes, codes
    assert set(codes) <= {"ok", "expected_wait", "timeout"}, codes  # nothing else, nothing lost
    snap = m.admission()
    refused = sum(by_class.get("expected_wait", 0) for by_class in snap["outcomes"].values())
    assert refused >= codes.count("expected_wait")
