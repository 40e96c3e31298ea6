"""The agent reads whether its engine schedules by priority (SGLang's /get_server_info), so that
masters with --engine-priority auto send a priority only where it is understood."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web

from nodeagent.probe import discover_engine


async def _engine(info: dict[str, Any]) -> tuple[web.AppRunner, str]:
    app = web.Application()

    async def server_info(_request: web.Request) -> web.Response:
        return web.json_response(info)

    app.router.add_get("/get_server_info", server_info)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"enable_priority_scheduling": False}, None),
        ({"enable_priority_scheduling": True}, "high-first"),
        ({"enable_priority_scheduling": True, "schedule_low_priority_values_first": True}, "low-first"),
        ({"enable_priority_scheduling": "yes"}, None),  # not SGLang's shape: no claim
    ],
)
async def test_priority_order_from_server_info(fields: dict[str, Any], expected: str | None) -> None:
    runner, url = await _engine({"max_running_requests": 8, "max_total_num_tokens": 1000, **fields})
    try:
        async with aiohttp.ClientSession() as session:
            info = await discover_engine(url, session)
    finally:
        await runner.cleanup()
    assert info.flavour == "sglang" and info.max_running_requests == 8 and info.kv_tokens == 1000
    assert info.priority_scheduling == expected
