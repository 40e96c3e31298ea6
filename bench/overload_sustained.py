"""The sustained-overload plots: every 180 s run of ``overload_bench.py`` merged, a point per
contender and load (the median of its runs) → ``results/overload_sustained.json`` and
``overload_sustained_*.png``. Rerun after adding a 180 s run:
``.venv/bin/python bench/overload_sustained.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import overload_bench as ob
from peers import write_json

Row = dict[str, Any]

# (results file, which of its rows): the runs the bench README's sustained table quotes
SOURCES: list[tuple[str, Callable[[Row], bool]]] = [
    ("overload_long.json", lambda r: r["contender"].startswith("sgl") and r["load"] == 1.5),
    ("overload_long15_sgl.json", lambda r: r["contender"] == "sgl"),
    ("overload_long15_sgl_run3.json", lambda r: r["contender"] == "sgl"),
    ("overload_long2x_sgl.json", lambda r: r["contender"].startswith("sgl")),
    ("overload_final15.json", lambda r: True),
    ("overload_final2.json", lambda r: True),
    (
        "overload_long_ttft.json",
        lambda r: r["contender"] in ("pdcoord-1-ttft", "pdcoord-1-vllm-staged50-ttft"),
    ),
]


def main() -> None:
    base: dict[str, Any] = json.loads((ob.RESULTS / "overload_long_ttft.json").read_text())
    sweep: list[Row] = []
    for name, keep in SOURCES:
        sweep += [r for r in json.loads((ob.RESULTS / name).read_text())["sweep"] if keep(r)]
    counts: dict[tuple[str, float], int] = {}
    for r in sweep:  # number the runs of each point, as --repeats would
        key = (r["contender"], r["load"])
        r["repeat"] = counts.get(key, 0)
        counts[key] = r["repeat"] + 1
    base["sweep"], base["burst"] = sweep, {}
    base["notes"] = {
        "what": "180 s runs merged for the plots (each point the median of its runs), from "
        + ", ".join(name for name, _ in SOURCES)
        + " (bench/overload_sustained.py)"
    }
    base["plots"] = ob.plot(base, "overload_sustained")
    print(ob.table(base))
    print(f"wrote {write_json('overload_sustained.json', base)}")


if __name__ == "__main__":
    main()
