"""Prompts in, results out, as JSONL — one output line per input line, in order.

A malformed input line does not stop the job: it becomes an output line carrying its line
number and the reason, and every other line is still generated.

Nothing done is lost: while a job runs, ``OutputWriter`` appends each finished line to the
output file (flushed, in the order lines finish); when the job ends, ``write_jsonl`` rewrites
the file in input order (a temporary file renamed over it). A job killed in between leaves
every line it finished; ``read_finished`` reads them back so a resumed job generates only the
rest (a last line cut short by the kill is ignored).

Why a log in completion order, put in order at the end, rather than writing in input order as
the finished prefix grows: lines finish out of order (a long answer holds up nothing else), and
a prefix writer would have to hold every line that finished after a slow one in memory, where a
kill loses it. Appending keeps each line the moment it exists; the one rename at the end gives
the readable file, and a kill at any point leaves either the log or the ordered file, never a
mix. A resumed job appends to the log, so a line is in it once per run that finished it: a line
that failed and was generated again has its error row and its result row, and ``read_finished``
takes the result; the final rewrite keeps exactly one row per input line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from nemo_gen.core.results import GenerationResult, Sample
from nemo_gen.errors import InputFileError


@dataclass(frozen=True)
class PromptLine:
    line: int
    prompt: str | list[int] | list[dict[str, str]] | None  # text, token ids, or chat messages
    error: str | None = None
    record: dict[str, Any] | None = None  # the input object, for pass-through fields

    @property
    def session_id(self) -> str | None:
        """The conversation the line belongs to (``session_id``): its turns share a shard."""
        return (self.record or {}).get("session_id")


def read_prompts(path: str | os.PathLike) -> list[PromptLine]:
    """Parse ``path``. Lines: ``{"prompt": "..."}``, ``{"prompt_token_ids": [...]}``,
    ``{"messages": [{"role": ..., "content": ...}, ...]}`` (a chat) or a bare JSON string, each
    optionally with a string ``session_id``. Blank lines are skipped; bad lines come back with
    ``error`` set."""
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
    if "session_id" in obj and not isinstance(obj["session_id"], str):
        return PromptLine(number, None, "'session_id' must be a string", obj)
    if "messages" in obj:
        messages = obj["messages"]
        if (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            return PromptLine(number, [{"role": m["role"], "content": m["content"]} for m in messages], None, obj)
        return PromptLine(number, None, "'messages' must be a non-empty list of {\"role\": str, \"content\": str}", obj)
    if isinstance(obj.get("prompt"), str):
        return PromptLine(number, obj["prompt"], None, obj)
    ids = obj.get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return PromptLine(number, list(ids), None, obj)
    return PromptLine(
        number, None, "needs a string 'prompt', a non-empty integer list 'prompt_token_ids' or 'messages'", obj
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
        # No result: a malformed line (``error`` says why) or a line that was never generated.
        # Never ``error: None`` here: every reader (``read_finished``, a resume) takes that as done.
        row.update({"prompt": None, "text": None, "error": error or "not generated"})
    return row


# json.dumps(ensure_ascii=False) leaves U+2028, U+2029 and U+0085 raw inside strings (valid JSON),
# and str.splitlines() — as well as editors and JavaScript — break lines there: a sampled token
# that decodes to one of them (a random model's sometimes do) split a result row in two for such
# a reader (a clean clone's CI failed so in tests/e2e/test_cli.py, 2026-12-02). Written as \u
# escapes, every row is one line for every reader and parses back the same.
_LINE_BREAKS = {0x2028: "\\u2028", 0x2029: "\\u2029", 0x85: "\\u0085"}


def _line(row: dict[str, Any]) -> str:
    """One output row as one physical line of JSON, with its newline."""
    return json.dumps(row, ensure_ascii=False).translate(_LINE_BREAKS) + "\n"


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for row in rows:
                out.write(_line(row))
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



class OutputWriter:
    """Appends finished lines to ``path`` as they come, each ``write`` flushed to the file at once
    (one line, or the lines of a batch that finished together; ``append``: after the lines already
    there, for a resumed job; else the file starts empty). Flushed is enough for a killed process:
    the kernel has the bytes. (No fsync per line: a power loss may cost the last lines.)"""

    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")
        if append and self._file.tell() > 0 and not _ends_with_newline(self.path):
            self._file.write("\n")  # a line cut short by a kill stays on its own (ignored) line

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        self._file.write("".join(_line(row) for row in rows))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "OutputWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_finished(path: str | os.PathLike, lines: Sequence[PromptLine]) -> dict[int, dict[str, Any]]:
    """The rows of ``path`` (a nemo-gen output, complete or left by a killed job) that generated
    without error, by input line number. Each must be the result of the same prompt as that
    line of ``lines``: an output made from another input is refused, not silently mixed in.
    A missing file holds nothing yet."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise InputFileError(str(p), f"cannot read the output to resume: {exc.strerror or exc}") from None
    by_line = {line.line: line for line in lines}
    raw_lines = text.split("\n")
    done: dict[int, dict[str, Any]] = {}
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError:
            if all(not r.strip() for r in raw_lines[number:]):
                continue  # the last line, cut short when the job was killed
            raise InputFileError(str(p), f"line {number} is not valid JSON: not a nemo-gen output to resume") from None
        if not isinstance(row, dict) or not isinstance(row.get("line"), int):
            raise InputFileError(str(p), f"line {number} has no 'line' number: not a nemo-gen output to resume")
        line = by_line.get(row["line"])
        if line is None:
            raise InputFileError(str(p), f"line {number} is the result of input line {row['line']}, which the "
                                         "input does not have: this output was made from another input")
        if row.get("error") is not None or line.error is not None:
            continue  # a failed line is generated again
        if not _same_prompt(line, row):
            raise InputFileError(str(p), f"line {number} is the result of a different prompt than input line "
                                         f"{line.line}: this output was made from another input")
        done[line.line] = row
    return done


def _same_prompt(line: PromptLine, row: dict[str, Any]) -> bool:
    if isinstance(line.prompt, str):
        return row.get("prompt") == line.prompt
    return row.get("prompt_token_ids") == line.prompt


_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationResult) if f.name != "index")


def result_from_row(row: dict[str, Any], index: int) -> GenerationResult:
    """The ``GenerationResult`` an output row was written from (``result_row``'s inverse)."""
    kwargs = {name: row[name] for name in _RESULT_FIELDS if name in row}
    kwargs.setdefault("prompt", None)
    kwargs.setdefault("prompt_token_ids", [])
    kwargs.setdefault("text", None)
    kwargs["samples"] = [Sample(**{**s, "weight_versions": [tuple(v) for v in s.get("weight_versions") or []]})
                         for s in row.get("samples") or []]
    kwargs["weight_versions"] = [tuple(s) for s in kwargs.get("weight_versions") or []]
    return GenerationResult(index=index, **kwargs)
