"""Model mode's adapter: one asyncio task runs an :class:`EngineModel`'s step loop in (scaled) real time.

One timer per step (``asyncio.sleep(duration x time_scale x slow)``), never a coroutine per token:
each step's tokens are handed to the requests' callbacks synchronously (a streaming handler writes
them straight to its transport), so a step costs O(batch) whatever the clients do.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Hashable

from pdsim.engine_model import EngineModel, ModelRequest, StepEvents

log = logging.getLogger("pdsim")


class Ticket:
    """A request's link to the step loop."""

    __slots__ = ("allocated", "done", "generated", "on_tokens", "rid")

    def __init__(self, rid: int) -> None:
        loop = asyncio.get_running_loop()
        self.rid = rid
        self.generated = 0  # tokens per sequence so far
        self.allocated: asyncio.Future[None] = loop.create_future()  # decode PD: KV preallocated
        self.done: asyncio.Future[None] = loop.create_future()  # finished (or failed)
        # Called with the new token count after each step that produced tokens; an exception (the
        # client went away) cancels the request and fails ``done`` with it.
        self.on_tokens: Callable[[int], None] | None = None


class BatchRunner:
    def __init__(self, model: EngineModel, time_scale: float, slow: Callable[[], float]) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.model = model
        self.time_scale = time_scale
        self._slow = slow
        self._ids = itertools.count(1)
        self._tickets: dict[Hashable, Ticket] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="pdsim-step-loop")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def engine_time(self, seconds: float) -> float:
        """Wall seconds for ``seconds`` of engine time."""
        return seconds * self.time_scale * self._slow()

    def new_id(self) -> int:
        return next(self._ids)

    def submit(self, r: ModelRequest) -> Ticket:
        """Queue a request (``r.rid`` from :meth:`new_id`); raises what ``EngineModel.add`` raises."""
        if self._task is None or self._task.done():
            raise RuntimeError("the step loop is not running")
        assert isinstance(r.rid, int)
        self.model.add(r)
        ticket = self._tickets[r.rid] = Ticket(r.rid)
        self._wake.set()
        return ticket

    def transferred(self, rid: int) -> None:
        self.model.transferred(rid)
        self._wake.set()

    def cancel(self, rid: int) -> None:
        """Drop a request (client gone, error, or already finished: then a no-op); its KV is free at once."""
        self._tickets.pop(rid, None)
        if self.model.cancel(rid):
            self._wake.set()  # freed KV or a slot: someone may be admitted

    async def _loop(self) -> None:
        model = self.model
        try:
            while True:
                self._wake.clear()
                duration = model.plan_step()
                self._dispatch(model.take_events())
                if duration is None:
                    await self._wake.wait()
                    continue
                await asyncio.sleep(self.engine_time(duration))
                self._dispatch(model.finish_step())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("engine step loop failed")
            for t in self._tickets.values():
                if not t.done.done():
                    t.done.set_exception(RuntimeError(f"engine step loop failed: {exc!r}"))
            raise

    def _dispatch(self, ev: StepEvents) -> None:
        if not ev:
            return
        tickets = self._tickets
        for rid in ev.allocated:
            t = tickets.get(rid)
            if t is not None and not t.allocated.done():
                t.allocated.set_result(None)
        for rid, k in ev.tokens.items():
            t = tickets.get(rid)
            if t is None:
                continue
            t.generated = k
            if t.on_tokens is not None:
                try:
                    t.on_tokens(k)
                except Exception as exc:  # the client went away mid-stream
                    self.cancel(t.rid)
                    if not t.done.done():
                        t.done.set_exception(exc)
        for rid in ev.finished:
            t = tickets.pop(rid, None)
            if t is not None and not t.done.done():
                t.done.set_result(None)
