"""The master's lifecycle: a drain that times out cancels the requests still in flight."""

from __future__ import annotations

import asyncio

from pdmaster.lifecycle import Lifecycle


async def test_cancel_in_flight_ends_every_request_and_the_master_is_idle() -> None:
    life = Lifecycle()
    ended: list[str] = []

    async def request(name: str) -> None:
        life.enter()
        try:
            await asyncio.Event().wait()  # a stream that would never end by itself
        finally:
            ended.append(name)
            life.leave()

    tasks = [asyncio.create_task(request(n)) for n in ("a", "b")]
    await asyncio.sleep(0)
    assert life.in_flight == 2
    assert not await life.wait_idle(0.01)
    assert life.cancel_in_flight() == 2
    assert await life.wait_idle(5.0)
    assert sorted(ended) == ["a", "b"] and all(t.cancelled() for t in tasks)
    assert life.cancel_in_flight() == 0  # nothing left to cancel
