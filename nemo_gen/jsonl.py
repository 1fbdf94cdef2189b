"""Prompts in, results out, as JSONL — one output line per input line, in order.

A malformed input line does not stop the job: it becomes an output line carrying its line
number and the reason, and every other line is still generated. Output is written to a
temporary file and renamed, so a crash never leaves a half-written result file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from nemo_gen.core.results import GenerationResult
from nemo_gen.errors import InputFileError


@dataclass(frozen=True)
class PromptLine:
    line: int
    prompt: str | list[int] | None
    error: str | None = None
    record: dict[str, Any] | None = None  # the input object, for pass-through fields


def read_prompts(path: str | os.PathLike) -> list[PromptLine]:
    """Parse ``path``. Lines: ``{"prompt": "..."}``, ``{"prompt_token_ids": [...]}`` or a bare
    JSON string. Blank lines are skipped; bad lines come back with ``error`` set."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # -sig: a leading BOM is not part of line 1
    except OSError as exc:
        raise InputFileError(str(p), f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise InputFileError(str(p), f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    lines = []
    # Split on "\n" only: str.splitlines() would also split at U+2028/U+2029/U+0085, which JSON
    # allows raw inside strings, shifting every later line number.
    for number, raw in enumerate(text.split("\n"), start=1):
        raw = raw.removesuffix("\r")
        if not raw.strip():
            continue
        lines.append(_parse_line(number, raw))
    if not lines:
        raise InputFileError(str(p), "holds no prompts")
    return lines


def _parse_line(number: int, raw: str) -> PromptLine:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return PromptLine(number, None, f"not valid JSON ({exc.msg} at column {exc.colno})")
    if isinstance(obj, str):
        return PromptLine(number, obj, None, {"prompt": obj})
    if not isinstance(obj, dict):
        return PromptLine(number, None, f"expected an object or a string, got {type(obj).__name__}")
    if isinstance(obj.get("prompt"), str):
        return PromptLine(number, obj["prompt"], None, obj)
    ids = obj.get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return PromptLine(number, list(ids), None, obj)
    return PromptLine(
        number, None, "needs a string 'prompt' or a non-empty integer list 'prompt_token_ids'", obj
    )


def result_row(line: PromptLine | None, result: GenerationResult | None, error: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {}
    if line is not None:
        row["line"] = line.line
        if line.record and "id" in line.record:
            row["id"] = line.record["id"]
    if result is not None:
        row.update(result.to_json())
        row.pop("index", None)
    else:
        row.update({"prompt": None, "text": None, "error": error})
    return row


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
        # mkstemp creates 0600; publish with the permissions a plain open() would give.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p

