"""pdsim model mode (--profile): real processes on loopback, the engine model seen through HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from tests.cluster import test_pdsim
from tests.cluster.test_pdsim import Launch, Sim, decode_flags, expected_text, prefill_flags, read_sse, scrape

# test_pdsim's process fixture, registered here as "spawn".
spawn = test_pdsim.launch

DEADLINE_S = 30.0  # generous: a small, loaded machine
PROFILE = ["--profile", "llama3-8b-h100"]


async def until(check: Callable[[], Awaitable[bool]], what: str, deadline_s: float = DEADLINE_S) -> None:
    end = time.monotonic() + deadline_s
    while not await check():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def metric(s: aiohttp.ClientSession, sim: Sim, name: str) -> float:
    return (await scrape(s, sim)).get(name, -1.0)


async def test_model_decode_serves_exact_tokens_and_exports_its_metrics(spawn: Launch) -> None:
    (d,) = spawn(decode_flags(8, *PROFILE, "--time-scale", "2", "--api", "sglang"))
    async with aiohttp.ClientSession() as s:
        body = {"text": "hello " * 50, "sampling_params": {"max_new_tokens": 12}, "stream": True}
        async with s.post(d.url + "/generate", json=body) as resp:
            events = await read_sse(resp)
        assert [e["text"] for e in events] == [expected_text(k) for k in range(1, 13)]
        assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}
        async with s.post(d.url + "/v1/chat/completions", json=chat) as resp:
            data = await resp.json()
            assert resp.status == 200, data
        assert [c["message"]["content"] for c in data["choices"]] == [expected_text(4)] * 2
        comp = {"prompt": "x" * 64, "max_tokens": 3, "stream": True}
        async with s.post(d.url + "/v1/completions", json=comp) as resp:
            chunks = await read_sse(resp)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected_text(3)
        async with s.get(d.url + "/get_server_info") as resp:
            info = await resp.json()
        # The profile's pool: (80 GB x 0.9 - 16 GB) / 128 KiB per token.
        assert info["max_total_num_tokens"] == int((80e9 * 0.9 - 16e9) // (128 * 1024))
        m = await scrape(s, d)
        for name in (
            "sglang:num_running_reqs",
            "sglang:num_queue_reqs",
            "sglang:num_decode_prealloc_queue_reqs",
            "sglang:num_decode_transfer_queue_reqs",
            "sglang:token_usage",
            "sglang:num_retracted_requests_total",
            "sglang:num_retracted_input_tokens_total",
            "sglang:num_retracted_output_tokens_total",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:num_preemptions_total",
            "pdsim_recomputed_tokens_total",
            "pdsim_max_waiting",
            "pdsim_queued_total",
        ):
            assert name in m, name
        assert m["pdsim_tokens_total"] == 12 + 8 + 3
        assert m["pdsim_queued_total"] == 0  # one request at a time never waits
        assert m["sglang:token_usage"] == 0 and m["sglang:num_running_reqs"] == 0


async def test_model_queue_cap_answers_503(spawn: Launch) -> None:
    (d,) = spawn(decode_flags(1, *PROFILE, "--time-scale", "4", "--max-queued-requests", "1"))
    long_body = {"text": "hold", "sampling_params": {"max_new_tokens": 5000}, "stream": True}
    async with aiohttp.ClientSession() as s:
        first = await s.post(d.url + "/generate", json=long_body)
        await first.content.readline()  # running: it holds the only batch slot
        second = asyncio.create_task(s.post(d.url + "/generate", json=long_body))

        async def one_waiting() -> bool:
            return await metric(s, d, "sglang:num_queue_reqs") == 1

        await until(one_waiting, "the second request to wait")
        async with s.post(d.url + "/generate", json=long_body) as third:
            assert third.status == 503
            err = await third.json()
        assert err["error"]["message"] == "The request queue is full."
        first.close()  # the client goes away: its slot and KV are freed at once
        resp2 = await second
        assert resp2.status == 200
        await resp2.content.readline()  # now running
        resp2.close()

        async def idle() -> bool:
            m = await scrape(s, d)
            return m["sglang:num_running_reqs"] == 0 and m["sglang:token_usage"] == 0

        await until(idle, "the engine to free both requests")
        m = await scrape(s, d)
        assert m["pdsim_queued_total"] == 1 and m["pdsim_max_waiting"] == 1


async def test_full_decode_server_stalls_the_prefill(spawn: Launch) -> None:
    # A decode pool of 3000 tokens: the first request (2400 prompt + 590 new tokens) fits; the second
    # (400 + 400) does not fit beside it, so the decode does not attach to its room.
    p, d = spawn(
        prefill_flags(8, *PROFILE, "--time-scale", "2", "--api", "sglang"),
        decode_flags(8, *PROFILE, "--time-scale", "2", "--api", "sglang", "--max-total-tokens", "3000"),
    )

    def pd_body(room: int, text: str, max_new: int) -> dict[str, Any]:
        return {
            "text": text,
            "sampling_params": {"max_new_tokens": max_new},
            "stream": True,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": p.bootstrap_port,
            "bootstrap_room": room,
        }

    async with aiohttp.ClientSession() as s:
        b1 = pd_body(1, "a" * 9600, 590)
        p1 = asyncio.create_task(s.post(p.url + "/generate", json=b1))
        d1 = await s.post(d.url + "/generate", json=b1)
        assert d1.status == 200
        await d1.content.readline()  # the first is decoding and holds most of the pool
        (await p1).release()
        b2 = pd_body(2, "b" * 1600, 400)
        p2 = asyncio.create_task(s.post(p.url + "/generate", json=b2))
        d2 = asyncio.create_task(s.post(d.url + "/generate", json=b2))

        async def in_prealloc() -> bool:
            return await metric(s, d, "sglang:num_decode_prealloc_queue_reqs") == 1

        await until(in_prealloc, "the second request to wait for KV on the decode server")
        await asyncio.sleep(1.0)
        assert not p2.done(), "the prefill must wait for its decode server to attach"
        pm = await scrape(s, p)
        assert pm["pdsim_prompt_tokens_total"] == 2400  # the second prompt was not computed yet
        assert not d2.done()
        # One stalled room does not block the prefill's other requests.
        async with s.post(
            p.url + "/generate", json={"text": "other", "sampling_params": {"max_new_tokens": 1}}
        ) as r:
            assert r.status == 200
        d1.close()  # the long request goes away: its KV is freed, the second preallocates
        presp = await asyncio.wait_for(p2, DEADLINE_S)
        assert presp.status == 200
        presp.release()
        dresp = await asyncio.wait_for(d2, DEADLINE_S)
        events = await asyncio.wait_for(read_sse(dresp), DEADLINE_S)
        assert events[-1]["text"] == expected_text(400)
        pm = await scrape(s, p)
        assert pm["pdsim_prompt_tokens_total"] == 2800 + 2
        assert pm["pdsim_prefill_tokens_total"] == 2800  # both rooms' prefill work was transferred
        dm = await scrape(s, d)
        assert dm["pdsim_kv_transfers_total"] == 2
        assert dm["pdsim_queued_total"] == 1  # the second waited in the prealloc queue


async def test_vllm_protocol_in_model_mode(spawn: Launch) -> None:
    p, d = spawn(
        prefill_flags(4, *PROFILE, "--time-scale", "2", "--api", "vllm"),
        decode_flags(4, *PROFILE, "--time-scale", "2", "--api", "vllm"),
    )
    body = {"messages": [{"role": "user", "content": "tell me"}], "max_tokens": 6, "n": 2}
    async with aiohttp.ClientSession() as s:
        first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        async with s.post(p.url + "/v1/chat/completions", json=first) as resp:
            pdata = await resp.json()
            assert resp.status == 200, pdata
        params = pdata["kv_transfer_params"]
        second = {**body, "kv_transfer_params": params}
        async with s.post(d.url + "/v1/chat/completions", json=second) as resp:
            data = await resp.json()
            assert resp.status == 200, data
        assert [c["message"]["content"] for c in data["choices"]] == [expected_text(6)] * 2
        dm = await scrape(s, d)
        assert dm["pdsim_kv_transfers_total"] == 1
        assert dm["vllm:num_requests_running"] == 0 and dm["vllm:kv_cache_usage_perc"] == 0
        pm = await scrape(s, p)
        assert pm["pdsim_prefill_tokens_total"] > 0


async def test_priority_scheduling_serves_the_higher_priority_first(spawn: Launch) -> None:
    (d,) = spawn(decode_flags(1, *PROFILE, "--time-scale", "4", "--enable-priority-scheduling"))
    long_body = {"text": "hold", "sampling_params": {"max_new_tokens": 5000}, "stream": True}
    async with aiohttp.ClientSession() as s:
        first = await s.post(d.url + "/generate", json=long_body)
        await first.content.readline()  # running: it holds the only batch slot
        low = asyncio.create_task(s.post(d.url + "/generate", json={**long_body, "priority": 0}))

        def waiting(k: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return await metric(s, d, "sglang:num_queue_reqs") == k

            return check

        await until(waiting(1), "the low-priority request to wait")
        high = asyncio.create_task(s.post(d.url + "/generate", json={**long_body, "priority": 5}))
        await until(waiting(2), "both requests to wait")
        first.close()  # the slot comes free: the later, higher-priority request takes it
        resp_high = await asyncio.wait_for(high, DEADLINE_S)
        assert resp_high.status == 200
        await asyncio.wait_for(resp_high.content.readline(), DEADLINE_S)
        assert await metric(s, d, "sglang:num_queue_reqs") == 1  # the earlier, low one still waits
        resp_high.close()
        resp_low = await asyncio.wait_for(low, DEADLINE_S)
        assert resp_low.status == 200
        await asyncio.wait_for(resp_low.content.readline(), DEADLINE_S)
        resp_low.close()
        async with s.post(d.url + "/generate", json={**long_body, "priority": "high"}) as bad:
            assert bad.status == 400
            assert (await bad.json())["error"]["param"] == "priority"


async def test_vllm_refuses_a_priority_without_priority_scheduling(spawn: Launch) -> None:
    (d,) = spawn(decode_flags(2, *PROFILE, "--time-scale", "2", "--api", "vllm"))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 1}
    async with aiohttp.ClientSession() as s:
        async with s.post(d.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
        assert err["param"] == "priority" and "Priority scheduling is not enabled" in err["message"]
        async with s.post(d.url + "/v1/chat/completions", json={**body, "priority": 0}) as resp:
            assert resp.status == 200, await resp.text()


async def test_model_answer_ends_early_with_stop_and_engine_defaults(spawn: Launch) -> None:
    # No --running-max-req-size: the engine's own default for the profile's pool (SGLang: 2048 for
    # the 8B profile at Llama 3.1's 128k context; vLLM on an H100: 1024, the pool in whole blocks).
    d, v = spawn(
        ["--role", "decode", *PROFILE, "--time-scale", "2", "--api", "sglang"],
        ["--role", "decode", *PROFILE, "--time-scale", "2", "--api", "vllm", "--running-max-req-size", "0"],
    )
    pool = int((80e9 * 0.9 - 16e9) // (128 * 1024))
    async with aiohttp.ClientSession() as s:
        async with s.get(d.url + "/get_server_info") as resp:
            info = await resp.json()
        assert info["max_running_requests"] == 2048
        assert info["max_total_num_tokens"] == pool and info["context_length"] == 131072
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True,
                "pdsim_answer_tokens": 6}  # fmt: skip
        for sim in (d, v):
            async with s.post(sim.url + "/v1/chat/completions", json=chat) as resp:
                chunks = await read_sse(resp)
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
            assert text == expected_text(6)
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
        # An answer as long as max_tokens (or longer) is cut: "length", SGLang's meta_info too.
        body = {"text": "hello", "sampling_params": {"max_new_tokens": 3}, "pdsim_answer_tokens": 9}
        async with s.post(d.url + "/generate", json=body) as resp:
            out = await resp.json()
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        body["pdsim_answer_tokens"] = 2
        async with s.post(d.url + "/generate", json=body) as resp:
            out = await resp.json()
        assert (
            out["meta_info"]["finish_reason"]["type"] == "stop" and out["meta_info"]["completion_tokens"] == 2
        )
        body["pdsim_answer_tokens"] = 0
        async with s.post(d.url + "/generate", json=body) as resp:
            assert resp.status == 400
        # The same by header, or at the end of the prompt, for routers that drop unknown fields.
        plain = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30}
        async with s.post(
            d.url + "/v1/chat/completions", json=plain, headers={"X-Pdsim-Answer-Tokens": "4"}
        ) as resp:
            out = await resp.json()
        assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 4
        marked = {"messages": [{"role": "user", "content": "hi <pdsim-answer-tokens=5>"}], "max_tokens": 30}
        async with s.post(v.url + "/v1/chat/completions", json=marked) as resp:
            out = await resp.json()
        assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 5
        async with s.get(v.url + "/metrics") as resp:
            text = await resp.text()
        (line,) = [ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{")]
        labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(","))
        blocks, size = int(labels["num_gpu_blocks"].strip('"')), int(labels["block_size"].strip('"'))
        assert size == 16 and blocks == pool // 16
        m = await scrape(s, v)
        assert m["pdsim_capacity"] == 1024
        assert "vllm:cache_config_info" not in await scrape(s, d)


async def test_model_prefill_publishes_its_queued_prefill_tokens(spawn: Launch) -> None:
    (p,) = spawn(prefill_flags(8, *PROFILE, "--time-scale", "20", "--api", "sglang"))
    async with aiohttp.ClientSession() as s:
        assert await metric(s, p, "pdsim_prefill_queued_tokens") == 0
        body = {"text": "y" * 4 * 8000, "sampling_params": {"max_new_tokens": 1}}
        task = asyncio.ensure_future(s.post(p.url + "/generate", json=body))
        await until(lambda: _positive(s, p, "pdsim_prefill_queued_tokens"), "queued prefill tokens")
        resp = await task
        assert resp.status == 200
        resp.release()
        assert await metric(s, p, "pdsim_prefill_queued_tokens") == 0


async def _positive(s: aiohttp.ClientSession, sim: Sim, name: str) -> bool:
    return await metric(s, sim, name) > 0
