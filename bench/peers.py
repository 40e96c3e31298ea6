"""Helpers shared by the peer benchmarks: process CPU from /proc, the load generator, the environment."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime+stime seconds) of one process, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: split after the last ')'
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """utime+stime of *pid* and its live descendants (a launcher may fork its workers)."""
    children: dict[int, list[int]] = {}
    own: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st is not None:
            children.setdefault(st[0], []).append(int(entry))
            own[int(entry)] = st[1]
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += own.get(p, 0.0)
        todo += children.get(p, [])
    return total


def cpu_seconds_by_thread(pid: int) -> dict[str, float]:
    """utime+stime of *pid*'s threads, summed by thread name: ``python`` is the interpreter's
    threads (the event loop among them), ``event_engine`` and the ``grpc``-named ones gRPC's C core,
    which sends and answers keep-alive pings without the interpreter."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                text = f.read().decode()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def run_loadgen(args: list[str], watch: dict[str, int], timeout: float = 300.0) -> dict[str, Any]:
    """Run the load generator in its own process; CPU seconds of each watched pid between its START
    and END lines."""
    argv = [sys.executable, "-m", "pdcoord.dev.loadgen", *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    result: dict[str, Any] | None = None
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        line = line.strip()
        if line == "START":
            before = {k: cpu_seconds(p) for k, p in watch.items()}
        elif line == "END":
            after = {k: cpu_seconds(p) for k, p in watch.items()}
        elif line.startswith("{"):
            result = json.loads(line)
        if time.monotonic() > deadline:
            proc.kill()
            break
    err = proc.stderr.read() if proc.stderr else ""
    proc.wait(30)
    if result is None:
        raise RuntimeError(f"loadgen failed (exit {proc.returncode}): {err[-2000:]}")
    result["cpu_s"] = {k: round(after[k] - before[k], 3) for k in watch if k in before and k in after}
    return result


def median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def environment() -> dict[str, Any]:
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        model = "?"
    try:
        load = os.getloadavg()
    except OSError:
        load = (0.0, 0.0, 0.0)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    # results/ itself changes while benchmarks run: only code changes make the tree dirty
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", ".", ":!bench/results"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if dirty:
        commit += "-dirty"
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in load],
        "commit": commit,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def pyplot() -> Any:
    """matplotlib.pyplot (Agg), or None when the bench extra is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: pip install -e '.[bench]' for the plots", file=sys.stderr)
        return None
    return plt


def git_commit(ref: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", ref], capture_output=True, text=True, check=True
    ).stdout.strip()


def baseline_env(tree: str) -> dict[str, str]:
    """Environment under which a ``python -m`` process imports the code in ``tree`` (a baseline
    checkout): PYTHONSAFEPATH keeps the working directory off sys.path, so PYTHONPATH wins."""
    return {"PYTHONPATH": tree, "PYTHONSAFEPATH": "1"}


def checkout_baseline(ref: str) -> str:
    """A detached worktree of ``ref`` under the temp dir (reused when it is already there)."""
    commit = git_commit(ref)
    tree = Path(tempfile.gettempdir()) / f"pdcoord-baseline-{commit[:12]}"
    if not (tree / "pdmaster").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=True)
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit],
            check=True,
            capture_output=True,
        )
    return str(tree)
