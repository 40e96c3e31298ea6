"""Engine faults end to end (DESIGN §7): a decode engine is SIGKILLed under light load while its agent
stays up; the master stops placing work there, and takes the node back when the engine returns.

Real processes on loopback: etcd, a master, agents and pdsim engines.
"""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from pdcoord.dev.cluster import LocalCluster, scrape_metrics
from pdcoord.dev.launcher import ProcessGroup
from tests.cluster.cluster_helpers import cluster_load, summarize

pytestmark = pytest.mark.cluster

DECODE = {"d1": 4, "d2": 4}
PREFILL = {"p1": 8}


def _node(c: LocalCluster, node: str) -> dict[str, Any]:
    nodes = c.masters["m1"].admission()["nodes"]
    found: dict[str, Any] = next(n for n in nodes if n["node_id"] == node)
    return found


def _engine_up_gauge(c: LocalCluster, node: str) -> float | None:
    with urllib.request.urlopen(c.masters["m1"].url + "/metrics", timeout=3) as r:
        text = r.read().decode()
    m = re.search(r'^pdcoord_node_engine_up\{[^}]*node="' + node + r'"[^}]*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def _agent_status(c: LocalCluster, node: str) -> dict[str, Any]:
    return c.agents[node].status()


def test_killed_decode_engine_leaves_capacity_and_comes_back(etcd, proc_group: ProcessGroup) -> None:  # type: ignore[no-untyped-def]
    c = LocalCluster(proc_group, etcd.endpoint, f"faults-{time.monotonic_ns()}")
    c.start_master("m1", model="sim")
    for name, cap in PREFILL.items():
        c.start_node(name, "prefill", cap, model="sim")
    for name, cap in DECODE.items():
        c.start_node(name, "decode", cap, model="sim")
    caps = {**PREFILL, **DECODE}
    c.wait_for(lambda: c.full_capacity_held(["m1"], caps), timeout=30)
    assert _node(c, "d2")["engine_up"] is True
    assert _engine_up_gauge(c, "d2") == 1.0

    load = cluster_load(lambda: [("m1", c.masters["m1"].url)], users=3, request_timeout_s=30).start()
    try:
        load.wait_for_results(10, timeout=30)
        c.engines["d2"].proc.kill()  # the engine dies; its agent stays up

        def gone() -> bool:
            n = _node(c, "d2")
            return bool(n["engine_down"]) and n["effective_share"] == 0

        c.wait_for(gone, timeout=30, interval=0.1)
        t_gone = time.monotonic()
        assert c.masters["m1"].admission()["capacity"] == DECODE["d1"]
        assert _node(c, "d2")["engine_reason"]  # why: the agent's last error
        assert _engine_up_gauge(c, "d2") == 0.0
        agent = _agent_status(c, "d2")
        assert agent["engine"]["up"] is False and agent["engine"]["reason"]
        assert agent["masters"]["m1"]["connected"] is True  # the stream stays up

        n_before = len(load.snapshot())
        load.wait_for_results(n_before + 15, timeout=60)  # requests keep flowing on d1

        c.engines["d2"].proc.start()  # the same argv: the same port and bootstrap port
        c.wait_for(lambda: _node(c, "d2")["effective_share"] == DECODE["d2"], timeout=30, interval=0.1)
        assert _node(c, "d2")["engine_up"] is True
        assert c.masters["m1"].admission()["capacity"] == sum(DECODE.values())
        assert _engine_up_gauge(c, "d2") == 1.0
        n_back = len(load.snapshot())
        load.wait_for_results(n_back + 10, timeout=60)
    finally:
        results = load.stop()

    after = [r for r in results if r.started >= t_gone]
    assert after, "no request ran after the node left"
    bad = [r for r in after if r.status not in (200, 429) or (r.status == 200 and r.error)]
    assert not bad, f"after the node left, requests must end in 200 or 429: {summarize(bad)}"
    assert any(r.ok for r in after)


def _post_body(url: str, timeout: float = 30) -> tuple[int, str, str]:
    """(status, X-Retries, body) of one small completion."""
    data = b'{"model": "sim", "prompt": "hello there", "max_tokens": 4}'
    req = urllib.request.Request(
        url + "/v1/completions", data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers.get("X-Retries", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("X-Retries", ""), e.read().decode()


def _post(url: str, timeout: float = 30) -> tuple[int, str]:
    """(status, X-Retries) of one small completion."""
    status, retries, _ = _post_body(url, timeout)
    return status, retries


def _burst(url: str, n: int = 6) -> list[tuple[int, str]]:
    """``n`` requests at once: more than one decode node's share, so both nodes get some."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: _post(url), range(n)))


def _metric(c: LocalCluster, pattern: str) -> float:
    with urllib.request.urlopen(c.masters["m1"].url + "/metrics", timeout=3) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^" + pattern + r" (\S+)$", text, re.M))


def test_breaker_alone_takes_out_a_dead_or_hung_engine_and_retries_hide_it(  # type: ignore[no-untyped-def]
    etcd, proc_group: ProcessGroup
) -> None:
    """The agents do not check their engines here: only the master's own dispatches can notice."""
    c = LocalCluster(proc_group, etcd.endpoint, f"breaker-{time.monotonic_ns()}")
    c.start_master("m1", model="sim", engine_first_byte_timeout=2, breaker_backoff=0.5)
    c.start_node("p1", "prefill", 8, model="sim", no_health_check=True)
    for name, cap in DECODE.items():
        c.start_node(name, "decode", cap, model="sim", no_health_check=True)
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"p1": 8, **DECODE}), timeout=30)
    url = c.masters["m1"].url

    # Dead: refused connections. Requests placed on d2 are retried on d1 (X-Retries: 1); the first
    # refused connection opens d2's breaker (nothing listens there) and it takes no new leases.
    c.engines["d2"].proc.kill()
    seen: list[tuple[int, str]] = []

    def opened() -> bool:
        seen.extend(_burst(url))
        return _node(c, "d2")["breaker_open"] is True

    c.wait_for(opened, timeout=30, interval=0)
    assert (200, "1") in seen, seen
    assert _node(c, "d2")["effective_share"] == 0
    assert _metric(c, r'pdcoord_engine_breaker_open\{node="d2"\}') == 1.0
    assert _metric(c, r'pdcoord_engine_failures_total\{[^}]*node="d2"[^}]*\}') >= 1
    assert {s for s, _ in seen} <= {200, 502, 503}  # explicit answers (the retry itself is checked below)

    # Back: a half-open trial succeeds and closes the breaker.
    c.engines["d2"].proc.start()
    closed: list[tuple[int, str]] = []

    def back() -> bool:
        closed.extend(_burst(url))
        return _node(c, "d2")["breaker_state"] == "closed"

    c.wait_for(back, timeout=30, interval=0)
    assert _node(c, "d2")["effective_share"] == DECODE["d2"]
    assert _metric(c, r'pdcoord_engine_breaker_open\{node="d2"\}') == 0.0

    # Hung: SIGSTOP. The first-byte timeout (2 s) ends each exchange with d2 and counts for its
    # breaker; the request is retried on d1; after --breaker-failures of them d2 is out.
    c.engines["d2"].proc.send_signal(signal.SIGSTOP)
    try:
        hung: list[tuple[int, str]] = []

        def hung_opened() -> bool:
            hung.extend(_burst(url))
            return _node(c, "d2")["breaker_open"] is True

        c.wait_for(hung_opened, timeout=60, interval=0)
        assert (200, "1") in hung, hung
        assert _metric(c, r'pdcoord_engine_failures_total\{kind="timeout",node="d2"\}') >= 1
        assert {s for s, _ in hung} <= {200, 502, 503, 504}  # explicit answers, never a hang
    finally:
        c.engines["d2"].proc.send_signal(signal.SIGCONT)


def test_killed_prefill_engine_is_never_chosen_and_comes_back(etcd, proc_group: ProcessGroup) -> None:  # type: ignore[no-untyped-def]
    """The same for a prefill engine: the node leaves the prefill choice (it holds no decode capacity)
    and requests keep succeeding on the other prefill node."""
    c = LocalCluster(proc_group, etcd.endpoint, f"pfaults-{time.monotonic_ns()}")
    c.start_master("m1", model="sim")
    prefill = {"p1": 8, "p2": 8}
    for name, cap in prefill.items():
        c.start_node(name, "prefill", cap, model="sim")
    c.start_node("d1", "decode", 8, model="sim")
    c.wait_for(lambda: c.full_capacity_held(["m1"], {**prefill, "d1": 8}), timeout=30)
    load = cluster_load(lambda: [("m1", c.masters["m1"].url)], users=3, request_timeout_s=30).start()
    try:
        load.wait_for_results(10, timeout=30)
        c.engines["p2"].proc.kill()
        c.wait_for(
            lambda: _node(c, "p2")["engine_down"] and _node(c, "p2")["effective_share"] == 0, timeout=30
        )
        t_gone = time.monotonic()
        n = len(load.snapshot())
        load.wait_for_results(n + 15, timeout=60)
        c.engines["p2"].proc.start()
        c.wait_for(lambda: _node(c, "p2")["effective_share"] == prefill["p2"], timeout=30, interval=0.1)
    finally:
        results = load.stop()
    after = [r for r in results if r.started >= t_gone]
    bad = [r for r in after if r.status not in (200, 429) or (r.status == 200 and r.error)]
    assert after and not bad, f"after p2 left, requests must end in 200 or 429: {summarize(bad)}"


def test_an_engine_failing_half_its_requests_trips_the_breaker(  # type: ignore[no-untyped-def]
    etcd, proc_group: ProcessGroup
) -> None:
    """d2 answers 503 to half of its generation requests (its /health stays fine, so only the master's
    breaker can see it): the breaker opens, retries on d1 hide the failures, every request ends
    explicitly. That it does not thrash (each re-open soon after a lucky trial doubles the wait) is
    checked on the pure breaker in tests/unit/engine/test_health.py."""
    c = LocalCluster(proc_group, etcd.endpoint, f"flaky-{time.monotonic_ns()}")
    c.start_master("m1", model="sim")
    c.start_node("p1", "prefill", 8, model="sim")
    c.start_node("d1", "decode", 4, model="sim")
    c.start_node("d2", "decode", 4, model="sim", engine_args={"fault_error_rate": 0.5, "fault_seed": 7})
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"p1": 8, "d1": 4, "d2": 4}), timeout=30)
    load = cluster_load(lambda: [("m1", c.masters["m1"].url)], users=4, request_timeout_s=30).start()
    try:
        c.wait_for(lambda: _metric(c, r'pdcoord_engine_breaker_open\{node="d2"\}') == 1.0, timeout=60)
        n = len(load.snapshot())
        load.wait_for_results(n + 100, timeout=120)
    finally:
        results = load.stop()
    assert sum(1 for r in results if r.ok) >= 100
    bad = [r for r in results if r.status not in (200, 429, 502, 503)]
    assert not bad, summarize(bad)


def _active(c: LocalCluster, node: str) -> int:
    """Slots of this master's leases on ``node`` (the admission core's view)."""
    return int(c.masters["m1"].admission()["admission_nodes"][node]["active"])


def _set_faults(c: LocalCluster, node: str, method: str, body: dict[str, Any] | None = None) -> None:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        c.engines[node].url + "/admin/faults",
        data=data,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        r.read()


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_stream_stalled_mid_way_ends_releases_and_cancels(  # type: ignore[no-untyped-def]
    etcd, proc_group: ProcessGroup, protocol: str
) -> None:
    """A decode engine stops sending mid-answer (pdsim's hang_after_chunks keeps the connection open).
    The idle timeout ends a stream with an SSE error event after its first chunks; a whole answer
    (nothing is sent before it is complete) ends with 504 at the first-byte timeout. Either way the
    lease is released, the engine sees its request cancelled, and the failure counts for the breaker;
    once the fault clears, the node serves again.

    One decode node and --max-retries 0: the 504 is the subject here (retries are the breaker test's);
    --breaker-failures 2 so the two stalled requests also take the node out, and its return is seen."""
    # The first-byte timeout well above the idle one: a stall after the first chunks must end at
    # the idle timeout, not wait for the first-byte deadline.
    idle, first_byte = 2.0, 20.0
    c = LocalCluster(proc_group, etcd.endpoint, f"stall-{protocol}-{time.monotonic_ns()}")
    c.start_master(
        "m1", model="sim", engine_protocol=protocol, engine_idle_timeout=idle,
        engine_first_byte_timeout=first_byte, max_retries=0, breaker_failures=2, breaker_backoff=3,
    )  # fmt: skip
    c.start_node("p1", "prefill", 4, model="sim", engine_args={"api": protocol})
    # health_timeout: pdsim's /health generates one token, which this fault lets out.
    c.start_node("d1", "decode", 4, model="sim", engine_args={"api": protocol, "admin_port": 0})
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"p1": 4, "d1": 4}), timeout=30)
    url = c.masters["m1"].url
    d1 = c.engines["d1"].url
    _set_faults(c, "d1", "POST", {"hang_after_chunks": 2})
    cancelled0 = scrape_metrics(d1).get("pdsim_cancelled_total", 0.0)

    # Streaming, through the real openai client. First a batch (one engine request per prompt,
    # merged): two chunks per prompt, then an SSE error event, not a hang; every part cancelled.
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    texts: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for chunk in client.completions.create(
            model="sim", prompt=["one", "two"], max_tokens=50, stream=True
        ):
            texts += [ch.text for ch in chunk.choices]
    took = time.monotonic() - t0
    assert sorted(texts) == [" tok1", " tok1", " tok2", " tok2"], texts
    assert "decode stream failed" in str(err.value), err.value
    assert idle <= took < first_byte, took
    c.wait_for(lambda: scrape_metrics(d1).get("pdsim_hung_requests") == 0.0, timeout=20)
    assert scrape_metrics(d1)["pdsim_cancelled_total"] >= cancelled0 + 2
    c.wait_for(lambda: _active(c, "d1") == 0, timeout=20)
    assert _metric(c, r'pdcoord_engine_failures_total\{kind="timeout",node="d1"\}') == 1  # once

    # A single stream: the same, and the stall counts for the breaker.
    texts = []
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for chunk in client.completions.create(model="sim", prompt="stall me", max_tokens=50, stream=True):
            texts += [ch.text for ch in chunk.choices]
    took = time.monotonic() - t0
    assert texts == [" tok1", " tok2"], texts
    assert "decode stream failed" in str(err.value) and "mid-response" in str(err.value), err.value
    assert idle <= took < first_byte, took  # generous: a loaded machine
    c.wait_for(lambda: scrape_metrics(d1).get("pdsim_hung_requests") == 0.0, timeout=20)
    assert scrape_metrics(d1)["pdsim_cancelled_total"] >= cancelled0 + 3
    c.wait_for(lambda: _active(c, "d1") == 0, timeout=20)
    assert _metric(c, r'pdcoord_engine_failures_total\{kind="timeout",node="d1"\}') == 2

    # Whole answer: the engine sends nothing before it is complete, so the first-byte timeout ends it.
    t0 = time.monotonic()
    status, retries = _post(url, timeout=60)
    took = time.monotonic() - t0
    assert status == 504 and retries == "", (status, retries)
    assert first_byte <= took < first_byte + 20, took
    c.wait_for(lambda: scrape_metrics(d1).get("pdsim_hung_requests") == 0.0, timeout=20)
    assert scrape_metrics(d1)["pdsim_cancelled_total"] >= cancelled0 + 4
    c.wait_for(lambda: _active(c, "d1") == 0, timeout=20)
    assert _metric(c, r'pdcoord_engine_failures_total\{kind="timeout",node="d1"\}') == 3
    # --breaker-failures 2 (a dispatch that got its head resets the count: the stream stalls count
    # one each, the whole answer's timeout is the second in a row): the node is out (half-open once
    # the backoff has passed: one trial slot)
    node = _node(c, "d1")
    assert node["breaker_state"] in ("open", "half_open") and node["effective_share"] <= 1, node
    assert _metric(c, r'pdcoord_engine_breaker_open\{node="d1"\}') == 1.0

    # Fault cleared: a half-open trial succeeds and the node takes leases again.
    _set_faults(c, "d1", "DELETE")
    ok: list[int] = []

    def back() -> bool:
        ok.append(_post(url)[0])
        return _node(c, "d1")["breaker_state"] == "closed" and 200 in ok

    c.wait_for(back, timeout=30, interval=0.2)
    assert _node(c, "d1")["effective_share"] == 4
    c.wait_for(lambda: _active(c, "d1") == 0, timeout=20)


def test_a_sigstopped_decode_engine_ends_its_streams_and_returns_after_sigcont(  # type: ignore[no-untyped-def]
    etcd, proc_group: ProcessGroup
) -> None:
    """SIGSTOP a decode engine while it streams (a real hang, unlike pdsim's fault: nothing in the
    engine runs): the client's stream ends with an SSE error at the idle timeout, the lease is
    released, the node leaves placement; after SIGCONT the engine sees its request cancelled (the
    master closed the connection) and the node comes back."""
    idle = 2.0
    c = LocalCluster(proc_group, etcd.endpoint, f"sigstop-{time.monotonic_ns()}")
    c.start_master("m1", model="sim", engine_idle_timeout=idle, engine_first_byte_timeout=60)
    c.start_node("p1", "prefill", 4, model="sim")
    # 50 ms a token: a 400-token stream runs far longer than the test needs to stop it.
    c.start_node("d1", "decode", 4, model="sim", engine_args={"decode_base_ms": 50})
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"p1": 4, "d1": 4}), timeout=30)
    url = c.masters["m1"].url
    d1 = c.engines["d1"]
    cancelled0 = scrape_metrics(d1.url).get("pdsim_cancelled_total", 0.0)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    texts: list[str] = []
    stopped_at = 0.0
    try:
        with pytest.raises(openai.APIError) as err:
            for chunk in client.completions.create(model="sim", prompt="go on", max_tokens=400, stream=True):
                texts += [ch.text for ch in chunk.choices]
                if len(texts) == 3:
                    d1.proc.send_signal(signal.SIGSTOP)
                    stopped_at = time.monotonic()
        took = time.monotonic() - stopped_at
        assert stopped_at and len(texts) < 400, len(texts)
        assert "decode stream failed" in str(err.value), err.value
        assert took < idle + 20, took  # generous: a loaded machine
        c.wait_for(lambda: _active(c, "d1") == 0, timeout=20)
        assert _metric(c, r'pdcoord_engine_failures_total\{kind="timeout",node="d1"\}') >= 1
        # The agent's liveness checks time out: the node takes no new leases.
        c.wait_for(lambda: _node(c, "d1")["effective_share"] == 0, timeout=30, interval=0.1)
    finally:
        d1.proc.send_signal(signal.SIGCONT)
    c.wait_for(lambda: scrape_metrics(d1.url)["pdsim_cancelled_total"] >= cancelled0 + 1, timeout=20)
    c.wait_for(lambda: _node(c, "d1")["effective_share"] == 4, timeout=30, interval=0.1)
    assert _post(url)[0] == 200


def test_a_retry_is_never_placed_on_the_decode_node_that_failed_it(  # type: ignore[no-untyped-def]
    etcd, proc_group: ProcessGroup
) -> None:
    """d2 answers 503 to every generation request, and its breaker is set never to open in this test
    (its /health stays fine): d2 keeps its capacity, so requests keep being placed there. Each one that
    fails there is retried once; admission must place the retry on d1, never on d2 again, so every
    request ends 200 (with X-Retries: 1 where it was retried) and none with the 503 "failed this
    request already"."""
    c = LocalCluster(proc_group, etcd.endpoint, f"avoid-{time.monotonic_ns()}")
    c.start_master("m1", model="sim", max_retries=1, breaker_failures=1_000_000)
    c.start_node("p1", "prefill", 8, model="sim")
    c.start_node("d1", "decode", 4, model="sim")
    c.start_node("d2", "decode", 4, model="sim", engine_args={"fault_error_rate": 1.0})
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"p1": 8, "d1": 4, "d2": 4}), timeout=30)
    url = c.masters["m1"].url
    results: list[tuple[int, str, str]] = []
    with ThreadPoolExecutor(6) as pool:
        for _ in range(5):  # bursts wider than one node's share, so both nodes get leases
            results.extend(pool.map(lambda _: _post_body(url, 60), range(6)))
    assert _node(c, "d2")["breaker_open"] is False and _node(c, "d2")["effective_share"] == 4
    bad = [r for r in results if r[0] != 200]
    assert not bad, bad
    assert not [r for r in results if "failed this request already" in r[2]]
    retried = [r for r in results if r[1] == "1"]
    assert retried, "no request was placed on d2 first: the test did not exercise a retry"
    assert all(r[1] in ("", "1") for r in results)
    assert _metric(c, r'pdcoord_engine_failures_total\{[^}]*node="d2"[^}]*\}') >= len(retried)


def test_a_draining_master_does_not_retry(  # type: ignore[no-untyped-def]
    etcd, proc_group: ProcessGroup
) -> None:
    """A request whose decode engine hangs is in flight when its master is told to stop. The master
    drains: once its queue is empty the agents count only its running leases, so a retry could lease
    a slot that another master holds by then. The request ends with 504 at the first-byte timeout
    instead of being retried on d2 (which it would be while not draining, as the tests above show),
    and the master still exits cleanly."""
    c = LocalCluster(proc_group, etcd.endpoint, f"drain-retry-{time.monotonic_ns()}")
    c.start_master(
        "m1", model="sim", max_retries=1, engine_first_byte_timeout=3, breaker_failures=1_000_000,
        drain_timeout=60,
    )  # fmt: skip
    c.start_node("p1", "prefill", 8, model="sim")
    # d1's agent does not check its engine: the node keeps its capacity while its engine hangs.
    c.start_node("d1", "decode", 4, model="sim", no_health_check=True)
    c.start_node("d2", "decode", 1, model="sim")
    c.wait_for(lambda: c.full_capacity_held(["m1"], {"p1": 8, "d1": 4, "d2": 1}), timeout=30)
    _set_faults(c, "d1", "POST", {"hang": True})
    url = c.masters["m1"].url
    with ThreadPoolExecutor(3) as pool:
        pending = [pool.submit(_post_body, url, 60) for _ in range(3)]  # at least two land on d1
        c.wait_for(lambda: _active(c, "d1") >= 1, timeout=20, interval=0.05)
        c.masters["m1"].proc.send_signal(signal.SIGTERM)
        results = [f.result() for f in pending]
    # A request that reached the master only after SIGTERM is refused at the door (503 "draining",
    # never in flight): it says nothing about retries.
    in_flight = [r for r in results if not (r[0] == 503 and '"draining"' in r[2])]
    assert not [r for r in results if r[1] == "1"], results  # nothing was retried
    on_d1 = [r for r in in_flight if r[0] != 200]
    assert on_d1, results
    assert all(r[0] == 504 and r[1] == "" for r in on_d1), results
    assert c.masters["m1"].proc.wait(60) == 0
