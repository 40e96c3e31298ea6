"""The prefill side of a simulated KV transfer: rooms that a decode server can wait for.

A *room* is keyed by SGLang's ``bootstrap_room`` (as a decimal string) or by the ``remote_request_id``
pdsim hands out in vLLM's ``kv_transfer_params``. The decode server may ask before the prefill server
has even seen the request (SGLang sends both at once), so waiting on an unknown room creates it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["pending", "done", "aborted"]


@dataclass(slots=True)
class Room:
    status: Status = "pending"
    prompt_tokens: int = 0
    touched: float = field(default_factory=time.monotonic)
    event: asyncio.Event = field(default_factory=asyncio.Event)


class KVStore:
    def __init__(self, ttl_s: float, max_rooms: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_rooms = max_rooms
        self._rooms: OrderedDict[str, Room] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rooms)

    def _get(self, key: str) -> Room:
        room = self._rooms.get(key)
        if room is None:
            room = self._rooms[key] = Room()
            while len(self._rooms) > self.max_rooms:
                _, old = self._rooms.popitem(last=False)
                old.event.set()  # wakes any waiter; it sees a non-done room and gives up
        else:
            self._rooms.move_to_end(key)
        room.touched = time.monotonic()
        return room

    def begin(self, key: str) -> None:
        room = self._get(key)
        if room.status != "pending":
            # A reused room id: start over.
            self._rooms[key] = Room()

    def finish(self, key: str, prompt_tokens: int) -> None:
        room = self._get(key)
        room.status, room.prompt_tokens = "done", prompt_tokens
        room.event.set()

    def abort(self, key: str) -> None:
        room = self._get(key)
        if room.status == "pending":
            room.status = "aborted"
            room.event.set()

    async def wait(self, key: str, timeout_s: float) -> Status:
        """Wait up to ``timeout_s`` for the room's prefill; a done room hands its KV over (is removed)."""
        room = self._get(key)
        if room.status == "pending" and timeout_s > 0:
            try:
                await asyncio.wait_for(room.event.wait(), timeout_s)
            except TimeoutError:
                pass
        if room.status == "done" and self._rooms.get(key) is room:
            del self._rooms[key]
        return room.status

    def purge(self) -> int:
        """Drop rooms nobody has touched for ``ttl_s`` (never fetched, or never prefilled)."""
        cutoff = time.monotonic() - self.ttl_s
        dropped = 0
        # Rooms are kept in touch order, so the stale ones are at the front.
        while self._rooms:
            key, room = next(iter(self._rooms.items()))
            if room.touched >= cutoff:
                break
            del self._rooms[key]
            room.event.set()
            dropped += 1
        return dropped
