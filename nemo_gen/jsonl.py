"""Prompts in, results out, as JSONL — one output line per input line, in order — and the
fingerprint file that says what produced an output.

A malformed input line does not stop the job: it becomes an output line carrying its line
number and the reason, and every other line is still generated.

Nothing done is lost: while a job runs, ``OutputWriter`` appends each finished line to the
output file (flushed, in the order lines finish); when the job ends, ``write_jsonl`` rewrites
the file in input order (a temporary file, fsynced, renamed over it, the directory fsynced). A
job killed in between leaves every line it finished; ``read_finished`` reads them back so a
resumed job generates only the rest. A kill can cut the row being written at any byte; the next
run's writer truncates that cut tail before it appends, and ``read_finished`` drops a cut row
wherever it sits (an output written before the writer truncated, or by a kill in between) — the
line is generated again.

Why a log in completion order, put in order at the end, rather than writing in input order as
the finished prefix grows: lines finish out of order (a long answer holds up nothing else), and
a prefix writer would have to hold every line that finished after a slow one in memory, where a
kill loses it. Appending keeps each line the moment it exists; the one rename at the end gives
the readable file, and a kill at any point leaves either the log or the ordered file, never a
mix. A resumed job appends to the log, so a line is in it once per run that finished it: a line
that failed and was generated again has its error row and its result row, and ``read_finished``
takes the result; the final rewrite keeps exactly one row per input line.

The fingerprint (``<output>.fingerprint.json``, beside the output; ``write_fingerprint``) records
what produced the rows: model, sampling settings, weight version, input. It is a file of its own so
that every line of the output stays a plain result row for its readers. It is written before the
output's first row, so an output that holds rows and has no fingerprint was not made by this
nemo-gen; ``check_fingerprint`` refuses a resume whose run differs, naming the field.
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
from nemo_gen.errors import ConfigError, InputFileError


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

    @property
    def messages(self) -> list[dict[str, str]] | None:
        """The chat messages of a chat line (input ``messages``), else None."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], dict):
            return self.prompt
        return None


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
        if line.messages is not None:
            # The row's prompt is the rendered chat template: the messages themselves say which
            # input line it answers (a resume matches them), and are what a reader of a chat wants.
            row["messages"] = line.messages
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
# a reader (tests/e2e/test_cli.py reads rows so). Written as \u
# escapes, every row is one line for every reader and parses back the same.
_LINE_BREAKS = {0x2028: "\\u2028", 0x2029: "\\u2029", 0x85: "\\u0085"}


def _line(row: dict[str, Any]) -> str:
    """One output row as one physical line of JSON, with its newline."""
    return json.dumps(row, ensure_ascii=False).translate(_LINE_BREAKS) + "\n"


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> Path:
    """``rows`` as ``path``, all or nothing: a temporary file beside it, fsynced, renamed over it."""
    return _replace(Path(path), lambda out: out.writelines(_line(row) for row in rows))


def _replace(p: Path, write) -> Path:
    """``write(file)`` into a temporary file beside ``p``, then that file in ``p``'s place. The
    file is fsynced before the rename, so the name never points at data still in the page cache
    (after a power loss, ext4/xfs could show a renamed but empty file); the directory after it, so
    the rename itself is on disk when this returns."""
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        # mkstemp creates 0600; publish with the permissions a plain open() would give.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(p.parent)
    return p


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



class OutputWriter:
    """Appends finished lines to ``path`` as they come, each ``write`` flushed to the file at once
    (one line, or the lines of a batch that finished together; ``append``: after the lines already
    there, for a resumed job; else the file starts empty). Flushed is enough for a killed process:
    the kernel has the bytes. (No fsync per line: a power loss may cost the last lines.)

    Appending, a row cut short by the kill of an earlier run (the bytes after the file's last
    newline: every row is written with its newline) is cut off first, so it never ends up in the
    middle of the file; its line was not finished and is generated again."""

    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if append:
            _truncate_cut_tail(self.path)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        self._file.write("".join(_line(row) for row in rows))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "OutputWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _truncate_cut_tail(path: Path, chunk: int = 1 << 16) -> None:
    """Cut ``path`` back to just after its last newline (nothing when it ends with one)."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return
    with f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:  # rows are short next to a chunk: this reads one chunk, seldom two
            start = max(0, pos - chunk)
            f.seek(start)
            newline = f.read(pos - start).rfind(b"\n")
            if newline >= 0:
                pos = start + newline + 1
                break
            pos = start
        if pos != end:
            f.truncate(pos)


def read_finished(path: str | os.PathLike, lines: Sequence[PromptLine]) -> dict[int, dict[str, Any]]:
    """The rows of ``path`` (a nemo-gen output, complete or left by a killed job) that generated
    without error, by input line number. Each must be the result of the same prompt as that
    line of ``lines``: an output made from another input is refused, not silently mixed in.
    A missing file holds nothing yet."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise InputFileError(str(p), f"cannot read the output to resume: {exc.strerror or exc}") from None
    by_line = {line.line: line for line in lines}
    done: dict[int, dict[str, Any]] = {}
    # Split the bytes, not decoded text: a kill can cut a row inside a multi-byte character, and
    # b"\n" is never part of one.
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            if _is_cut_row(raw):
                continue  # a row cut short by a kill (here or mid-file, after later runs): redone
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


_ROW_START = b'{"line": '  # every row the writers write begins so (result_row puts "line" first)


def _is_cut_row(raw: bytes) -> bool:
    """Whether ``raw`` (not valid JSON) is the start of a row, cut by a kill: a row begins with
    ``_ROW_START`` and the cut may fall anywhere, even within those bytes. Anything else is not
    a nemo-gen output, and is refused rather than dropped."""
    raw = raw.removesuffix(b"\r")
    return raw.startswith(_ROW_START) or _ROW_START.startswith(raw)


def _same_prompt(line: PromptLine, row: dict[str, Any]) -> bool:
    if line.messages is not None:
        return row.get("messages") == line.messages
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


# --------------------------------------------------------------------------------------------
# the fingerprint: what produced an output

_FINGERPRINT_FORMAT = "nemo-gen output fingerprint 1"


def fingerprint_path(output: str | os.PathLike) -> Path:
    """The fingerprint file of ``output``: beside it, its name plus ``.fingerprint.json``."""
    p = Path(output)
    return p.with_name(p.name + ".fingerprint.json")


def write_fingerprint(output: str | os.PathLike, fields: dict[str, Any], about: dict[str, Any] | None = None) -> Path:
    """Record ``fields`` (dotted setting name -> JSON value; what a resume must match) as the
    fingerprint of ``output``; ``about``: information for a person, never compared. Written as
    the final output is (fsynced, renamed into place)."""
    doc = {"format": _FINGERPRINT_FORMAT, "output": Path(output).name, "fields": fields, "about": about or {}}
    return _replace(fingerprint_path(output), lambda out: out.write(json.dumps(doc, indent=2) + "\n"))


def remove_fingerprint(output: str | os.PathLike) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(fingerprint_path(output))


def read_fingerprint(output: str | os.PathLike) -> dict[str, Any] | None:
    """The fields ``output``'s fingerprint recorded; None when it has none."""
    path = fingerprint_path(output)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputFileError(str(path), f"cannot read the fingerprint of {output}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InputFileError(str(path), "not valid JSON: not a nemo-gen output fingerprint") from None
    if not (isinstance(doc, dict) and doc.get("format") == _FINGERPRINT_FORMAT and isinstance(doc.get("fields"), dict)):
        raise InputFileError(str(path), f"not a nemo-gen output fingerprint (expected format {_FINGERPRINT_FORMAT!r})")
    return doc["fields"]


def holds_rows(output: str | os.PathLike) -> bool:
    """Whether ``output`` exists with something in it (something a careless start would lose)."""
    try:
        return os.stat(output).st_size > 0
    except FileNotFoundError:
        return False


_ABSENT = object()


def check_fingerprint(output: str | os.PathLike, fields: dict[str, Any], skip: Iterable[str] = ()) -> None:
    """Refuse to add this run's rows (``fields``: its fingerprint) to ``output`` when an earlier
    run with another fingerprint made it: ``ConfigError`` naming the first differing field, both
    values and the fingerprint file. ``skip``: fields not known yet (the weight version, before
    the fleet is up). An output that holds nothing yet matches anything; one that holds rows but
    has no fingerprint is refused (its settings are unknown)."""
    if not holds_rows(output):
        return
    recorded = read_fingerprint(output)
    fp = fingerprint_path(output)
    restart = "run it without --resume and with --overwrite (run.overwrite) to start it over"
    if recorded is None:
        raise ConfigError(f"{output} holds rows but has no fingerprint ({fp} is missing): what made it is "
                          f"unknown, so it cannot be resumed; {restart}", field="run.resume")
    ours = json.loads(json.dumps(fields))  # as it would read back: tuples are lists
    for name in [*ours, *(k for k in recorded if k not in ours)]:
        if name in skip:
            continue
        theirs, mine = recorded.get(name, _ABSENT), ours.get(name, _ABSENT)
        if theirs != mine:
            said = lambda v: "nothing" if v is _ABSENT else json.dumps(v)  # noqa: E731
            raise ConfigError(f"{output} was made with {said(theirs)}, this run has {said(mine)} (its "
                              f"fingerprint: {fp}); resume with what made it, or {restart}", field=name)
