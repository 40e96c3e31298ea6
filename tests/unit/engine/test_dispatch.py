"""The SGLang dispatch path in-process: body splicing, prefill failure while D waits, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web

from pdmaster.engine import EngineError, EnginePool, make_dispatch, with_bootstrap


@dataclass(frozen=True)
class Node:
    """What dispatch needs of a registry node."""

    node_id: str
    endpoint: str
    bootstrap_port: int | None = None


@pytest.mark.parametrize(
    "raw",
    [b"{}", b'{"prompt": "a}b", "max_tokens": 3}  \n', b' {"n": 1}', b'{"bootstrap_room": 7, "x": 1}'],
)
def test_with_bootstrap_keeps_the_body_and_sets_the_three_fields(raw: bytes) -> None:
    body = json.loads(raw)
    out = json.loads(with_bootstrap(raw, body, "10.0.0.7", 9000, 42))
    assert out == {**body, "bootstrap_host": "10.0.0.7", "bootstrap_port": 9000, "bootstrap_room": 42}


def test_with_bootstrap_without_raw_encodes_the_body() -> None:
    out = json.loads(with_bootstrap(None, {"a": [1, 2]}, "h", 1, 2))
    assert out == {"a": [1, 2], "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 2}


@contextlib.asynccontextmanager
async def _pool() -> AsyncIterator[EnginePool]:
    pool = EnginePool()
    try:
        yield pool
    finally:
        await pool.close()


class Engines:
    def __init__(self) -> None:
        self.prefill_status = 200
        self.prefill_delay = 0.05
        self.decode_started = asyncio.Event()
        self.decode_requests = 0
        self.decode_cancelled = asyncio.Event()
        self.bodies: list[dict[str, object]] = []
        self.prefill_answer: dict[str, object] = {"ok": True}
        self.prefill_answered = asyncio.Event()

    async def prefill(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        await asyncio.sleep(self.prefill_delay)
        self.prefill_answered.set()
        return web.json_response(self.prefill_answer, status=self.prefill_status)

    async def decode(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.decode_requests += 1
        self.decode_started.set()
        if self.prefill_status != 200:
            try:
                await asyncio.sleep(30)  # waits for a KV transfer that never comes
            except asyncio.CancelledError:
                self.decode_cancelled.set()
                raise
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: {}\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
async def engines() -> AsyncIterator[tuple[Engines, str]]:
    eng = Engines()
    app = web.Application()
    app.router.add_post("/p/v1/completions", eng.prefill)
    app.router.add_post("/d/v1/completions", eng.decode)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield eng, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_sglang_dispatch_streams_from_decode(engines: tuple[Engines, str]) -> None:
    eng, base = engines
    raw = b'{"prompt": "hi", "stream": true}'
    async with _pool() as pool:
        d = make_dispatch("sglang", pool)
        up = await d.open(
            "/v1/completions", json.loads(raw), Node("p", base + "/p", 9), Node("d", base + "/d"), {}, raw
        )
        body = await up.read()
        await up.close()
    assert body.endswith(b"data: [DONE]\n\n")
    assert len(eng.bodies) == 2 and eng.bodies[0] == eng.bodies[1]
    assert eng.bodies[0]["bootstrap_port"] == 9 and eng.bodies[0]["bootstrap_host"] == "127.0.0.1"


async def test_prefill_failure_ends_the_wait_for_decode(engines: tuple[Engines, str]) -> None:
    eng, base = engines
    eng.prefill_status = 500
    async with _pool() as pool:
        d = make_dispatch("sglang", pool)
        with pytest.raises(EngineError) as info:
            async with asyncio.timeout(5):
                await d.open(
                    "/v1/completions",
                    {"prompt": "x"},
                    Node("p", base + "/p", 9),
                    Node("d", base + "/d"),
                    {},
                )
    assert info.value.status == 502 and "prefill p" in info.value.message
    await asyncio.wait_for(eng.decode_cancelled.wait(), 5)


async def test_cancelling_the_caller_cancels_both_sides(engines: tuple[Engines, str]) -> None:
    eng, base = engines
    eng.prefill_status = 500  # D waits for KV
    eng.prefill_delay = 30
    async with _pool() as pool:
        d = make_dispatch("sglang", pool)
        task = asyncio.create_task(
            d.open("/v1/completions", {"prompt": "x"}, Node("p", base + "/p", 9), Node("d", base + "/d"), {})
        )
        await asyncio.wait_for(eng.decode_started.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await asyncio.wait_for(eng.decode_cancelled.wait(), 5)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_the_decode_request_going_out_is_reported_once(
    engines: tuple[Engines, str], protocol: str
) -> None:
    """The lease counts as held by D from the moment D's request went out: with SGLang's protocol at
    once (P and D get the body together, long before P answers), with vLLM's only after P answered."""
    eng, base = engines
    eng.prefill_delay = 1.0
    eng.prefill_answer = {"kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": 1}}
    seen: list[bool] = []
    async with _pool() as pool:
        d = make_dispatch(protocol, pool)
        up = await d.open(
            "/v1/completions",
            {"prompt": "hi", "stream": True},
            Node("p", base + "/p", 9),
            Node("d", base + "/d"),
            {},
            None,
            lambda: seen.append(eng.prefill_answered.is_set()),
        )
        await up.read()
        await up.close()
    assert seen == [protocol == "vllm"]


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_no_decode_request_goes_to_a_node_this_master_lost(
    engines: tuple[Engines, str], protocol: str
) -> None:
    """Asked just before D's request would go out (after the prefill under vLLM's protocol): a node
    whose stream this master lost meanwhile gets none, and the error lets another pair serve it."""
    eng, base = engines
    eng.prefill_answer = {"kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": 1}}
    asked: list[bool] = []

    def may_send() -> bool:
        asked.append(eng.prefill_answered.is_set())
        return False

    async with _pool() as pool:
        d = make_dispatch(protocol, pool)
        with pytest.raises(EngineError) as err:
            await d.open(
                "/v1/completions", {"prompt": "hi"}, Node("p", base + "/p", 9), Node("d", base + "/d"), {},
                None, None, may_send,
            )  # fmt: skip
    assert err.value.kind == "lost" and err.value.status == 503 and err.value.node == "d"
    assert not eng.decode_started.is_set()
    assert asked == [protocol == "vllm"]  # vLLM asks once P has answered; SGLang before either


async def test_a_node_lost_while_the_prefill_request_went_out_gets_no_decode_request(
    engines: tuple[Engines, str],
) -> None:
    """SGLang's protocol asks before P's request and again with D's connection in hand: sending P may
    await a new connection, across which this process may have stood still and lost the node. Then
    D gets nothing, P's request is dropped, and the error lets another pair serve it."""
    eng, base = engines
    answers = iter([True, False])
    asked: list[bool] = []

    def may_send() -> bool:
        asked.append(True)
        return next(answers)

    async with _pool() as pool:
        d = make_dispatch("sglang", pool)
        with pytest.raises(EngineError) as err:
            await d.open(
                "/v1/completions", {"prompt": "hi"}, Node("p", base + "/p", 9), Node("d", base + "/d"), {},
                None, None, may_send,
            )  # fmt: skip
        assert err.value.kind == "lost" and err.value.node == "d"
        assert len(asked) == 2
        # the connection opened for D stays for the next request: the pool sends it there
        opened = pool.opened
        up = await make_dispatch("sglang", pool).open(
            "/v1/completions", {"prompt": "hi", "stream": True}, Node("p", base + "/p", 9),
            Node("d", base + "/d"), {},
        )  # fmt: skip
        await up.read()
        await up.close()
        assert pool.opened == opened + 1  # P's aborted connection is replaced; D's was reused
    assert eng.decode_requests == 1  # the refused decode request never reached D
