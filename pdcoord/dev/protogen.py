"""Regenerate (or check) the committed protobuf modules.

``python -m pdcoord.dev.protogen`` writes ``pdcoord/v1/*_pb2*.py(i)`` from ``proto/`` and the frozen
legacy schema's module under ``tests/frozen/``; ``--check`` fails when a fresh generation differs
from what is committed, so the wire contract and the code never drift apart.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# (proto include root, proto file relative to it, output root)
TARGETS = [
    (ROOT / "proto", "pdcoord/v1/coordination.proto", ROOT),
    (ROOT / "tests" / "frozen", "coordination_v0.proto", ROOT / "tests" / "frozen"),
]


def _generate(include: Path, proto: str, out: Path) -> None:
    from grpc_tools import protoc  # dev dependency; imported lazily

    args = [
        "protoc",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(include / proto),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed for {proto}")


def _outputs(proto: str) -> list[str]:
    stem = proto.removesuffix(".proto")
    return [f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed modules are stale")
    args = parser.parse_args(argv)
    stale: list[str] = []
    for include, proto, out in TARGETS:
        with tempfile.TemporaryDirectory() as tmp:
            _generate(include, proto, Path(tmp))
            for name in _outputs(proto):
                fresh, committed = Path(tmp) / name, out / name
                if args.check:
                    if not committed.exists() or not filecmp.cmp(fresh, committed, shallow=False):
                        stale.append(str(committed.relative_to(ROOT)))
                else:
                    committed.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(fresh, committed)
    if stale:
        print("generated protobuf modules are stale; run `make proto`:", *stale, sep="\n  ", file=sys.stderr)
        return 1
    print("protobuf modules " + ("are up to date" if args.check else "regenerated"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
