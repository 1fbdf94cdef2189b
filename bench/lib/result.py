"""The one result schema every benchmark writes with ``--json PATH``, and its writer and check.

A result is one JSON object::

    {"schema": "nemo_gen.bench/1", "name": "fleet_overhead", "date": "2026-12-06T02:10:00+00:00",
     "commit": "1e84fe8...", "machine": {"host": ..., "cpus": 2, "platform": ..., "python": ...,
     "load": [1.2, 1.5, 1.7], "gpu": null}, "arguments": {...the command line's values...},
     "metrics": {...what the benchmark measured...}, "verdicts": {"fleet_overhead": "PASS", ...}}

``verdicts`` maps a target's name to PASS, MISS (a performance target not met: a measurement, not
an error) or FAIL (a correctness check that did not hold). Everything else a benchmark reports
lives under ``metrics`` in its own shape, described in its docstring."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SCHEMA = "nemo_gen.bench/1"
FIELDS = ("schema", "name", "date", "commit", "machine", "arguments", "metrics", "verdicts")
VERDICTS = ("PASS", "MISS", "FAIL")
_REPO = Path(__file__).resolve().parents[2]


def commit() -> str:
    """The checkout's HEAD, ``-dirty`` when tracked files differ from it; "unknown" outside git
    (the GPU host gets the tree without its history)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(_REPO), *a], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# Taken when the benchmark starts (it imports this module first): a commit made while it runs is
# not the code that ran.
AT_START = commit()


def machine() -> dict[str, Any]:
    gpu = None
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "" and Path("/proc/driver/nvidia/gpus").is_dir():
        gpu = sorted(p.name for p in Path("/proc/driver/nvidia/gpus").iterdir())  # bus ids, no CUDA init
    return {"host": socket.gethostname(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": sys.version.split()[0], "load": list(os.getloadavg()), "gpu": gpu}


def collect_verdicts(metrics: Any, prefix: str = "") -> dict[str, str]:
    """Every ``"verdict": "..."`` found in ``metrics``, named by its path ("fleet.verdict" -> "fleet")."""
    out: dict[str, str] = {}
    if isinstance(metrics, Mapping):
        for key, value in metrics.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if key == "verdict" and isinstance(value, str):
                out[prefix or "verdict"] = value
            elif key != "rounds":  # per-round details carry no verdicts of their own
                out.update(collect_verdicts(value, path))
    return out


def _normal(value: Any) -> str:
    if isinstance(value, bool):
        return "PASS" if value else "FAIL"
    return {"MISSED": "MISS"}.get(str(value), str(value))


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))  # Paths and the like as strings


def make(name: str, arguments: argparse.Namespace | Mapping[str, Any], metrics: Mapping[str, Any],
         verdicts: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A result in the schema; ``verdicts`` default to the ones found in ``metrics``."""
    args = vars(arguments) if isinstance(arguments, argparse.Namespace) else dict(arguments)
    found = collect_verdicts(metrics) if verdicts is None else verdicts
    doc = {"schema": SCHEMA, "name": name,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": AT_START, "machine": machine(), "arguments": _plain(args), "metrics": _plain(metrics),
           "verdicts": {k: _normal(v) for k, v in found.items()}}
    validate(doc)
    return doc


def write_result(path: Path | str | None, name: str, arguments: argparse.Namespace | Mapping[str, Any],
          metrics: Mapping[str, Any], verdicts: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Make the result and, when ``path`` is given, write it there (folders made); the result."""
    doc = make(name, arguments, metrics, verdicts)
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}")
    return doc


def validate(doc: Any) -> None:
    """Raise ``ValueError`` naming every way ``doc`` is not a result of this schema."""
    if not isinstance(doc, Mapping):
        raise ValueError(f"a result is a JSON object, not {type(doc).__name__}")
    problems = [f"missing {k!r}" for k in FIELDS if k not in doc]
    problems += [f"unknown field {k!r}" for k in doc if k not in FIELDS]
    if doc.get("schema", SCHEMA) != SCHEMA:
        problems.append(f"schema {doc['schema']!r} is not {SCHEMA!r}")
    for key in ("name", "date", "commit"):
        if key in doc and not (isinstance(doc[key], str) and doc[key]):
            problems.append(f"{key!r} must be a non-empty string")
    for key in ("machine", "arguments", "metrics", "verdicts"):
        if key in doc and not isinstance(doc[key], Mapping):
            problems.append(f"{key!r} must be an object")
    for key, value in (doc.get("verdicts") or {}).items() if isinstance(doc.get("verdicts"), Mapping) else ():
        if value not in VERDICTS:
            problems.append(f"verdict {key!r} is {value!r}, not one of {', '.join(VERDICTS)}")
    if problems:
        raise ValueError("not a bench result: " + "; ".join(problems))


def read(path: Path | str) -> dict[str, Any]:
    """A result file, checked."""
    doc = json.loads(Path(path).read_text())
    validate(doc)
    return doc
