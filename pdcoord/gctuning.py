"""Garbage-collector settings for the master, whose request path allocates the most.

CPython's default (a young-generation collection every 700 net container allocations) scanned the
master's in-flight requests several times a second under load, and each full collection walked every
module, protobuf descriptor and aiohttp object loaded at start-up: about 3 % of its CPU at 350
requests/s (and 10 % while every request still left a reference cycle behind, see
``pdmaster.engine.pool.Exchange._finish``). Requests leave no cyclic garbage, so collecting rarely
costs nothing but a little memory.

``tune_gc`` is called once start-up is done: it moves everything alive then into the permanent
generation (never scanned again) and raises the young threshold. Reference cycles are still
collected, just in batches.
"""

from __future__ import annotations

import asyncio
import gc

__all__ = ["YOUNG_THRESHOLD", "collect_soon", "tune_gc"]

# Net container allocations between two young collections: at a few hundred requests per second a
# young collection about once a second, each bounded by what is allocated and alive meanwhile.
YOUNG_THRESHOLD = 50_000
# Young collections per middle collection, middle per full (CPython's own full-collection
# heuristic still skips a full collection until the long-lived heap has grown by 25 %).
MIDDLE_EVERY = 20
FULL_EVERY = 100


def tune_gc(young: int = YOUNG_THRESHOLD) -> None:
    """Freeze what start-up allocated and collect rarely (see the module docstring)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(young, MIDDLE_EVERY, FULL_EVERY)


_collect_pending = False


def collect_soon(delay: float) -> None:
    """One full collection ``delay`` seconds from now on the running loop, however often this is
    called meanwhile (so many callers at once, e.g. hundreds of agents in one process, cost one).

    For garbage that holds a resource until it is collected: a gRPC aio call object sits in a
    reference cycle of its own, and while it exists its channel's transport stays alive after
    ``channel.close()`` and keeps redialling its address.
    """
    global _collect_pending
    if _collect_pending:
        return
    _collect_pending = True

    def run() -> None:
        global _collect_pending
        _collect_pending = False
        gc.collect()

    asyncio.get_running_loop().call_later(delay, run)
