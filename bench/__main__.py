"""``python -m bench NAME [flags]``: run one benchmark (its ``main(argv)``); ``python -m bench``
or ``python -m bench list``: the benchmarks, where each runs, and its target. Run from the
repository root (the GPU host: from .gpu-src)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.registry import BENCHMARKS, find

ROOT = str(Path(__file__).resolve().parents[1])


def listing() -> str:
    width = max(len(b.name) for b in BENCHMARKS)
    rows = [f"{'name':<{width}}  {'device':<6}  target", *(f"{b.name:<{width}}  {b.device:<6}  {b.target}" for b in BENCHMARKS)]
    return "usage: python -m bench NAME [flags]   (python -m bench NAME --help: its flags)\n\n" + "\n".join(rows)


def run(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("list", "-h", "--help"):
        print(listing())
        return 0
    name, rest = argv[0], list(argv[1:])
    try:
        find(name)
    except KeyError:
        print(f"no benchmark {name!r}\n\n{listing()}", file=sys.stderr)
        return 2
    # Processes the benchmark starts (Ray workers, engines, load generators) import bench.* too.
    path = os.environ.get("PYTHONPATH", "")
    if ROOT not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, path) if p)
    argv0, sys.argv = sys.argv, [f"python -m bench {name}", *rest]  # argparse's usage line names the command
    try:
        return exit_code(importlib.import_module(f"bench.{name}").main(rest))
    finally:
        sys.argv = argv0


def exit_code(returned: object) -> int:
    """A benchmark's ``main`` returns its exit code, or its result: 1 when a correctness verdict
    failed (a missed performance target is a measurement, not an error), else 0."""
    if isinstance(returned, int):
        return returned
    verdicts = returned.get("verdicts", {}) if isinstance(returned, dict) else {}
    return 1 if any(v is False or v == "FAIL" for v in verdicts.values()) else 0


if __name__ == "__main__":  # vLLM and Ray spawn processes that re-import the main module
    sys.exit(run(sys.argv[1:]))
