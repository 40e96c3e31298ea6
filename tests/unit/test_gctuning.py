"""The collector settings the master applies once it has started (in a child interpreter, so the
test process keeps CPython's defaults)."""

from __future__ import annotations

import subprocess
import sys

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
