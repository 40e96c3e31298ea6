"""The collector settings the master applies once it has started (in a child interpreter, so the
test process keeps CPython's defaults)."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys

from pdcoord.gctuning import collect_soon

SCRIPT = """
import gc
from pdcoord.gctuning import YOUNG_THRESHOLD, tune_gc
before = gc.get_freeze_count()
tune_gc()
assert gc.get_threshold()[0] == YOUNG_THRESHOLD, gc.get_threshold()
assert gc.get_freeze_count() > before, "start-up objects were not frozen"
# cycles are still collected
class Node:
    pass
a, b = Node(), Node()
a.other, b.other = b, a
del a, b
assert gc.collect() >= 2
print("ok")
"""


def test_tune_gc_freezes_start_up_and_keeps_collecting_cycles() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


async def test_collect_soon_runs_one_collection_however_often_it_is_asked() -> None:
    full: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.callbacks.append(count)
    was_enabled = gc.isenabled()
    gc.disable()  # only the collections asked for are counted
    try:
        for _ in range(200):  # a swarm process's agents dropping the same master at once
            collect_soon(0.05)
        assert not full  # later, not now
        await asyncio.sleep(0.3)
        assert len(full) == 1
        collect_soon(0.05)  # a later drop gets its own collection
        await asyncio.sleep(0.3)
        assert len(full) == 2
    finally:
        gc.callbacks.remove(count)
        if was_enabled:
            gc.enable()
