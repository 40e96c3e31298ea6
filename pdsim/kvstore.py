"""The prefill side of a simulated KV transfer: rooms that a decode server can wait for.

A *room* is keyed by SGLang's ``bootstrap_room`` (as a decimal string) or by the ``remote_request_id``
pdsim hands out in vLLM's ``kv_transfer_params``. The decode server may ask before the prefill server
has even seen the request (SGLang sends both at once), so waiting on an unknown room creates it.

A decode's first poll of a room is its *attach* (SGLang's bootstrap): in model mode the prefill does
not start computing a room's request before its decode has attached, which the decode does only once
it has preallocated the KV, so a full decode server stalls the prefills feeding it. The store also
counts the prefill tokens computed for rooms that were handed over and for rooms that were not.
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
    computed: int = 0  # prefill tokens computed for it (model mode)
    touched: float = field(default_factory=time.monotonic)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    attached: asyncio.Event = field(default_factory=asyncio.Event)


class KVStore:
    def __init__(self, ttl_s: float, max_rooms: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_rooms = max_rooms
        self._rooms: OrderedDict[str, Room] = OrderedDict()
        self.transferred_tokens = 0  # prefill tokens of rooms a decode took
        self.wasted_tokens = 0  # prefill tokens of rooms aborted, evicted or never claimed

    def _drop(self, room: Room) -> None:
        if room.status == "done":
            self.wasted_tokens += room.computed
            room.computed = 0

    def __len__(self) -> int:
        return len(self._rooms)

    def _get(self, key: str) -> Room:
        room = self._rooms.get(key)
        if room is None:
            room = self._rooms[key] = Room()
            while len(self._rooms) > self.max_rooms:
                _, old = self._rooms.popitem(last=False)
                self._drop(old)
                old.event.set()  # wakes any waiter; it sees a non-done room and gives up
        else:
            self._rooms.move_to_end(key)
        room.touched = time.monotonic()
        return room

    def begin(self, key: str) -> None:
        room = self._get(key)
        if room.status != "pending":
            # A reused room id: start over.
            self._drop(room)
            self._rooms[key] = Room()

    def finish(self, key: str, prompt_tokens: int, computed: int = 0) -> None:
        room = self._get(key)
        room.status, room.prompt_tokens, room.computed = "done", prompt_tokens, computed
        room.event.set()

    def abort(self, key: str, computed: int = 0) -> None:
        """The prefill failed or its client left; ``computed`` prefill tokens were spent on it."""
        room = self._get(key)
        if room.status == "pending":
            room.status = "aborted"
            self.wasted_tokens += computed
            room.event.set()

    async def wait_attached(self, keys: list[str], timeout_s: float) -> bool:
        """Wait until a decode has polled each of ``keys`` (it holds KV for them); False on timeout."""
        rooms = [self._get(k) for k in keys]
        pending = [r.attached.wait() for r in rooms if not r.attached.is_set()]
        if not pending:
            return True
        try:
            await asyncio.wait_for(asyncio.gather(*pending), timeout_s)
        except TimeoutError:
            return False
        return True

    async def wait(self, key: str, timeout_s: float) -> Status:
        """Wait up to ``timeout_s`` for the room's prefill; a done room hands its KV over (is removed)."""
        room = self._get(key)
        room.attached.set()
        if room.status == "pending" and timeout_s > 0:
            try:
                await asyncio.wait_for(room.event.wait(), timeout_s)
            except TimeoutError:
                pass
        if room.status == "done" and self._rooms.get(key) is room:
            del self._rooms[key]
            self.transferred_tokens += room.computed
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
            self._drop(room)
            room.event.set()
            dropped += 1
        return dropped
