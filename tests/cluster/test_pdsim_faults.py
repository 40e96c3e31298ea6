"""pdsim fault injection: real pdsim processes on loopback, faults set by flags and through /admin/faults."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from tests.cluster.test_pdsim import read_ready_line

READY_TIMEOUT_S = 20.0
DEADLINE_S = 20.0  # generous: the machine may be small and loaded


@dataclass
class Sim:
    proc: subprocess.Popen[bytes]
    args: list[str]
    ready: dict[str, str] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return int(self.ready["port"])

    @property
    def bootstrap_port(self) -> int:
        return int(self.ready["bootstrap_port"])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.ready['admin_port']}"

    def wait_ready(self) -> None:
        """Read the ready line; unlike a plain start, /health may be failing on purpose."""
        line = read_ready_line(self.proc, self.args)
        assert line.startswith(b"pdsim ready"), line
        self.ready = dict(kv.split("=", 1) for kv in line.decode().split()[2:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


Launch = Callable[..., Sim]


@pytest.fixture
def sims() -> Iterator[Launch]:
    """Start one pdsim per call (role, then extra flags) and stop each, by PID, afterwards."""
    started: list[Sim] = []
    with tempfile.TemporaryFile() as logs:

        def _launch(role: str, *flags: str, capacity: int = 8, env: dict[str, str] | None = None) -> Sim:
            args = [
                sys.executable, "-m", "pdsim", "--host", "127.0.0.1", "--port", "0", "--fast",
                "--role", role, "--running-max-req-size", str(capacity), *flags,
            ]  # fmt: skip
            proc = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=logs, bufsize=0, env={**os.environ, **(env or {})}
            )
            sim = Sim(proc, list(flags))
            started.append(sim)
            sim.wait_ready()
            return sim

        try:
            yield _launch
        finally:
            for s in started:
                s.stop()
    for s in started:
        assert s.proc.returncode == 0, f"pdsim {s.args} exited with {s.proc.returncode}"


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def set_faults(
    session: aiohttp.ClientSession, sim: Sim, method: str = "POST", **faults: Any
) -> dict[str, Any]:
    async with session.request(method, sim.admin + "/admin/faults", json=faults) as resp:
        body: dict[str, Any] = await resp.json()
        assert resp.status == 200, body
        return body


async def refused(port: int) -> bool:
    """Whether a fresh TCP connection to the port is refused (a pooled one might still be open)."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    writer.close()
    await writer.wait_closed()
    return False


async def complete(session: aiohttp.ClientSession, sim: Sim, max_tokens: int = 3, **extra: Any) -> int:
    body = {"prompt": "hello world", "max_tokens": max_tokens, **extra}
    async with session.post(sim.url + "/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


async def hung(session: aiohttp.ClientSession, sim: Sim) -> int:
    async with session.get(sim.admin + "/admin/faults") as resp:
        return int((await resp.json())["state"]["hung_requests"])


async def running_reqs(session: aiohttp.ClientSession, sim: Sim) -> int:
    async with session.get(sim.url + "/get_load") as resp:
        return int((await resp.json())[0]["num_reqs"])


# ---- refuse connections ----------------------------------------------------------------------


async def test_refuse_closes_listener_keeps_streams_and_reopens_same_port(sims: Launch) -> None:
    sim = sims("decode", "--admin-port", "0", "--decode-base-ms", "20")
    async with aiohttp.ClientSession() as s:
        assert await complete(s, sim) == 200
        # A stream already running when the listener closes still finishes.
        body = {"prompt": "hi", "max_tokens": 25, "stream": True}
        async with s.post(sim.url + "/v1/completions", json=body) as stream:
            assert stream.status == 200
            state = await set_faults(s, sim, refuse=True)
            assert state["faults"]["refuse"] is True and state["state"]["listening"] is False
            assert await refused(sim.port)
            text = await stream.text()
        assert text.rstrip().endswith("data: [DONE]") and " tok25" in text
        # The keep-alive connection is closed too, so even the pooled session now fails.
        with pytest.raises(aiohttp.ClientConnectionError):
            await complete(s, sim)
        async with s.get(sim.admin + "/admin/faults") as resp:
            assert (await resp.json())["state"]["listening"] is False
        state = await set_faults(s, sim, refuse=False)
        assert state["state"]["listening"] is True
        assert not await refused(sim.port)
        assert await complete(s, sim) == 200


async def test_refuse_from_the_environment_at_start(sims: Launch) -> None:
    sim = sims("decode", "--admin-port", "0", env={"PDSIM_FAULT_REFUSE": "1"})
    assert sim.port > 0
    assert await refused(sim.port)
    async with aiohttp.ClientSession() as s:
        await set_faults(s, sim, "DELETE")
        assert await complete(s, sim) == 200


async def test_refuse_needs_an_admin_port(sims: Launch) -> None:
    sim = sims("decode")
    assert sim.ready["admin_port"] == "0"
    async with aiohttp.ClientSession() as s:
        async with s.post(sim.url + "/admin/faults", json={"refuse": True}) as resp:
            assert resp.status == 400
            assert "--admin-port" in (await resp.json())["error"]["message"]
        assert await complete(s, sim) == 200


# ---- 5xx ------------------------------------------------------------------------------------


async def test_error_rate_is_reproducible_with_a_seed(sims: Launch) -> None:
    faults = ("--fault-error-rate", "0.5", "--fault-seed", "7", "--fault-error-status", "500")
    sim = sims("decode", "--admin-port", "0", *faults)
    async with aiohttp.ClientSession() as s:
        first = [await complete(s, sim, max_tokens=1) for _ in range(24)]
        assert set(first) == {200, 500}, first
        async with s.post(sim.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as resp:
            if resp.status == 500:
                assert (await resp.json())["error"]["code"] == "injected_fault"
        # Setting the rate and seed again restarts the draw: the same requests fail.
        await set_faults(s, sim, error_rate=0.5, seed=7)
        again = [await complete(s, sim, max_tokens=1) for _ in range(24)]
        assert again == first
        await set_faults(s, sim, error_rate=1.0, error_status=503)
        assert [await complete(s, sim, max_tokens=1) for _ in range(3)] == [503] * 3
        # Health is not a generation request: the engine is up, only some requests fail.
        async with s.get(sim.url + "/health") as resp:
            assert resp.status == 200
        await set_faults(s, sim, error_rate=0.0)
        assert [await complete(s, sim, max_tokens=1) for _ in range(3)] == [200] * 3


# ---- hangs and health -----------------------------------------------------------------------


async def test_hang_accepts_never_answers_and_fails_sglang_health(sims: Launch) -> None:
    sim = sims("decode", "--admin-port", "0", "--health-timeout", "0.5")
    async with aiohttp.ClientSession() as s:
        await set_faults(s, sim, hang=True)
        task = asyncio.create_task(complete(s, sim))

        async def parked() -> bool:
            return await hung(s, sim) == 1

        await eventually(parked, "the request to be held open")
        assert not task.done()
        # SGLang's /health runs a one-token generation: it gets no output, so 503 after the timeout.
        async with s.get(sim.url + "/health") as resp:
            assert resp.status == 503
        async with s.get(sim.url + "/health_generate") as resp:
            assert resp.status == 503
        # The client giving up ends the request on the server too.
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        async def released() -> bool:
            return await hung(s, sim) == 0

        await eventually(released, "the hung request to end when its client left")
        await set_faults(s, sim, hang=False)
        async with s.get(sim.url + "/health") as resp:
            assert resp.status == 200
        assert await complete(s, sim) == 200


async def test_health_recovers_when_the_hang_clears_during_the_check(sims: Launch) -> None:
    sim = sims("decode", "--admin-port", "0", "--health-timeout", "60", "--fault-hang")
    async with aiohttp.ClientSession() as s:
        check = asyncio.create_task(s.get(sim.url + "/health"))
        await asyncio.sleep(0.3)
        assert not check.done()
        await set_faults(s, sim, hang=False)
        resp = await asyncio.wait_for(check, DEADLINE_S)
        assert resp.status == 200
        resp.release()


async def test_vllm_health_ignores_a_hung_engine(sims: Launch) -> None:
    sim = sims("decode", "--admin-port", "0", "--api", "vllm", "--fault-hang")
    async with aiohttp.ClientSession() as s:
        async with s.get(sim.url + "/health") as resp:
            assert resp.status == 200
            assert await resp.read() == b""
        await set_faults(s, sim, health_fail=True)
        async with s.get(sim.url + "/health") as resp:
            assert resp.status == 503


async def test_hang_mid_stream_keeps_connection_and_slots(sims: Launch) -> None:
    sim = sims("decode", "--admin-port", "0", "--health-timeout", "0.5", "--fault-hang-after-chunks", "2")
    async with aiohttp.ClientSession() as s:
        body = {"prompt": "hello", "max_tokens": 6, "n": 2, "stream": True}
        resp = await s.post(sim.url + "/v1/completions", json=body)
        assert resp.status == 200

        async def next_event() -> Any:
            while True:
                line = (await resp.content.readline()).decode().strip()
                if line:
                    return json.loads(line.removeprefix("data: "))

        events = [await asyncio.wait_for(next_event(), DEADLINE_S) for _ in range(4)]  # 2 tokens x n=2
        assert [e["choices"][0]["text"] for e in events] == [" tok1", " tok1", " tok2", " tok2"]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(next_event(), 0.5)
        assert not resp.content.at_eof()
        assert await running_reqs(s, sim) == 2  # its two sequences still hold their slots
        assert await hung(s, sim) == 1
        # One token would still come out, so SGLang's health check passes.
        async with s.get(sim.url + "/health") as h:
            assert h.status == 200
        resp.close()

        async def freed() -> bool:
            return await running_reqs(s, sim) == 0 and await hung(s, sim) == 0

        await eventually(freed, "the slots to be freed after the client left")
        await set_faults(s, sim, hang_after_chunks=0)
        async with s.get(sim.url + "/health") as h:
            assert h.status == 503


async def test_health_fail_flag_leaves_generation_working(sims: Launch) -> None:
    sim = sims("decode", "--admin-port", "0", "--fault-health-fail")
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/health_generate"):
            async with s.get(sim.url + path) as resp:
                assert resp.status == 503, path
        assert await complete(s, sim) == 200
        await set_faults(s, sim, health_fail=False)
        async with s.get(sim.url + "/health") as resp:
            assert resp.status == 200


async def test_slow_multiplies_the_timing_model(sims: Launch) -> None:
    sim = sims("decode", "--admin-port", "0", "--decode-base-ms", "10")
    async with aiohttp.ClientSession() as s:
        await set_faults(s, sim, slow=20.0)
        t0 = time.monotonic()
        async with s.post(sim.url + "/v1/completions", json={"prompt": "a", "max_tokens": 10}) as resp:
            body = await resp.json()
        elapsed = time.monotonic() - t0
        assert resp.status == 200 and body["choices"][0]["text"].endswith(" tok10")
        # 10 tokens x 10 ms x 20; a sleep never ends early, so this lower bound holds on any machine.
        assert elapsed >= 1.8, elapsed


# ---- the admin endpoint ---------------------------------------------------------------------


async def test_admin_faults_validation_merge_replace_and_clear(sims: Launch) -> None:
    sim = sims("decode", "--admin-port", "0")
    async with aiohttp.ClientSession() as s:
        async with s.get(sim.admin + "/admin/faults") as resp:
            state = await resp.json()
        assert state["faults"] == {
            "refuse": False, "error_rate": 0.0, "error_status": 503, "seed": 0, "hang": False,
            "hang_after_chunks": None, "slow": 1.0, "health_fail": False,
        }  # fmt: skip
        admin_port = int(sim.ready["admin_port"])
        assert state["state"] == {"listening": True, "hung_requests": 0, "admin_port": admin_port}
        bad: list[tuple[object, str]] = [
            ([1, 2], "JSON object"),
            ({"nope": 1}, "nope"),
            ({"error_rate": 1.5}, "error_rate"),
            ({"error_status": 404}, "error_status"),
            ({"hang": "yes"}, "hang"),
            ({"hang_after_chunks": -1}, "hang_after_chunks"),
            ({"slow": 0}, "slow"),
            ({"seed": 1.5}, "seed"),
        ]
        for body, word in bad:
            async with s.post(sim.admin + "/admin/faults", json=body) as resp:
                assert resp.status == 400, body
                assert word in (await resp.json())["error"]["message"], body
        async with s.post(sim.admin + "/admin/faults", data=b"{not json") as resp:
            assert resp.status == 400
        # Nothing was applied by the refused updates.
        async with s.get(sim.admin + "/admin/faults") as resp:
            assert (await resp.json())["faults"]["slow"] == 1.0
        merged = await set_faults(s, sim, slow=3.0)
        merged = await set_faults(s, sim, health_fail=True)
        assert merged["faults"]["slow"] == 3.0 and merged["faults"]["health_fail"] is True
        replaced = await set_faults(s, sim, "PUT", hang_after_chunks=4)
        assert replaced["faults"]["slow"] == 1.0 and replaced["faults"]["health_fail"] is False
        assert replaced["faults"]["hang_after_chunks"] == 4
        cleared = await set_faults(s, sim, "DELETE")
        assert cleared["faults"]["hang_after_chunks"] is None
        # The main port serves the same admin endpoint.
        async with s.get(sim.url + "/admin/faults") as resp:
            assert (await resp.json())["faults"] == cleared["faults"]


# ---- the request log ------------------------------------------------------------------------


async def test_request_log_records_what_arrived_bounded(sims: Launch) -> None:
    sim = sims("decode", "--admin-port", "0", "--request-log-size", "3")
    async with aiohttp.ClientSession() as s:
        headers = {"X-Request-Id": "rid-1", "Authorization": "Bearer secret"}
        body = {"prompt": "hi", "max_tokens": 2}
        async with s.post(sim.url + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
        async with s.post(sim.url + "/v1/chat/completions", data=b"{oops") as resp:
            assert resp.status == 400
        async with s.get(sim.admin + "/admin/requests") as resp:
            log = await resp.json()
        assert log["total"] == 2 and log["dropped"] == 0 and log["capacity"] == 3
        first, second = log["requests"]
        assert first["path"] == "/v1/completions" and first["request_id"] == "rid-1"
        assert first["body"] == body and first["status"] == 200
        assert "Authorization" not in first["headers"]
        assert second["body"] is None and second["raw"] == "{oops" and second["status"] == 400
        async with s.get(sim.admin + "/admin/requests", params={"since": "1"}) as resp:
            assert [e["seq"] for e in (await resp.json())["requests"]] == [2]
        for i in range(3):
            async with s.post(sim.url + "/generate", json={"text": f"p{i}"}) as resp:
                assert resp.status == 200
        async with s.get(sim.admin + "/admin/requests", params={"path": "/generate"}) as resp:
            log = await resp.json()
        assert log["total"] == 5 and log["dropped"] == 2
        assert [e["body"]["text"] for e in log["requests"]] == ["p0", "p1", "p2"]
        async with s.delete(sim.admin + "/admin/requests") as resp:
            assert resp.status == 200
        async with s.get(sim.admin + "/admin/requests") as resp:
            assert (await resp.json())["requests"] == []
