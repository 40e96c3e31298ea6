"""pdsim end to end: real subprocesses on loopback, driven the way a PD router drives real engines."""

from __future__ import annotations

import asyncio
import json
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from hypothesis import strategies as st

from tests.cluster.cluster_helpers import post_unread

READY_TIMEOUT_S = 20.0


def read_ready_line(proc: subprocess.Popen[bytes], args: list[str]) -> bytes:
    """pdsim's one ready line on stdout (``pdsim ready role=… port=…``), read without blocking past
    the deadline."""
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    line = b""
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or proc.poll() is not None:
            raise AssertionError(f"pdsim {args} did not become ready: {line!r}")
        r, _, _ = select.select([proc.stdout], [], [], remaining)
        if r:
            ch = proc.stdout.read(1)
            if not ch:
                raise AssertionError(f"pdsim {args} exited: rc={proc.wait()}")
            line += ch
    return line


@dataclass
class Sim:
    proc: subprocess.Popen[bytes]
    args: list[str]
    port: int = 0
    bootstrap_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        line = read_ready_line(self.proc, self.args)
        fields = dict(kv.split("=", 1) for kv in line.decode().split()[2:])
        assert line.startswith(b"pdsim ready"), line
        self.port, self.bootstrap_port = int(fields["port"]), int(fields["bootstrap_port"])
        with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
            assert resp.status == 200

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


Launch = Callable[..., list[Sim]]


@pytest.fixture
def launch() -> Iterator[Launch]:
    """Start pdsim processes (each given as a list of extra flags) and stop them, by PID, afterwards."""
    started: list[Sim] = []
    with tempfile.TemporaryFile() as logs:

        def _launch(*flag_lists: list[str]) -> list[Sim]:
            sims = []
            for flags in flag_lists:
                args = [sys.executable, "-m", "pdsim", "--host", "127.0.0.1", "--port", "0", "--fast", *flags]
                proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=logs, bufsize=0)
                sims.append(Sim(proc, flags))
            started.extend(sims)
            for s in sims:
                s.wait_ready()
            return sims

        try:
            yield _launch
        finally:
            for s in started:
                s.stop()
        for s in started:
            assert s.proc.returncode == 0, f"pdsim {s.args} exited with {s.proc.returncode}"


def prefill_flags(n: int = 8, *extra: str) -> list[str]:
    return ["--role", "prefill", "--running-max-req-size", str(n), *extra]


def decode_flags(n: int = 8, *extra: str) -> list[str]:
    return ["--role", "decode", "--running-max-req-size", str(n), *extra]


async def scrape(session: aiohttp.ClientSession, sim: Sim) -> dict[str, float]:
    """Prometheus text → {metric name: value summed over label sets}."""
    async with session.get(sim.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events and events[-1] == "[DONE]"
    return events[:-1]


def expected_text(k: int) -> str:
    return "".join(f" tok{i}" for i in range(1, k + 1))


# ---- SGLang protocol -------------------------------------------------------------------------


async def test_sglang_pd_generate_and_chat(launch: Launch) -> None:
    p, d = launch(prefill_flags(), decode_flags())
    async with aiohttp.ClientSession() as s:
        for room, (path, body) in enumerate(
            [
                (
                    "/generate",
                    {"text": "hello " * 40, "sampling_params": {"max_new_tokens": 6}, "stream": True},
                ),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}),
            ],
            start=1000,
        ):
            pd = {
                **body,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": p.bootstrap_port,
                "bootstrap_room": room,
            }
            # The router sends the same body to both at once and streams from decode.
            p_task = asyncio.create_task(s.post(p.url + path, json=pd))
            async with s.post(d.url + path, json=pd) as dresp:
                if body.get("stream"):
                    events = await read_sse(dresp)
                    assert events[-1]["text"] == expected_text(6)
                    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
                else:
                    data = await dresp.json()
                    assert dresp.status == 200, data
                    assert data["choices"][0]["message"]["content"] == expected_text(5)
            presp = await p_task
            assert presp.status == 200
            await presp.read()
            presp.release()
        dm, pm = await scrape(s, d), await scrape(s, p)
        assert dm["pdsim_kv_transfers_total"] == 2
        assert pm["pdsim_requests_total"] == 2
        assert pm["pdsim_prompt_tokens_total"] == 60 + -(-len("<|user|>hi\n<|assistant|>") // 4)
        assert pm["pdsim_kv_rooms"] == 0  # both rooms handed over


async def test_sglang_decode_waits_for_late_prefill(launch: Launch) -> None:
    p, d = launch(prefill_flags(), decode_flags())
    body = {
        "text": "late prefill",
        "sampling_params": {"max_new_tokens": 3, "n": 2},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.bootstrap_port,
        "bootstrap_room": 7,
    }
    async with aiohttp.ClientSession() as s:
        d_task = asyncio.create_task(s.post(d.url + "/generate", json=body))
        await asyncio.sleep(0.3)
        assert not d_task.done(), "decode must wait for the prefill of its room"
        m = await scrape(s, d)
        assert m["pdsim_kv_waiting"] == 2 and m["sglang:num_running_reqs"] == 0  # no slot before the KV
        assert m["sglang:num_decode_transfer_queue_reqs"] == 2  # both samples wait for their KV
        async with s.post(p.url + "/generate", json=body) as presp:
            assert presp.status == 200
            await presp.read()
        dresp = await asyncio.wait_for(d_task, 5)
        data = await dresp.json()
        dresp.release()
        assert dresp.status == 200, data
        assert [c["text"] for c in data] == [expected_text(3)] * 2  # n=2: SGLang answers a list
        assert [c["index"] for c in data] == [0, 1]


async def test_sglang_decode_errors_without_prefill(launch: Launch) -> None:
    p, d = launch(prefill_flags(), decode_flags(8, "--kv-wait-timeout", "0.5"))
    body = {
        "text": "orphan",
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.bootstrap_port,
        "bootstrap_room": 99,
    }
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        async with s.post(d.url + "/generate", json=body) as resp:
            data = await resp.json()
            assert resp.status == 502, data
        assert time.monotonic() - t0 < 5
        assert "KV transfer" in data["error"]["message"]
        assert data["error"]["code"] == "kv_transfer_failed"
        dm = await scrape(s, d)
        assert dm["pdsim_errors_total"] == 1
        assert dm["sglang:num_running_reqs"] == 0


async def test_sglang_aborted_prefill_fails_decode_fast(launch: Launch) -> None:
    p, d = launch(prefill_flags(8, "--prefill-base-ms", "3000"), decode_flags())
    body = {
        "text": "aborted",
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.bootstrap_port,
        "bootstrap_room": 5,
    }
    async with aiohttp.ClientSession() as s:
        p_task = asyncio.create_task(s.post(p.url + "/generate", json=body))
        d_task = asyncio.create_task(s.post(d.url + "/generate", json=body))
        await asyncio.sleep(0.4)
        t0 = time.monotonic()
        p_task.cancel()  # the router gave up: the prefill's client connection closes
        dresp = await asyncio.wait_for(d_task, 5)
        assert dresp.status == 502
        assert "410" in (await dresp.json())["error"]["message"]
        dresp.release()
        assert time.monotonic() - t0 < 2.5, "decode should learn of the abort, not wait for a timeout"
        pm = await scrape(s, p)
        assert pm["pdsim_cancelled_total"] == 1


# ---- vLLM protocol ---------------------------------------------------------------------------


async def test_vllm_pd_completions(launch: Launch) -> None:
    p, d = launch(prefill_flags(), decode_flags())
    original = {
        "prompt": "a" * 300,
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession() as s:
        pbody = {
            **original,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        pbody.pop("stream_options")
        async with s.post(p.url + "/v1/completions", json=pbody) as presp:
            pdata = await presp.json()
            assert presp.status == 200, pdata
        kv = pdata["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True
        assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == p.bootstrap_port
        assert isinstance(kv["remote_request_id"], str) and kv["remote_block_ids"]
        assert pdata["usage"]["completion_tokens"] == 1

        dbody = {**original, "kv_transfer_params": kv}
        async with s.post(d.url + "/v1/completions", json=dbody) as dresp:
            events = await read_sse(dresp)
        text = "".join(c["text"] for e in events for c in e["choices"])
        assert text == expected_text(7)
        assert events[-1]["usage"]["completion_tokens"] == 7
        assert events[-1]["usage"]["prompt_tokens"] == 75

        # The KV was handed over once; a replay (or a made-up id) is an explicit error.
        for params in (kv, {**kv, "remote_request_id": "vllm-nonexistent"}):
            async with s.post(
                d.url + "/v1/completions", json={**original, "kv_transfer_params": params}
            ) as r:
                assert r.status == 502
                assert (await r.json())["error"]["code"] == "kv_transfer_failed"
        bad = {**kv, "remote_port": "x"}
        async with s.post(d.url + "/v1/completions", json={**original, "kv_transfer_params": bad}) as r:
            assert r.status == 400


async def test_vllm_pd_chat_n3(launch: Launch) -> None:
    p, d = launch(prefill_flags(), decode_flags())
    original = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 4, "n": 3}
    async with aiohttp.ClientSession() as s:
        pbody = {
            **original,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        async with s.post(p.url + "/v1/chat/completions", json=pbody) as presp:
            kv = (await presp.json())["kv_transfer_params"]
        async with s.post(
            d.url + "/v1/chat/completions", json={**original, "kv_transfer_params": kv}
        ) as dresp:
            data = await dresp.json()
            assert dresp.status == 200, data
        assert [c["index"] for c in data["choices"]] == [0, 1, 2]
        assert {c["message"]["content"] for c in data["choices"]} == {expected_text(4)}
        assert data["usage"]["completion_tokens"] == 12


async def test_prefill_plain_request_returns_one_token(launch: Launch) -> None:
    (p,) = launch(prefill_flags())
    async with aiohttp.ClientSession() as s:
        async with s.post(p.url + "/v1/completions", json={"prompt": "plain", "max_tokens": 50}) as r:
            data = await r.json()
        assert data["choices"][0]["text"] == expected_text(1)
        assert "kv_transfer_params" not in data
        # A streaming body on prefill gets a short stream.
        async with s.post(p.url + "/generate", json={"text": "plain", "stream": True}) as r:
            events = await read_sse(r)
        assert events[-1]["text"] == expected_text(1)


# ---- the official openai client against a plain decode server --------------------------------


def test_openai_client_plain_decode(launch: Launch) -> None:
    (d,) = launch(decode_flags())
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=10)
    models = client.models.list()
    assert [m.id for m in models.data] == ["pdsim-model"]
    for n in (1, 3):
        chat = client.chat.completions.create(
            model="pdsim-model", messages=[{"role": "user", "content": "hello"}], max_tokens=4, n=n
        )
        assert len(chat.choices) == n
        assert all(
            c.message.content == expected_text(4) and c.finish_reason == "length" for c in chat.choices
        )
        assert chat.usage is not None and chat.usage.completion_tokens == 4 * n

        stream = client.chat.completions.create(
            model="pdsim-model",
            messages=[{"role": "user", "content": "hello"}],
            max_completion_tokens=5,
            n=n,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts = [""] * n
        finish: list[str | None] = [None] * n
        usage = None
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finish[c.index] = c.finish_reason or finish[c.index]
            usage = chunk.usage or usage
        assert texts == [expected_text(5)] * n
        assert finish == ["length"] * n
        assert usage is not None and usage.completion_tokens == 5 * n

        comp = client.completions.create(model="pdsim-model", prompt="once upon", max_tokens=3, n=n)
        assert sorted(c.index for c in comp.choices) == list(range(n))
        assert all(c.text == expected_text(3) for c in comp.choices)

        ctexts = [""] * n
        for cchunk in client.completions.create(
            model="pdsim-model", prompt=[1, 2, 3], max_tokens=6, n=n, stream=True
        ):
            for cc in cchunk.choices:
                ctexts[cc.index] += cc.text
        assert ctexts == [expected_text(6)] * n

    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="pdsim-model", prompt="x", max_tokens=3, n=0)
    assert "'n'" in str(exc.value)


# ---- decode batch: queueing, peak concurrency, cancellation ----------------------------------


async def _fire(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with s.post(url, json=body) as r:
        data: dict[str, Any] = await r.json()
        assert r.status == 200, data
        return data


async def test_burst_over_limit_queues_in_engine(launch: Launch) -> None:
    (d,) = launch(decode_flags(4, "--decode-base-ms", "5"))
    body = {"prompt": "burst", "max_tokens": 10}
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(_fire(s, d.url + "/v1/completions", body) for _ in range(12)))
        assert all(r["choices"][0]["text"] == expected_text(10) for r in results)
        m = await scrape(s, d)
    assert m["pdsim_max_running"] == 4
    assert m["pdsim_queued_total"] >= 1
    assert m["pdsim_requests_total"] == 12
    assert m["pdsim_tokens_total"] == 120
    assert m["sglang:num_running_reqs"] == 0 and m["sglang:num_queue_reqs"] == 0


async def test_gang_of_n_takes_n_slots(launch: Launch) -> None:
    (d,) = launch(decode_flags(4, "--decode-base-ms", "10"))
    body = {"text": "gang", "sampling_params": {"max_new_tokens": 10, "n": 3}}
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(_fire(s, d.url + "/generate", body))
        await asyncio.sleep(0.03)
        m = await scrape(s, d)
        assert m["sglang:num_running_reqs"] == 3
        second = asyncio.create_task(_fire(s, d.url + "/generate", body))
        await asyncio.sleep(0.03)
        m = await scrape(s, d)
        assert m["sglang:num_queue_reqs"] == 3  # 3 + 3 > 4: the second gang waits whole
        await asyncio.gather(first, second)
        m = await scrape(s, d)
    assert m["pdsim_max_running"] == 3
    assert m["pdsim_queued_total"] == 1


async def test_under_limit_never_queues(launch: Launch) -> None:
    (d,) = launch(decode_flags(4, "--decode-base-ms", "5"))
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            await asyncio.gather(
                *(_fire(s, d.url + "/v1/completions", {"prompt": "ok", "max_tokens": 8}) for _ in range(4))
            )
        m = await scrape(s, d)
    assert m["pdsim_queued_total"] == 0
    assert 1 <= m["pdsim_max_running"] <= 4
    assert m["pdsim_requests_total"] == 12


async def test_client_disconnect_frees_slot(launch: Launch) -> None:
    (d,) = launch(decode_flags(1, "--decode-base-ms", "20"))
    async with aiohttp.ClientSession() as s:
        body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 5000, "stream": True}
        resp = await s.post(d.url + "/v1/chat/completions", json=body)
        assert resp.status == 200
        await resp.content.readline()
        await resp.content.readline()
        # A second request waits for the only slot; its client gives up too.
        waiting = asyncio.create_task(
            s.post(d.url + "/v1/completions", json={"prompt": "w", "max_tokens": 5})
        )
        await asyncio.sleep(0.2)
        m = await scrape(s, d)
        assert m["sglang:num_running_reqs"] == 1 and m["sglang:num_queue_reqs"] == 1
        waiting.cancel()
        resp.close()
        t0 = time.monotonic()
        while True:
            m = await scrape(s, d)
            if m["sglang:num_running_reqs"] == 0 and m["sglang:num_queue_reqs"] == 0:
                break
            assert time.monotonic() - t0 < 1.0, m
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        m = await scrape(s, d)
        assert m["pdsim_cancelled_total"] == 2
        assert m["pdsim_tokens_total"] < 5000
        # The freed slot serves the next request at once.
        t1 = time.monotonic()
        data = await _fire(s, d.url + "/v1/completions", {"prompt": "next", "max_tokens": 3})
        assert data["choices"][0]["text"] == expected_text(3)
        assert time.monotonic() - t1 < 1.0


def _dechunk(body: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        eol = body.index(b"\r\n", pos)
        size = int(body[pos:eol].split(b";", 1)[0], 16)
        if size == 0:
            assert body[eol + 2 :] == b"\r\n", body[eol:][:100]
            return bytes(out)
        out += body[eol + 2 : eol + 2 + size]
        assert body[eol + 2 + size : eol + 4 + size] == b"\r\n"
        pos = eol + 4 + size


@pytest.mark.parametrize("http_version", ["1.1", "1.0"])
async def test_stalled_client_does_not_hold_decode_slot(launch: Launch, http_version: str) -> None:
    """Like a real engine, generation runs at its own pace and the running count drops at the last
    token while the output waits, buffered, for a client that does not read (chunked framing for
    HTTP/1.1, until-close for HTTP/1.0)."""
    (d,) = launch(decode_flags(2, "--decode-base-ms", "1", "--decode-per-seq-ms", "0"))
    tokens = 1500  # /generate repeats the whole text in every event: ~8 MB, far over the socket buffers
    body = {"text": "x", "sampling_params": {"max_new_tokens": tokens}, "stream": True}
    sock = post_unread(d.port, "/generate", body, http_version=http_version)
    try:
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 30.0
            while True:
                m = await scrape(s, d)
                if m["pdsim_tokens_total"] == tokens and m["pdsim_running"] == 0:
                    break
                assert time.monotonic() < deadline, m  # generation stalled behind the unread socket
                await asyncio.sleep(0.05)
            assert m["sglang:num_running_reqs"] == 0 and m["sglang:token_usage"] == 0
            # Only now does the client read its answer: all of it is there.
            loop = asyncio.get_running_loop()
            raw = bytearray()
            while data := await loop.run_in_executor(None, sock.recv, 1 << 20):
                raw += data
            m = await scrape(s, d)
            assert m["pdsim_cancelled_total"] == 0
            assert m["pdsim_requests_total"] == 1
    finally:
        sock.close()
    header, _, body = bytes(raw).partition(b"\r\n\r\n")
    status_line, *header_lines = header.decode().split("\r\n")
    assert status_line.startswith(f"HTTP/{http_version} 200"), status_line
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in header_lines)}
    assert headers["content-type"].startswith("text/event-stream")
    if http_version == "1.1":
        assert headers["transfer-encoding"] == "chunked"
        body = _dechunk(body)
    else:
        assert "transfer-encoding" not in headers and "content-length" not in headers
    assert len(body) > 4_000_000
    events = [e for e in body.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert len(chunks) == tokens
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == list(range(1, tokens + 1))
    assert chunks[-1]["text"] == expected_text(tokens)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": tokens}


async def test_stalled_client_going_away_cancels_generation(launch: Launch) -> None:
    """A client that never reads and then disconnects still stops its generation and counts as
    cancelled, although pdsim no longer waits on its socket between tokens."""
    (d,) = launch(decode_flags(1, "--decode-base-ms", "2"))
    body = {"prompt": "x", "max_tokens": 30000, "stream": True}
    sock = post_unread(d.port, "/v1/completions", body, close=False)
    try:
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 30.0
            while (m := await scrape(s, d))["pdsim_tokens_total"] < 100:
                assert time.monotonic() < deadline, m
                await asyncio.sleep(0.02)
            assert m["pdsim_running"] == 1
            sock.close()  # unread data in its buffer: the close resets the connection
            while (m := await scrape(s, d))["pdsim_running"] != 0 or m["pdsim_cancelled_total"] != 1:
                assert time.monotonic() < deadline, m
                await asyncio.sleep(0.02)
            assert m["pdsim_tokens_total"] < 30000
            # The freed slot serves the next request.
            data = await _fire(s, d.url + "/v1/completions", {"prompt": "next", "max_tokens": 3})
            assert data["choices"][0]["text"] == expected_text(3)
    finally:
        sock.close()


# ---- prefill prefix cache --------------------------------------------------------------------


async def test_prefix_cache_hits_and_speeds_up_prefill(launch: Launch) -> None:
    (p,) = launch(prefill_flags(8, "--prefill-per-token-ms", "1"))
    prompt = "".join(chr(65 + i % 26) for i in range(1000))  # 250 tokens, 15 full 64-char blocks
    async with aiohttp.ClientSession() as s:
        timings, cached = [], []
        for _ in range(2):
            t0 = time.monotonic()
            data = await _fire(s, p.url + "/generate", {"text": prompt})
            timings.append(time.monotonic() - t0)
            cached.append(data["meta_info"]["cached_tokens"])
        assert cached == [0, 240]
        assert timings[1] < timings[0] / 2, timings
        # A shared prefix hits partially; input_ids prompts are cached by token blocks.
        data = await _fire(s, p.url + "/generate", {"text": prompt[:640] + "different tail" * 10})
        assert data["meta_info"]["cached_tokens"] == 160
        ids = list(range(100))
        await _fire(s, p.url + "/generate", {"input_ids": ids})
        data = await _fire(s, p.url + "/generate", {"input_ids": ids})
        assert data["meta_info"]["cached_tokens"] == 96
        m = await scrape(s, p)
    assert m["pdsim_prompt_tokens_total"] == 250 * 2 + (160 + 35) + 200
    assert m["pdsim_cached_tokens_total"] == 240 + 160 + 96


# ---- info endpoints and bad input ------------------------------------------------------------


async def test_info_endpoints(launch: Launch) -> None:
    p, d = launch(prefill_flags(6, "--model", "m1"), decode_flags(5))
    async with aiohttp.ClientSession() as s:
        async with s.get(d.url + "/get_server_info") as r:
            info = await r.json()
        assert info["max_running_requests"] == 5 and info["disaggregation_mode"] == "decode"
        async with s.get(p.url + "/get_server_info") as r:
            pinfo = await r.json()
        assert pinfo["max_running_requests"] == 6
        assert pinfo["disaggregation_bootstrap_port"] == p.bootstrap_port > 0
        assert pinfo["model_path"] == "m1"
        async with s.get(p.url + "/get_model_info") as r:
            assert await r.json() == {"model_path": "m1", "is_generation": True}
        async with s.get(d.url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "pdsim-model"
        async with s.get(f"http://127.0.0.1:{p.bootstrap_port}/health") as r:
            assert r.status == 200
        m = await scrape(s, d)
        for name in (
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:token_usage",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "pdsim_queued_total",
            "pdsim_max_running",
            "pdsim_cancelled_total",
            "pdsim_tokens_total",
            "pdsim_prompt_tokens_total",
            "pdsim_cached_tokens_total",
        ):
            assert name in m, name


async def test_token_usage_gauge_moves(launch: Launch) -> None:
    (d,) = launch(decode_flags(2, "--decode-base-ms", "20", "--max-total-tokens", "1000"))
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(
            _fire(s, d.url + "/generate", {"text": "x" * 400, "sampling_params": {"max_new_tokens": 20}})
        )
        await asyncio.sleep(0.15)
        m = await scrape(s, d)
        assert 0.1 <= m["sglang:token_usage"] <= 0.2  # 100 prompt tokens + a few generated, of 1000
        assert m["vllm:kv_cache_usage_perc"] == m["sglang:token_usage"]
        await task
        assert (await scrape(s, d))["sglang:token_usage"] == 0


BAD_INPUTS: list[tuple[str, bytes, str | None]] = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", b'{"max_tokens": 3}', "prompt"),
    ("/v1/completions", b'{"prompt": 5}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "n": 0}', "n"),
    ("/v1/completions", b'{"prompt": "x", "n": 1000}', "n"),
    ("/v1/completions", b'{"prompt": "x", "n": 5}', "n"),  # more than the decode batch
    ("/v1/completions", b'{"prompt": "x", "n": "2"}', "n"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 10000000}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', "stream"),
    ("/v1/completions", b'{"prompt": ["a", [1, 2]]}', "prompt"),  # a batch mixes no prompt forms
    ("/v1/completions", b'{"prompt": ""}', "prompt"),
    ("/v1/chat/completions", b'{"messages": []}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 3}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
        None,
    ),
    ("/generate", b'{"sampling_params": {}}', "text"),
    ("/generate", b'{"text": "a", "input_ids": [1]}', "text"),
    ("/generate", b'{"input_ids": [1, "a"]}', "input_ids"),
    (
        "/generate",
        b'{"text": "a", "sampling_params": {"max_new_tokens": true}}',
        "sampling_params.max_new_tokens",
    ),
    ("/generate", b'{"text": "a", "sampling_params": {"temperature": "hot"}}', "sampling_params.temperature"),
    ("/generate", b'{"text": "a", "bootstrap_room": 3}', "bootstrap_host"),
    ("/generate", b'{"text": "a", "bootstrap_room": -3, "bootstrap_host": "h", "bootstrap_port": 1}', None),
    ("/generate", b'{"text": "a", "kv_transfer_params": [1]}', "kv_transfer_params"),
]


async def test_bad_input_is_400(launch: Launch) -> None:
    (d,) = launch(decode_flags(4, "--max-body-bytes", "4096", "--max-n", "16", "--context-length", "4096"))
    async with aiohttp.ClientSession() as s:
        for path, raw, param in BAD_INPUTS:
            async with s.post(d.url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
                data = await r.json()
                assert r.status == 400, (path, raw, data)
            err = data["error"]
            assert err["message"] and err["type"] == "invalid_request_error", data
            if param is not None:
                assert err["param"] == param, (raw, err)
        async with s.post(d.url + "/v1/completions", json={"prompt": "x" * 10000}) as r:
            assert r.status == 413
            assert "error" in await r.json()
        m = await scrape(s, d)
        assert m["pdsim_bad_requests_total"] == len(BAD_INPUTS) + 1
        assert m["pdsim_requests_total"] == 0
        # And it still serves.
        data = await _fire(s, d.url + "/v1/completions", {"prompt": "fine", "max_tokens": 2})
        assert data["choices"][0]["text"] == expected_text(2)


# ---- the slot pool on its own (in-process: it is the engine's accounting core) ---------------


@pytest.mark.parametrize("seed", range(5))
async def test_slot_pool_is_fifo_bounded_and_leak_free_under_cancellation(seed: int) -> None:
    import random

    from pdsim.slots import SlotPool

    rng = random.Random(seed)
    pool = SlotPool(4)
    granted: list[int] = []
    in_use = 0

    async def user(i: int, n: int) -> None:
        nonlocal in_use
        await pool.acquire(n)
        granted.append(i)
        in_use += n
        try:
            # running also counts slots granted to waiters that have not resumed yet
            assert in_use <= pool.running <= 4
            await asyncio.sleep(rng.random() * 0.003)
        finally:
            in_use -= n
            pool.release(n)

    tasks = []
    for i in range(150):
        tasks.append(asyncio.create_task(user(i, rng.randint(1, 4))))
        if rng.random() < 0.5:
            await asyncio.sleep(0)
        if rng.random() < 0.3:
            rng.choice(tasks).cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results), [
        r for r in results if r is not None and not isinstance(r, asyncio.CancelledError)
    ]
    assert granted == sorted(granted), "grants must follow arrival order"
    assert pool.running == 0 and pool.waiting_slots == 0 and pool.waiting_requests == 0
    assert 1 <= pool.max_running <= 4 and pool.queued_total > 0
    with pytest.raises(ValueError):
        await pool.acquire(5)


# ---- fuzz: arbitrary JSON never gets a 5xx -------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "prompt",
    "messages",
    "text",
    "input_ids",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "sampling_params",
    "bootstrap_room",
    "bootstrap_host",
    "bootstrap_port",
    "kv_transfer_params",
    "model",
    "temperature",
]
bodies = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries({"role": st.sampled_from(["user", "x"]), "content": json_values})
            )
        },
        optional={"n": json_values, "max_tokens": json_values, "stream": json_values},
    ),
    st.fixed_dictionaries(
        {"text": json_values},
        optional={
            "sampling_params": st.dictionaries(
                st.sampled_from(["n", "max_new_tokens", "temperature"]), json_values
            )
        },
    ),
)


def test_fuzz_json_endpoints_never_5xx(launch: Launch) -> None:
    from hypothesis import HealthCheck, given, settings

    (d,) = launch(decode_flags(4, "--context-length", "32", "--max-n", "4", "--kv-wait-timeout", "0.2"))

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions"]), body=bodies)
    def one(path: str, body: object) -> None:
        data = json.dumps(body).encode()
        req = urllib.request.Request(d.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                status = resp.status
                resp.read()
        except urllib.error.HTTPError as exc:
            status = exc.code
            err = json.loads(exc.read())
            assert err["error"]["message"]
        assert status < 500 or status == 502, (path, body, status)

    one()
    with urllib.request.urlopen(d.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert "sglang:num_running_reqs{" in text
    running = [ln for ln in text.splitlines() if ln.startswith("sglang:num_running_reqs")]
    assert running[0].endswith(" 0.0")


async def test_sigterm_with_streams_in_flight_exits_promptly(launch: Launch) -> None:
    (d,) = launch(decode_flags(2, "--decode-base-ms", "50"))
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            d.url + "/generate",
            json={"text": "x", "sampling_params": {"max_new_tokens": 10000}, "stream": True},
        )
        await resp.content.readline()
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        rc = await asyncio.get_running_loop().run_in_executor(None, d.proc.wait, 10)
        assert rc == 0
        assert time.monotonic() - t0 < 4.0
        resp.close()
