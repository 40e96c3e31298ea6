"""Spill on real processes (``--spill-peers``): a master that refuses a request at once for its expected
wait, or would make it wait, sends it to a peer master from etcd, which serves it only from room it has
now; a request already waiting goes to a peer that reports room; the client gets the peer's answer
through the master it asked, and nothing else changes for it."""

from __future__ import annotations

import concurrent.futures
import time
import urllib.request
from typing import Any

import openai
import pytest

from pdcoord.dev.cluster import LocalCluster

pytestmark = pytest.mark.cluster


def _stream(
    client: openai.OpenAI, words: int, tokens: int, session: str | None = None
) -> tuple[str, str, str]:
    """('ok', the master that served it when not the one asked, else '', its admission wait in ms) or
    (the error code, '', '')."""
    try:
        raw = client.completions.with_raw_response.create(
            model="pdsim-model", prompt=" ".join(f"w{i}" for i in range(words)), max_tokens=tokens,
            stream=True, extra_headers={"X-Session-Id": session} if session else None,
        )  # fmt: skip
        spilled_to = raw.headers.get("X-Spilled-To", "")
        wait_ms = raw.headers.get("X-Admission-Wait-Ms", "")
        for _ in raw.parse():
            pass
        return "ok", spilled_to, wait_ms
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return str(body.get("code") or exc.status_code), "", ""


def _granted(snapshot: dict[str, Any], outcome: str = "granted") -> int:
    return sum(by_class.get(outcome, 0) for by_class in snapshot["outcomes"].values())


def _waited_s(url: str) -> float:
    """All the admission waits a master's grants had, in seconds (its /metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdcoord_admission_wait_seconds_sum")
    )


def test_a_request_refused_for_its_expected_wait_is_served_by_a_peer_with_room(cluster: LocalCluster) -> None:
    c = cluster
    flags = {"admission_target_wait": "1.5", "admission_target_includes_prefill": True, "spill_peers": "1"}
    m1 = c.start_master("m1", admission_queue_waves=10, **flags)
    m2 = c.start_master("m2", **flags)
    c.start_node("p1", "prefill", 4)
    c.start_node("d1", "decode", 4, engine_args={"decode_base_ms": 50})  # 10 tokens: 0.5 s
    c.wait_for(lambda: c.full_capacity_held(["m1", "m2"], {"p1": 4, "d1": 4}), timeout=30)
    c.wait_for(lambda: m1.admission()["masters"] == 2, timeout=30)  # m1 has found its peer in etcd
    client = openai.OpenAI(base_url=m1.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for i in range(12):  # m1 learns its completion rate and prefill time
        assert _stream(client, 20 + 40 * (i % 3), 10)[0] == "ok"
    before = _granted(m2.admission())
    # A burst at m1 alone: what m1 would make wait too long goes to m2, which takes what fits now.
    spilled: list[tuple[str, str]] = []
    deadline = time.monotonic() + 120
    while not spilled and time.monotonic() < deadline:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            outcomes = list(pool.map(lambda _: _stream(client, 50, 10), range(30)))
        codes = [code for code, _, _ in outcomes]
        assert set(codes) <= {"ok", "expected_wait", "timeout"}, codes  # nothing else, nothing lost
        spilled = [(to, wait) for code, to, wait in outcomes if code == "ok" and to]
    assert spilled and {to for to, _ in spilled} == {"m2"}, outcomes
    assert _granted(m2.admission()) - before >= len(spilled)
    # m2 queued none of them: a spilled request takes room free now (granted in the call that
    # submitted it: a wait of 0) or is refused at once, so none timed out there either. (An answer's
    # X-Admission-Wait-Ms counts a wait at m1 too when m1 had queued it before a hand-off.)
    assert all(float(wait) >= 0.0 for _, wait in spilled), spilled
    assert _waited_s(m2.url) == 0.0
    outcomes_m2 = m2.admission()["outcomes"]
    assert not any(by_class.get("timeout") for by_class in outcomes_m2.values()), outcomes_m2


def test_a_waiting_request_is_handed_to_a_peer_whose_room_came_free(cluster: LocalCluster) -> None:
    """No target: m1 queues what it cannot start. Once m2's slots free up (m2 has no clients of its
    own), m1 hands its waiters there; m2 still queues none, and every request is served."""
    c = cluster
    m1 = c.start_master("m1", admission_queue_waves=10, spill_peers="1")
    m2 = c.start_master("m2", spill_peers="1")
    c.start_node("p1", "prefill", 4)
    c.start_node("d1", "decode", 4, engine_args={"decode_base_ms": 50})  # 10 tokens: 0.5 s
    c.wait_for(lambda: c.full_capacity_held(["m1", "m2"], {"p1": 4, "d1": 4}), timeout=30)
    c.wait_for(lambda: m1.admission()["masters"] == 2, timeout=30)
    client = openai.OpenAI(base_url=m1.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    deadline = time.monotonic() + 120
    outcomes: list[tuple[str, str, str]] = []
    while not _granted(m1.admission(), "handed_off") and time.monotonic() < deadline:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            outcomes = list(pool.map(lambda i: _stream(client, 50, 10, f"s{i}"), range(12)))
        codes = [code for code, _, _ in outcomes]
        assert set(codes) <= {"ok", "timeout"}, codes  # cold requests wait at most 5 s at m1
    handed = _granted(m1.admission(), "handed_off")
    assert handed > 0, m1.admission()["outcomes"]
    # the batch that saw the first hand-off holds it: its answer came from m2 and counts its wait at m1
    assert any(code == "ok" and to == "m2" and float(wait) > 0 for code, to, wait in outcomes), outcomes
    # m2's answer was the session's output: its next turn is a continuation at m1 too
    session = next(f"s{i}" for i, (code, to, _) in enumerate(outcomes) if code == "ok" and to == "m2")
    raw = client.completions.with_raw_response.create(
        model="pdsim-model", prompt="next turn", max_tokens=2, extra_headers={"X-Session-Id": session}
    )
    assert raw.headers.get("X-Spilled-To") is None  # m1 is idle now: served there
    assert raw.headers["X-Admission-Class"] == "continuation"
    assert _granted(m2.admission()) >= handed
    assert _waited_s(m2.url) == 0.0  # m2 took each into room free then, queued none
    assert m1.admission()["queued_requests"] == 0
