"""pdsim --api sglang|vllm: each engine's routes, request checks, load and discovery endpoints.

These are the checks a real engine makes, so a router that sends the wrong shape fails here rather
than only against GPUs.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import aiohttp

from tests.cluster.test_pdsim_faults import DEADLINE_S, Launch, Sim, eventually, set_faults, sims

__all__ = ["sims"]  # the fixture, shared with the fault tests


async def post(session: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    async with session.post(url, json=body, **kw) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text) if text else text
        except json.JSONDecodeError:
            return resp.status, text


def room() -> int:
    return secrets.randbits(62)


def pd(prefill: Sim, body: dict[str, Any], rooms: Any) -> dict[str, Any]:
    return {
        **body,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": rooms,
    }


async def metric(session: aiohttp.ClientSession, sim: Sim, name: str) -> float:
    async with session.get(sim.url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


# ---- vLLM --------------------------------------------------------------------------------------


async def test_vllm_flavour_serves_only_vllm_routes(sims: Launch) -> None:
    d = sims("decode", "--api", "vllm", "--context-length", "4096", "--model", "m-v")
    async with aiohttp.ClientSession() as s:
        status, _ = await post(s, d.url + "/generate", {"text": "hi"})
        assert status == 404
        for path in ("/get_server_info", "/server_info", "/get_model_info", "/get_load", "/v1/loads"):
            assert (await get(s, d.url + path))[0] == 404, path
        assert (await get(s, d.url + "/health_generate"))[0] == 404
        assert await get(s, d.url + "/health") == (200, "")
        assert await get(s, d.url + "/load") == (200, {"server_load": 0})
        status, models = await get(s, d.url + "/v1/models")
        assert (
            status == 200 and models["data"][0]["id"] == "m-v" and models["data"][0]["max_model_len"] == 4096
        )
        assert await metric(s, d, "vllm:num_requests_running") == 0.0
        status, out = await post(s, d.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 200 and out["choices"][0]["text"] == " tok1 tok2"


async def test_vllm_min_tokens_above_max_tokens_is_400(sims: Launch) -> None:
    d = sims("decode", "--api", "vllm", "--context-length", "4096")
    p = sims("prefill", "--api", "vllm")
    both = sims("decode")
    async with aiohttp.ClientSession() as s:
        status, out = await post(
            s, d.url + "/v1/completions", {"prompt": "hi", "max_tokens": 1, "min_tokens": 5}
        )
        assert status == 400
        assert out["error"]["message"] == "min_tokens must be less than or equal to max_tokens=1, got 5."
        assert out["error"]["param"] == "min_tokens"
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2, "min_tokens": 3}
        assert (await post(s, d.url + "/v1/chat/completions", chat))[0] == 400
        assert (await post(s, d.url + "/v1/completions", {"prompt": "hi", "min_tokens": -1}))[0] == 400
        ok = [
            {"prompt": "hi", "max_tokens": 3, "min_tokens": 3},
            {"prompt": "hi", "min_tokens": 100},  # without max_tokens vLLM's limit is the context
        ]
        for body in ok:
            assert (await post(s, d.url + "/v1/completions", body))[0] == 200, body
        # The vLLM PD prefill leg is max_tokens=1: a router that forwards the client's min_tokens
        # there gets every request refused.
        leg = {"prompt": "hi", "max_tokens": 1, "min_tokens": 4, "stream": False}
        leg["kv_transfer_params"] = {"do_remote_decode": True}
        assert (await post(s, p.url + "/v1/completions", leg))[0] == 400
        # The default flavour stays lenient.
        assert (
            await post(s, both.url + "/v1/completions", {"prompt": "hi", "max_tokens": 1, "min_tokens": 5})
        )[0] == 200


async def test_vllm_rejects_a_request_id_already_running(sims: Launch) -> None:
    d = sims("decode", "--api", "vllm", "--admin-port", "0")
    headers = {"X-Request-Id": "dup-1"}
    async with aiohttp.ClientSession() as s:
        await set_faults(s, d, hang_after_chunks=1)
        body = {"prompt": "hi", "max_tokens": 4, "stream": True}
        first = await s.post(d.url + "/v1/completions", json=body, headers=headers)
        assert first.status == 200
        line = b""
        while not line.strip():
            line = await asyncio.wait_for(first.content.readline(), DEADLINE_S)
        status, out = await post(
            s, d.url + "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers=headers
        )
        assert status == 400 and out["error"]["message"] == "Request id cmpl-dup-1 already running."
        # Streaming, vLLM reports it inside the stream after a 200.
        async with s.post(d.url + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            text = await resp.text()
        event = json.loads(text.split("\n")[0].removeprefix("data: "))
        assert event["error"]["code"] == 400 and "already running" in event["error"]["message"]
        assert text.rstrip().endswith("data: [DONE]")
        await set_faults(s, d, "DELETE")
        # Chat names its requests chatcmpl-<id>: no clash with the completion still running.
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert (await post(s, d.url + "/v1/chat/completions", chat, headers=headers))[0] == 200
        first.close()

        async def reusable() -> bool:
            status, _ = await post(
                s, d.url + "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers=headers
            )
            return status == 200

        await eventually(reusable, "the id to be free once its request ended")


async def test_vllm_pd_flow_passes_the_strict_checks(sims: Launch) -> None:
    p = sims("prefill", "--api", "vllm")
    d = sims("decode", "--api", "vllm")
    headers = {"X-Request-Id": "same-id-on-both"}  # as vLLM's PD proxy sends it
    async with aiohttp.ClientSession() as s:
        leg = {
            "prompt": "hello",
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        status, out = await post(s, p.url + "/v1/completions", leg, headers=headers)
        assert status == 200, out
        body = {
            "prompt": "hello",
            "max_tokens": 3,
            "min_tokens": 2,
            "kv_transfer_params": out["kv_transfer_params"],
        }
        status, out = await post(s, d.url + "/v1/completions", body, headers=headers)
        assert status == 200 and out["choices"][0]["text"] == " tok1 tok2 tok3"


async def test_vllm_accepts_the_prompt_forms_vllm_does(sims: Launch) -> None:
    """vLLM's CompletionRequest.prompt: a string, a list of strings, a list of token ids, or a list
    of lists of token ids; choices numbered prompt by prompt. The lenient flavour takes them too."""
    d = sims("decode", "--api", "vllm")
    lenient = sims("decode")
    async with aiohttp.ClientSession() as s:
        forms: list[tuple[Any, int]] = [
            ("one", 1),
            (["one", "two", "three"], 3),
            ([11, 12, 13], 1),
            ([[11, 12], [13], [14, 15, 16]], 3),
            (["only"], 1),
        ]
        for sim in (d, lenient):
            for prompt, count in forms:
                status, out = await post(
                    s, sim.url + "/v1/completions", {"prompt": prompt, "n": 2, "max_tokens": 2}
                )
                assert status == 200, (prompt, out)
                assert [c["index"] for c in out["choices"]] == list(range(2 * count)), out
                assert out["usage"]["completion_tokens"] == 2 * 2 * count
        body = {"prompt": ["a", "b"], "max_tokens": 2, "stream": True}
        async with s.post(d.url + "/v1/completions", json=body) as resp:
            text = await resp.text()
        events = [json.loads(x) for x in text.split("data: ")[1:] if not x.startswith("[DONE]")]
        assert {c["index"] for e in events for c in e["choices"]} == {0, 1}
        # What vLLM's request model refuses, pdsim refuses.
        for bad in (["a", [1, 2]], [1, "a"], [["a"]], {"text": "a"}, 7):
            status, out = await post(s, d.url + "/v1/completions", {"prompt": bad})
            assert status == 400 and out["error"]["param"] == "prompt", (bad, out)
        # A batch in a PD leg: vLLM answers with the first prompt's kv_transfer_params only.
        status, out = await post(
            s,
            d.url + "/v1/completions",
            {"prompt": ["a", "b"], "kv_transfer_params": {"do_remote_decode": True}},
        )
        assert status == 400 and out["error"]["code"] == "batch_with_kv_transfer_params", out
        # vLLM has no /generate, batch or not.
        assert (await post(s, d.url + "/generate", {"text": ["a", "b"]}))[0] == 404


# ---- SGLang ------------------------------------------------------------------------------------


async def test_sglang_refuses_one_room_for_many_samples(sims: Launch) -> None:
    p = sims("prefill", "--api", "sglang")
    d = sims("decode", "--api", "sglang")
    async with aiohttp.ClientSession() as s:
        cases: list[tuple[str, dict[str, Any], str]] = [
            ("/generate", {"text": "hi", "sampling_params": {"n": 2}}, "n=2"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, "n=3"),
            ("/v1/completions", {"prompt": ["a", "b"]}, "batch of 2 prompts"),
            ("/generate", {"text": ["a", "b"]}, "batch of 2 prompts"),
            ("/generate", {"input_ids": [[1, 2], [3]], "sampling_params": {"n": 2}}, "with n=2"),
        ]
        for path, body, words in cases:
            for sim in (p, d):
                status, out = await post(s, sim.url + path, pd(p, body, room()))
                assert status == 400, (path, body, out)
                err = out["error"]
                assert err["code"] == "shared_bootstrap_room" and err["param"] == "bootstrap_room"
                assert words in err["message"] and "same bootstrap room" in err["message"]
        bad_lists = [[room(), room()], [7, 7, 8]]  # n=3: too few rooms; a repeated room
        for rooms in bad_lists:
            body = pd(p, {"text": "hi", "sampling_params": {"n": 3}}, rooms)
            assert (await post(s, d.url + "/generate", body))[0] == 400, rooms
        m = "sampling_params"
        bad_min = {"text": "hi", m: {"max_new_tokens": 2, "min_new_tokens": 3}}
        status, out = await post(s, d.url + "/generate", bad_min)
        assert status == 400 and "min_new_tokens" in out["error"]["message"]


async def test_default_flavour_still_shares_one_room(sims: Launch) -> None:
    p = sims("prefill")
    d = sims("decode")
    async with aiohttp.ClientSession() as s:
        body = pd(p, {"text": "hi", "sampling_params": {"n": 2, "max_new_tokens": 2}}, room())
        (ps, _), (ds, out) = await asyncio.gather(
            post(s, p.url + "/generate", body), post(s, d.url + "/generate", body)
        )
        assert ps == 200 and ds == 200 and [o["index"] for o in out] == [0, 1]
        assert await metric(s, d, "pdsim_kv_transfers_total") == 1.0


async def test_sglang_room_per_sample_and_per_prompt_is_served(sims: Launch) -> None:
    p = sims("prefill", "--api", "sglang")
    d = sims("decode", "--api", "sglang", "--kv-wait-timeout", "1.5")
    async with aiohttp.ClientSession() as s:

        async def both_legs(path: str, body: dict[str, Any]) -> Any:
            (ps, pout), (ds, dout) = await asyncio.gather(
                post(s, p.url + path, body), post(s, d.url + path, body)
            )
            assert ps == 200, pout
            assert ds == 200, dout
            return dout

        out = await both_legs(
            "/generate", pd(p, {"text": "hi", "sampling_params": {"max_new_tokens": 2}}, room())
        )
        assert out["text"] == " tok1 tok2"  # one sample, one integer room: fine
        rooms = [room() for _ in range(3)]
        out = await both_legs(
            "/generate", pd(p, {"text": "hi", "sampling_params": {"n": 3, "max_new_tokens": 2}}, rooms)
        )
        assert [o["index"] for o in out] == [0, 1, 2] and {o["text"] for o in out} == {" tok1 tok2"}
        assert await metric(s, d, "pdsim_kv_transfers_total") == 1.0 + 3
        # What the prefill received is what the router sent.
        async with s.get(p.url + "/admin/requests", params={"path": "/generate"}) as resp:
            assert (await resp.json())["requests"][-1]["body"]["bootstrap_room"] == rooms

        chat = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 1}
        out = await both_legs("/v1/chat/completions", pd(p, chat, [room(), room()]))
        assert [c["index"] for c in out["choices"]] == [0, 1]

        # A batch: two prompts x n=2, one room per output, prompt-major.
        batch = {"prompt": ["a" * 40, "b" * 8], "n": 2, "max_tokens": 2}
        out = await both_legs("/v1/completions", pd(p, batch, [room() for _ in range(4)]))
        assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
        assert out["usage"]["prompt_tokens"] == 10 + 2 and out["usage"]["completion_tokens"] == 8
        gen = {"text": ["a" * 40, "b" * 8], "rid": ["r-a", "r-b"]}
        out = await both_legs("/generate", pd(p, gen, [room(), room()]))
        assert [o["meta_info"]["prompt_tokens"] for o in out] == [10, 2]
        assert await metric(s, d, "pdsim_kv_transfers_total") == 1.0 + 3 + 2 + 4 + 2

        # Each sample waits for its own room: a room the prefill never saw fails the request.
        a, b = room(), room()
        body_d = pd(p, {"text": "hi", "sampling_params": {"n": 2}}, [a, b])
        body_p = pd(p, {"text": "hi", "sampling_params": {"n": 2}}, [a, room()])
        (ps, _), (ds, dout) = await asyncio.gather(
            post(s, p.url + "/generate", body_p), post(s, d.url + "/generate", body_d)
        )
        assert ps == 200 and ds == 502 and dout["error"]["code"] == "kv_transfer_failed"
        assert str(b) in dout["error"]["message"]


async def test_sglang_discovery_fields(sims: Launch) -> None:
    p = sims("prefill", "--api", "sglang", "--model", "m-s", capacity=6)
    d = sims("decode", "--api", "sglang", "--model", "m-s", capacity=5)
    async with aiohttp.ClientSession() as s:
        _, pinfo = await get(s, p.url + "/get_server_info")
        _, dinfo = await get(s, d.url + "/get_server_info")
    assert pinfo["max_running_requests"] == 6 and dinfo["max_running_requests"] == 5
    assert pinfo["disaggregation_mode"] == "prefill" and dinfo["disaggregation_mode"] == "decode"
    assert pinfo["disaggregation_bootstrap_port"] == p.bootstrap_port > 0
    assert dinfo["disaggregation_bootstrap_port"] is None
    for info in (pinfo, dinfo):
        assert info["served_model_name"] == info["model_path"] == "m-s"


async def test_sglang_load_endpoints_count_running_and_waiting(sims: Launch) -> None:
    d = sims("decode", "--api", "sglang", "--admin-port", "0", capacity=2)
    async with aiohttp.ClientSession() as s:
        assert await get(s, d.url + "/get_load") == (
            200,
            [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}],
        )
        await set_faults(s, d, hang_after_chunks=1)  # holds its sequences in the batch
        held = await s.post(
            d.url + "/generate", json={"text": "hi", "sampling_params": {"n": 2}, "stream": True}
        )
        waiting = asyncio.create_task(post(s, d.url + "/generate", {"text": "later"}))

        async def counted() -> bool:
            _, load = await get(s, d.url + "/get_load")
            return bool(load[0]["num_reqs"] == 3 and load[0]["num_waiting_reqs"] == 1)

        await eventually(counted, "2 running + 1 waiting in /get_load")
        _, load = await get(s, d.url + "/get_load")
        assert load[0]["num_tokens"] > 0
        status, loads = await get(s, d.url + "/v1/loads")
        assert status == 200 and loads["dp_rank_count"] == 1 and loads["version"]
        (one,) = loads["loads"]
        assert one["num_running_reqs"] == 2 and one["num_waiting_reqs"] == 1 and one["num_total_reqs"] == 3
        assert one["max_running_requests"] == 2 and one["dp_rank"] == 0
        assert 0 < one["token_usage"] <= 1 and one["num_used_tokens"] > 0
        assert "disaggregation" not in one  # core only, as SGLang without ?include
        agg = loads["aggregate"]
        assert agg["total_running_reqs"] == 2 and agg["total_waiting_reqs"] == 1 and agg["total_reqs"] == 3
        _, full = await get(s, d.url + "/v1/loads?include=all")
        assert full["loads"][0]["disaggregation"]["mode"] == "decode"
        assert full["loads"][0]["queues"]["waiting"] == 1
        status, err = await get(s, d.url + "/v1/loads?include=core,bogus")
        assert status == 400 and "bogus" in err["message"]
        # Both requests arrived under the fault, so both stall: their clients leaving frees everything.
        held.close()
        waiting.cancel()

        async def idle() -> bool:
            _, load = await get(s, d.url + "/get_load")
            return bool(load[0]["num_reqs"] == 0)

        await eventually(idle, "the load to drop back to 0")


async def test_sglang_metrics_off_and_plain_health(sims: Launch) -> None:
    off = sims("decode", "--api", "sglang", "--disable-metrics")
    on = sims("decode", "--api", "sglang")
    async with aiohttp.ClientSession() as s:
        assert (await get(s, off.url + "/metrics"))[0] == 404
        assert (await get(s, on.url + "/metrics"))[0] == 200
        assert await get(s, off.url + "/health") == (200, "")
        assert (await get(s, off.url + "/health_generate"))[0] == 200
        assert (await get(s, off.url + "/load"))[0] == 404  # vLLM's, not SGLang's


async def test_sglang_reject_mode_refuses_parallel_sampling_with_rooms(sims: Launch) -> None:
    p = sims("prefill", "--api", "sglang", "--sglang-sample-rooms", "reject")
    d = sims("decode", "--api", "sglang", "--sglang-sample-rooms", "reject")
    async with aiohttp.ClientSession() as s:
        for rooms in ([room(), room()], room()):
            body = pd(p, {"text": "hi", "sampling_params": {"n": 2}}, rooms)
            status, out = await post(s, d.url + "/generate", body)
            assert status == 400 and out["error"]["code"] == "parallel_sampling_in_pd", out
        # One room per prompt of a batch is what SGLang does serve.
        body = pd(p, {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 1}}, [room(), room()])
        (ps, _), (ds, out) = await asyncio.gather(
            post(s, p.url + "/generate", body), post(s, d.url + "/generate", body)
        )
        assert ps == 200 and ds == 200 and len(out) == 2
        # Without PD fields n > 1 is an ordinary request.
        status, out = await post(s, d.url + "/generate", {"text": "hi", "sampling_params": {"n": 2}})
        assert status == 200 and len(out) == 2
