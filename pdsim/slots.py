"""The decode batch's slot accounting: at most ``capacity`` sequences run at once, the rest wait FIFO.

A request with n choices needs n slots at once (it joins the batch as one gang). ``queued_total``
counts every request that could not start the moment it arrived — the number end-to-end tests read
to prove that the master's admission kept the engine within its limit.

The over-capacity check (decode servers, ``check_capacity``): the pool never *runs* more than
``capacity`` sequences, it makes the rest wait, so what it checks is what a router *put* on the batch:
a request is *held* from the moment its KV is in and it asks for slots until it releases them, and
``over_capacity_total`` counts every request that became held while the held sequences (running +
waiting for a slot, its own included) exceeded ``capacity`` — a router that admitted more than the
engine's ``running_max_req_size``. ``held_high_water`` is the peak of held sequences.
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
    def __init__(self, capacity: int, *, check_capacity: bool = True) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.check_capacity = check_capacity
        self.running = 0
        self.max_running = 0
        self.queued_total = 0
        self.over_capacity_total = 0  # requests that became held beyond capacity (see the module doc)
        self.held_high_water = 0  # peak of running + waiting-for-a-slot sequences
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
        if self.check_capacity:
            self._check_held(n)
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

    def _check_held(self, n: int) -> None:
        held = self.running + self._waiting_slots + n
        if held > self.capacity:
            # Rare: recount without waiters whose task was cancelled but has not left the queue yet
            # (their client went away in this same loop tick; they will never run).
            held = self.running + n + sum(w.n for w in self._waiters if not w.future.cancelled())
            if held > self.capacity:
                self.over_capacity_total += 1
        self.held_high_water = max(self.held_high_water, held)

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
