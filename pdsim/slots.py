"""The decode batch's slot accounting: at most ``capacity`` sequences run at once, the rest wait FIFO.

A request with n choices needs n slots at once (it joins the batch as one gang). ``queued_total``
counts every request that could not start the moment it arrived — the number end-to-end tests read
to prove that the master's admission kept the engine within its limit.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Waiter:
    n: int
    future: asyncio.Future[None] = field(repr=False)
    granted: bool = False
    dropped: bool = False  # taken off the queue by _grant because its future was cancelled


class SlotPool:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.running = 0
        self.max_running = 0
        self.queued_total = 0
        self._waiters: deque[_Waiter] = deque()
        self._waiting_slots = 0

    @property
    def waiting_requests(self) -> int:
        return len(self._waiters)

    @property
    def waiting_slots(self) -> int:
        return self._waiting_slots

    def _take(self, n: int) -> None:
        self.running += n
        self.max_running = max(self.max_running, self.running)

    async def acquire(self, n: int) -> None:
        """Wait until n slots are free (FIFO: nobody overtakes an older waiter)."""
        if not 0 < n <= self.capacity:
            raise ValueError(f"a request needs 1..{self.capacity} slots, got {n}")
        if not self._waiters and self.running + n <= self.capacity:
            self._take(n)
            return
        self.queued_total += 1
        waiter = _Waiter(n, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._waiting_slots += n
        try:
            await waiter.future
        except BaseException:
            if waiter.granted:
                # Granted and cancelled in the same tick: give the slots back.
                self.release(n)
            elif not waiter.dropped:
                self._waiters.remove(waiter)
                self._waiting_slots -= n
                self._grant()  # it may have been the head, blocking smaller waiters behind it
            raise

    def release(self, n: int) -> None:
        if n > self.running:
            raise RuntimeError(f"releasing {n} slots with only {self.running} running")
        self.running -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            head = self._waiters[0]
            if head.future.cancelled():
                # Its task has not run its cleanup yet; drop it here so nobody waits behind it.
                self._waiters.popleft()
                self._waiting_slots -= head.n
                head.dropped = True
                continue
            if self.running + head.n > self.capacity:
                break
            self._waiters.popleft()
            self._waiting_slots -= head.n
            self._take(head.n)
            head.granted = True
            head.future.set_result(None)
