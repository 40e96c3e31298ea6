"""How much of the replayed trace a prefix cache can hold: the share of prompt blocks that an LRU cache of
a given size finds cached, replaying the Mooncake conversation trace's first requests in order.

Why. The overload bench's prefill engines find about 5 % of prompt tokens cached
(``prefill_cache_hit_share``). This says whether that is the trace or the engines' cache size: each
request's hash blocks (512 tokens each, clipped to the bench's longest prompt) are looked up as a prefix
chain in one LRU cache of blocks, the best a cache-aware router over that much KV could do.

    .venv/bin/python bench/trace_reuse.py --requests 1100 --capacity-tokens 131072,854016,0

(0: no limit). Writes ``bench/results/trace_reuse.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
TRACE = BENCH / "traces" / "mooncake-fast25" / "conversation_trace.jsonl"
BLOCK_TOKENS = 512  # the trace's hash_ids are 512-token blocks
MAX_INPUT = 32768  # as bench/overload_bench.py clips prompts


def hit_share(rows: list[dict[str, object]], capacity_blocks: int) -> float:
    """Cached prefix blocks over all prompt blocks, replaying ``rows`` through one LRU (0: unbounded)."""
    lru: OrderedDict[tuple[int, ...], None] = OrderedDict()
    total = hits = 0
    for row in rows:
        ids = list(row["hash_ids"])[: MAX_INPUT // BLOCK_TOKENS]  # type: ignore[call-overload]
        keys = [tuple(ids[: i + 1]) for i in range(len(ids))]
        matched = 0
        for key in keys:  # a prefix chain: the first miss ends the match
            if key not in lru:
                break
            matched += 1
        for key in keys:
            lru[key] = None
            lru.move_to_end(key)
        while capacity_blocks and len(lru) > capacity_blocks:
            lru.popitem(last=False)
        total += len(keys)
        hits += matched
    return hits / total if total else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--requests", type=int, default=1100, help="the trace's first N requests (a 180 s run's)")
    p.add_argument(
        "--capacity-tokens",
        default="131072,854016,0",
        help="comma-separated cache sizes in tokens (0: no limit)",
    )
    p.add_argument("--out", type=Path, default=BENCH / "results" / "trace_reuse.json")
    args = p.parse_args(argv)
    try:
        capacities = [int(x) for x in args.capacity_tokens.split(",") if x.strip()]
    except ValueError:
        p.error(f"--capacity-tokens: comma-separated integers, got {args.capacity_tokens!r}")
    if args.requests <= 0 or any(c < 0 for c in capacities):
        p.error("--requests must be positive and --capacity-tokens not negative")
    with open(args.trace) as f:
        rows = [json.loads(line) for line, _ in zip(f, range(args.requests), strict=False) if line.strip()]
    results = [
        {"capacity_tokens": c, "hit_share": round(hit_share(rows, c // BLOCK_TOKENS), 4)} for c in capacities
    ]
    for r in results:
        size = r["capacity_tokens"] or "unbounded"
        print(f"cache {size} tokens: {r['hit_share']:.1%} of prompt blocks cached")
    out = {
        "benchmark": "trace_reuse",
        "command": " ".join(
            [".venv/bin/python", "bench/trace_reuse.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "trace": str(args.trace.relative_to(BENCH.parent))
        if args.trace.is_relative_to(BENCH.parent)
        else str(args.trace),
        "requests": len(rows),
        "block_tokens": BLOCK_TOKENS,
        "max_input_tokens": MAX_INPUT,
        "results": results,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
