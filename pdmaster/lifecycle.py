"""The master's one notion of registered and draining, and the count of requests in flight that a
drain waits for.

Until its key is in etcd no agent knows the master, and /health and /readiness say so (a start may
wait there for a predecessor's lease to end). A master that can no longer prove its lease alive (no
renewal confirmed in time: etcd unreachable) has *lost its lease* until etcd confirms it again or it
re-registers: it grants nothing new meanwhile, the HTTP API refuses new requests with 503 and
readiness fails. The HTTP API refuses new requests while draining,
readiness reports it, and the gRPC service tells the agents in its Acks (so they can take this
master out of the split once its queue is empty).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["Lifecycle"]


class Lifecycle:
    def __init__(self) -> None:
        self._registered: Callable[[], bool] = lambda: False
        self._lease_lost: Callable[[], bool] = lambda: False
        self.draining = False
        self.in_flight = 0
        self._tasks: set[asyncio.Task[object]] = set()  # the requests in flight, to cancel them
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def registered(self) -> bool:
        """Its key is in etcd under a lease it can prove alive (a renewal confirmed in time)."""
        return self._registered()

    def registered_while(self, alive: Callable[[], bool]) -> None:
        self._registered = alive

    @property
    def lease_lost(self) -> bool:
        """It was registered and can no longer prove its lease alive (it re-registers meanwhile)."""
        return self._lease_lost()

    def lease_lost_while(self, lost: Callable[[], bool]) -> None:
        self._lease_lost = lost

    def start_draining(self) -> bool:
        """Returns False when the master was draining already."""
        if self.draining:
            return False
        self.draining = True
        return True

    def enter(self) -> None:
        """A request starts, in the task that serves it."""
        self.in_flight += 1
        self._idle.clear()
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)

    def leave(self) -> None:
        self.in_flight -= 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.discard(task)
        if self.in_flight == 0:
            self._idle.set()

    def cancel_in_flight(self) -> int:
        """Cancel the requests still in flight (their leases are released and their engine
        connections closed, which cancels them in the engines); returns how many."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        return len(tasks)

    async def wait_idle(self, timeout: float) -> bool:
        """Until no request is in flight; False when ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
