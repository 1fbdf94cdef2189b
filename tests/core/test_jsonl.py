"""nemo_gen.jsonl (+ pipeline.load_prompts/write_outputs/summarize): prompts in, results out."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from nemo_gen.core.results import GenerationResult
from nemo_gen.core.wire import ShardInfo
from nemo_gen.errors import DataError, InfraError, InputFileError
from nemo_gen.jsonl import PromptLine, read_prompts, result_row, write_jsonl
from nemo_gen.pipeline import load_prompts, summarize, write_outputs
from nemo_gen.settings import NemoGenSettings


def _file(tmp_path: Path, *lines: str, name: str = "in.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _result(index: int, text: str = "out", shard: int | None = 0, error: str | None = None, **kw) -> GenerationResult:
    return GenerationResult(
        index=index, prompt=f"p{index}", prompt_token_ids=[1, 2], text=None if error else text,
        token_ids=[] if error else kw.pop("token_ids", [5, 6, 7]), shard=shard, error=error, **kw,
    )


# --------------------------------------------------------------------------------------------
# read_prompts


def test_object_string_and_token_id_lines(tmp_path):
    path = _file(
        tmp_path,
        json.dumps({"prompt": "hello", "id": "a"}),
        json.dumps("bare string"),
        json.dumps({"prompt_token_ids": [1, 2, 3]}),
        json.dumps({"prompt": "ünïcødé ✓"}, ensure_ascii=False),
    )
    lines = read_prompts(path)
    assert [l.line for l in lines] == [1, 2, 3, 4]
    assert [l.prompt for l in lines] == ["hello", "bare string", [1, 2, 3], "ünïcødé ✓"]
    assert all(l.error is None for l in lines)
    assert lines[0].record == {"prompt": "hello", "id": "a"}
    assert lines[1].record == {"prompt": "bare string"}
    assert lines[2].record == {"prompt_token_ids": [1, 2, 3]}


def test_prompt_wins_over_token_ids(tmp_path):
    path = _file(tmp_path, json.dumps({"prompt": "text", "prompt_token_ids": [1]}))
    assert read_prompts(path)[0].prompt == "text"


def test_blank_lines_skipped_but_counted(tmp_path):
    path = _file(tmp_path, "", json.dumps("a"), "   ", "\t", json.dumps("b"), "")
    lines = read_prompts(path)
    assert [(l.line, l.prompt) for l in lines] == [(2, "a"), (5, "b")]


def test_crlf_line_endings(tmp_path):
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b'{"prompt": "a"}\r\n"b"\r\n')
    assert [(l.line, l.prompt, l.error) for l in read_prompts(path)] == [(1, "a", None), (2, "b", None)]


def test_no_trailing_newline(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('"a"\n"b"', encoding="utf-8")
    assert [l.prompt for l in read_prompts(path)] == ["a", "b"]


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ("{not json", "not valid JSON"),
        ('{"prompt": "unterminated', "not valid JSON"),
        ("[1, 2, 3]", "expected an object or a string, got list"),
        ("42", "got int"),
        ("null", "got NoneType"),
        ("true", "got bool"),
        ('{"prompt": 5}', "prompt"),
        ('{"prompt": null}', "prompt"),
        ('{"text": "no prompt key"}', "prompt"),
        ('{"prompt_token_ids": []}', "prompt_token_ids"),
        ('{"prompt_token_ids": [1, "2"]}', "prompt_token_ids"),
        ('{"prompt_token_ids": [1, 2.0]}', "prompt_token_ids"),
        ('{"prompt_token_ids": [1, -1]}', "prompt_token_ids"),
        ('{"prompt_token_ids": [true, false]}', "prompt_token_ids"),
        ('{"prompt_token_ids": "1 2 3"}', "prompt_token_ids"),
        ('{"prompt_token_ids": [[1, 2]]}', "prompt_token_ids"),
    ],
)
def test_bad_line_reports_error_and_line_while_others_parse(tmp_path, raw, fragment):
    path = _file(tmp_path, json.dumps("first"), raw, json.dumps({"prompt": "third"}))
    lines = read_prompts(path)
    assert len(lines) == 3
    assert (lines[0].line, lines[0].prompt, lines[0].error) == (1, "first", None)
    assert (lines[2].line, lines[2].prompt, lines[2].error) == (3, "third", None)
    bad = lines[1]
    assert bad.line == 2
    assert bad.prompt is None
    assert bad.error and fragment in bad.error


def test_bad_object_line_keeps_its_record(tmp_path):
    path = _file(tmp_path, json.dumps({"id": 9, "prompt": 5}))
    line = read_prompts(path)[0]
    assert line.error and line.record == {"id": 9, "prompt": 5}


def test_malformed_json_names_the_column(tmp_path):
    path = _file(tmp_path, '{"prompt": x}')
    assert "column 12" in read_prompts(path)[0].error


def test_missing_file_raises_naming_it(tmp_path):
    path = tmp_path / "missing.jsonl"
    with pytest.raises(InputFileError) as info:
        read_prompts(path)
    assert info.value.path == str(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, DataError)


def test_directory_raises_naming_it(tmp_path):
    with pytest.raises(InputFileError) as info:
        read_prompts(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "cannot read" in str(info.value)


_READ_IN_A_CHILD = """
import json, sys
from nemo_gen.errors import InputFileError
from nemo_gen.jsonl import read_prompts
try:
    read_prompts(sys.argv[1])
    print(json.dumps({"raised": None}))
except InputFileError as exc:
    print(json.dumps({"raised": type(exc).__name__, "path": exc.path, "message": str(exc)}))
"""


def _without_file_permission_override() -> None:
    """In a child before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding
    set, so the program it runs is a root that file modes apply to (a container's root with
    those capabilities dropped)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH; PR_CAPBSET_DROP is 24
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_permission_denied_raises_naming_it(tmp_path):
    """A file its reader may not open (mode 000). Root reads any file, and CI runs as root:
    there the read runs in a child process that keeps uid 0 but not the capabilities that
    override file modes."""
    import subprocess
    import sys

    path = _file(tmp_path, '"a"')
    path.chmod(0)
    try:
        if os.geteuid() != 0:
            with pytest.raises(InputFileError) as info:
                read_prompts(path)
            got = {"raised": "InputFileError", "path": info.value.path, "message": str(info.value)}
        else:
            proc = subprocess.run(
                [sys.executable, "-c", _READ_IN_A_CHILD, str(path)],
                preexec_fn=_without_file_permission_override, capture_output=True, text=True, timeout=60,
            )
            assert proc.returncode == 0, proc.stderr[-2000:]
            got = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        path.chmod(0o644)
    assert got["raised"] == "InputFileError" and got["path"] == str(path)
    assert got["message"].startswith(f"{path}: cannot read") and "Permission denied" in got["message"]


def test_non_utf8_raises_naming_it(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('"caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(InputFileError) as info:
        read_prompts(path)
    assert str(path) in str(info.value)
    assert "UTF-8" in str(info.value)
    assert "byte 4" in str(info.value)


@pytest.mark.parametrize("body", ["", "\n", "  \n\n\t\n"])
def test_empty_file_raises_naming_it(tmp_path, body):
    path = tmp_path / "empty.jsonl"
    path.write_text(body)
    with pytest.raises(InputFileError) as info:
        read_prompts(path)
    assert str(path) in str(info.value)
    assert "no prompts" in str(info.value)


def test_unicode_line_separator_inside_a_string(tmp_path):
    path = _file(
        tmp_path,
        json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False),
        json.dumps({"prompt": "c"}),
    )
    lines = read_prompts(path)
    assert [(l.line, l.prompt, l.error) for l in lines] == [(1, "a\u2028b", None), (2, "c", None)]


# --------------------------------------------------------------------------------------------
# write_jsonl


def test_write_jsonl_round_trip_and_no_temp_left(tmp_path):
    path = tmp_path / "sub" / "dir" / "out.jsonl"  # parents are created
    rows = [{"a": 1}, {"text": "ünï ✓"}, {"nested": {"x": [1, 2]}}]
    returned = write_jsonl(path, rows)
    assert returned == path
    text = path.read_text(encoding="utf-8")
    assert "ünï ✓" in text  # not \u-escaped
    assert [json.loads(l) for l in text.splitlines()] == rows
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.jsonl"]


def test_every_output_row_is_one_line_for_any_line_splitter(tmp_path):
    """A sampled text may hold U+2028, U+2029 or U+0085, which JSON allows raw but str.splitlines()
    (and editors) treat as line breaks: both writers escape them, and the rows parse back the same."""
    rows = [{"line": 1, "text": "a\u2028b\x85c\u2029d\x0be\x1cf"}, {"line": 2, "text": "plain"}]
    final = write_jsonl(tmp_path / "final.jsonl", rows)
    with OutputWriter(tmp_path / "log.jsonl") as w:
        w.write(rows)
    for path in (final, tmp_path / "log.jsonl"):
        lines = path.read_text(encoding="utf-8").splitlines()
        assert [json.loads(line) for line in lines] == rows


def test_write_jsonl_accepts_a_generator_and_str_path(tmp_path):
    path = tmp_path / "gen.jsonl"
    write_jsonl(str(path), ({"i": i} for i in range(3)))
    assert path.read_text().splitlines() == ['{"i": 0}', '{"i": 1}', '{"i": 2}']


def test_write_jsonl_empty_rows(tmp_path):
    path = write_jsonl(tmp_path / "e.jsonl", [])
    assert path.read_text() == ""


def test_write_jsonl_replaces_existing(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    write_jsonl(path, [{"new": True}])
    assert path.read_text() == '{"new": true}\n'


def test_failure_while_iterating_leaves_previous_file_untouched(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("previous\n")

    def rows():
        yield {"a": 1}
        yield {"b": 2}
        raise RuntimeError("producer crashed")

    with pytest.raises(RuntimeError, match="producer crashed"):
        write_jsonl(path, rows())
    assert path.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_unserialisable_row_leaves_no_file(tmp_path):
    path = tmp_path / "out.jsonl"
    with pytest.raises(TypeError):
        write_jsonl(path, [{"a": 1}, {"b": object()}])
    assert list(tmp_path.iterdir()) == []


def test_keyboard_interrupt_also_cleans_up(tmp_path):
    path = tmp_path / "out.jsonl"

    def rows():
        yield {"a": 1}
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_jsonl(path, rows())
    assert list(tmp_path.iterdir()) == []


def test_written_file_honours_the_umask(tmp_path):
    import stat

    old = os.umask(0o022)
    try:
        path = write_jsonl(tmp_path / "out.jsonl", [{"a": 1}])
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


# --------------------------------------------------------------------------------------------
# result_row / write_outputs


def test_result_row_keeps_line_and_id():
    line = PromptLine(line=7, prompt="p", record={"prompt": "p", "id": "req-7", "extra": 1})
    row = result_row(line, _result(0, text="hi"))
    assert row["line"] == 7
    assert row["id"] == "req-7"
    assert row["text"] == "hi"
    assert row["error"] is None
    assert row["token_ids"] == [5, 6, 7]
    assert "index" not in row
    assert "extra" not in row
    assert list(row)[:2] == ["line", "id"]


def test_result_row_id_may_be_any_json_value():
    line = PromptLine(line=1, prompt="p", record={"prompt": "p", "id": 0})
    assert result_row(line, _result(0))["id"] == 0
    line = PromptLine(line=1, prompt="p", record={"prompt": "p", "id": None})
    assert result_row(line, _result(0))["id"] is None


def test_result_row_without_id():
    row = result_row(PromptLine(line=3, prompt="p", record={"prompt": "p"}), _result(0))
    assert row["line"] == 3 and "id" not in row


def test_result_row_for_a_bad_line():
    line = PromptLine(line=4, prompt=None, error="not valid JSON", record={"id": "x", "prompt": 3})
    row = result_row(line, None, line.error)
    assert row == {"line": 4, "id": "x", "prompt": None, "text": None, "error": "not valid JSON"}


def test_a_line_with_no_result_is_never_written_as_finished(tmp_path):
    # no result and no error of its own: a line that was never generated. A row with error None
    # would be taken for a finished line by every reader, a resume included.
    line = PromptLine(line=4, prompt="p", record={"prompt": "p"})
    assert result_row(line, None)["error"] == "not generated"
    out = tmp_path / "o.jsonl"
    write_jsonl(out, [result_row(line, None)])
    assert read_finished(out, [line]) == {}


def test_result_row_for_a_failed_request():
    line = PromptLine(line=2, prompt="p", record={"prompt": "p"})
    row = result_row(line, _result(0, error="RequestError: too long", shard=None))
    assert row["line"] == 2 and row["error"] == "RequestError: too long" and row["text"] is None


def test_write_outputs_one_row_per_line_in_order(tmp_path):
    path = _file(
        tmp_path,
        json.dumps({"prompt": "a", "id": 1}),
        "garbage",
        "",
        json.dumps({"prompt": "c", "id": 3}),
    )
    lines = read_prompts(path)
    results = [_result(0, "A"), None, _result(1, "C")]
    out = write_outputs(lines, results, tmp_path / "out.jsonl")
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [(r["line"], r.get("id"), r["text"]) for r in rows] == [(1, 1, "A"), (2, None, None), (4, 3, "C")]
    assert "not valid JSON" in rows[1]["error"]
    assert rows[0]["error"] is None and rows[2]["error"] is None


# --------------------------------------------------------------------------------------------
# pipeline.load_prompts / summarize


def test_load_prompts_builtin_and_from_file(tmp_path):
    builtin = load_prompts(NemoGenSettings.load())
    assert [l.line for l in builtin] == list(range(1, 9))
    assert all(l.error is None and isinstance(l.prompt, str) for l in builtin)
    assert builtin[0].record == {"prompt": builtin[0].prompt}
    path = _file(tmp_path, '"x"', '"y"')
    from_file = load_prompts(NemoGenSettings.load(overrides={"run.input": str(path)}))
    assert [l.prompt for l in from_file] == ["x", "y"]


def test_load_prompts_missing_file(tmp_path):
    with pytest.raises(InputFileError):
        load_prompts(NemoGenSettings.load(overrides={"run.input": str(tmp_path / "nope.jsonl")}))


def test_summarize_counts(tmp_path):
    lines = [
        PromptLine(line=1, prompt="a"),
        PromptLine(line=2, prompt=None, error="bad line"),
        PromptLine(line=3, prompt="c"),
        PromptLine(line=4, prompt="d"),
    ]
    results = [
        _result(0, shard=1, weight_version=2, token_ids=[1, 2, 3]),
        None,
        _result(1, shard=0, weight_version=2, token_ids=[4]),
        _result(2, shard=1, error="RequestError: too long"),
    ]
    fleet = SimpleNamespace(shards=[object(), object()])
    s = summarize(fleet, lines, results, tmp_path / "o.jsonl", seconds=2.0)
    assert s["shards"] == 2
    assert s["requests"] == 4
    assert s["completed"] == 2
    assert s["failed"] == 2
    assert s["errors"] == [{"line": 2, "error": "bad line"}, {"line": 4, "error": "RequestError: too long"}]
    assert s["generated_tokens"] == 4
    assert s["tokens_per_s"] == 2.0
    assert s["weight_versions"] == [2]
    assert s["per_shard"] == {"0": {"requests": 1, "tokens": 1}, "1": {"requests": 1, "tokens": 3}}
    assert s["output"] == str(tmp_path / "o.jsonl")
    json.dumps(s)


def test_summarize_zero_seconds(tmp_path):
    s = summarize(SimpleNamespace(shards=[]), [], [], tmp_path / "o.jsonl", seconds=0.0)
    assert s["tokens_per_s"] == 0.0 and s["requests"] == 0 and s["failed"] == 0


# --------------------------------------------------------------------------------------------
# nothing done is lost: lines written as they finish, read back to resume


from nemo_gen.jsonl import OutputWriter, read_finished  # noqa: E402
from nemo_gen.pipeline import generate_lines  # noqa: E402


class _Fleet:
    """A stand-in for GenerationFleet.generate: answers each prompt with its upper-case text,
    records what it was asked, and can be told to fail (as a kill would stop it) on a call."""

    def __init__(self, output: Path | None, resume: bool = False, fail_on_call: int | None = None, watch=None):
        self.settings = NemoGenSettings.load(overrides={"run.output": str(output) if output else None,
                                                        "run.resume": resume})
        self.asked: list[list[str]] = []
        self.fail_on_call = fail_on_call
        self.watch = watch
        self.shards = [object()]

    def generate(self, prompts, **sampling):
        if self.watch:
            self.watch(len(self.asked))
        self.asked.append(list(prompts))
        if self.fail_on_call == len(self.asked):
            raise KeyboardInterrupt
        return [GenerationResult(index=i, prompt=p, prompt_token_ids=[1], text=p.upper(), token_ids=[7, 8],
                                 shard=0, weight_version=0) for i, p in enumerate(prompts)]


def _prompts(tmp_path: Path, n: int, bad_at: int | None = None) -> list:
    rows = [json.dumps({"prompt": f"p{i}", "id": i}) if i != bad_at else "not json" for i in range(1, n + 1)]
    return read_prompts(_file(tmp_path, *rows))


def _rows(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def _fingerprint_as(fleet, lines, out: Path) -> None:
    """Record ``out`` (written by hand) as made by a run of ``fleet`` over ``lines``."""
    from nemo_gen.jsonl import write_fingerprint
    from nemo_gen.pipeline import run_fingerprint

    write_fingerprint(out, run_fingerprint(fleet.settings, lines, getattr(fleet, "weight_version", None)))


def test_the_writer_flushes_each_batch(tmp_path):
    path = tmp_path / "out" / "o.jsonl"
    with OutputWriter(path) as w:
        w.write([{"line": 1}, {"line": 2}])
        assert _rows(path) == [{"line": 1}, {"line": 2}]  # on disk before the writer closes
        w.write([{"line": 3}])
        assert len(_rows(path)) == 3


def test_each_batch_is_in_the_output_as_soon_as_it_finishes(tmp_path):
    out = tmp_path / "o.jsonl"
    lines = _prompts(tmp_path, 5, bad_at=3)
    seen = []
    fleet = _Fleet(out, watch=lambda calls: seen.append(sorted(r["line"] for r in _rows(out))))
    results = generate_lines(fleet, lines, batch_size=2)
    # the malformed line at once, then each batch of 2 valid lines before the next is asked
    assert seen == [[3], [1, 2, 3]]
    assert sorted(r["line"] for r in _rows(out)) == [1, 2, 3, 4, 5]
    write_outputs(lines, results, out)  # the end of the job: one row per line, in input order
    assert [r["line"] for r in _rows(out)] == [1, 2, 3, 4, 5]
    assert [r["text"] for r in _rows(out)] == ["P1", "P2", None, "P4", "P5"]


class _ShortFleet(_Fleet):
    """Answers one prompt fewer than it was asked (a fleet bug), as a list of the right length."""

    def generate(self, prompts, **sampling):
        results = super().generate(prompts, **sampling)
        return results[:-1] + [None]


def test_a_run_that_left_lines_ungenerated_fails_naming_the_first(tmp_path):
    out = tmp_path / "o.jsonl"
    lines = _prompts(tmp_path, 4)
    with pytest.raises(InfraError, match=r"2 lines were not generated \(the first: input line 2\)"):
        generate_lines(_ShortFleet(out), lines, batch_size=2)
    assert sorted(r["line"] for r in _rows(out) if r["error"] is None) == [1, 3]  # what finished is kept


def test_an_interrupted_run_keeps_its_finished_lines_and_resumes_from_them(tmp_path):
    out = tmp_path / "o.jsonl"
    lines = _prompts(tmp_path, 7)
    with pytest.raises(KeyboardInterrupt):
        generate_lines(_Fleet(out, fail_on_call=3), lines, batch_size=2)
    kept = _rows(out)
    assert sorted(r["line"] for r in kept) == [1, 2, 3, 4]
    with open(out, "a") as f:
        f.write('{"line": 5, "prompt": "p5", "te')  # a row cut short by the kill
    fleet = _Fleet(out, resume=True)
    results = generate_lines(fleet, lines, batch_size=2)
    assert fleet.asked == [["p5", "p6"], ["p7"]]  # only what was not finished
    assert results.resumed == frozenset({0, 1, 2, 3})
    write_outputs(lines, results, out)
    rows = _rows(out)
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5, 6, 7]  # every line exactly once, in order
    assert [r["text"] for r in rows] == [f"P{i}" for i in range(1, 8)]
    assert rows[0] == {**kept[0], "line": 1}
    s = summarize(fleet, lines, results, out, seconds=1.0)
    assert (s["completed"], s["resumed"], s["failed"]) == (7, 4, 0)
    assert s["generated_tokens"] == 3 * 2  # this run's generation only


def test_failed_lines_are_generated_again_on_resume(tmp_path):
    out = tmp_path / "o.jsonl"
    lines = _prompts(tmp_path, 2)
    out.write_text(json.dumps({"line": 1, "prompt": "p1", "text": None, "error": "InfraError: shard died"}) + "\n"
                   + json.dumps({"line": 2, "prompt": "p2", "text": "P2", "error": None}) + "\n")
    fleet = _Fleet(out, resume=True)
    _fingerprint_as(fleet, lines, out)
    generate_lines(fleet, lines, batch_size=8)
    assert fleet.asked == [["p1"]]


def test_resume_refuses_an_output_of_another_input(tmp_path):
    lines = _prompts(tmp_path, 2)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"line": 1, "prompt": "something else", "error": None}) + "\n")
    with pytest.raises(InputFileError, match="different prompt"):
        read_finished(other, lines)
    other.write_text(json.dumps({"line": 9, "prompt": "p9", "error": None}) + "\n")
    with pytest.raises(InputFileError, match="input line 9"):
        read_finished(other, lines)
    other.write_text('{"a": 1}\n')
    with pytest.raises(InputFileError, match="not a nemo-gen output"):
        read_finished(other, lines)
    other.write_text('garbage\n{"line": 1, "prompt": "p1", "error": null}\n')
    with pytest.raises(InputFileError, match="line 1 is not valid JSON"):
        read_finished(other, lines)


def test_resume_with_no_output_yet_generates_everything(tmp_path):
    lines = _prompts(tmp_path, 3)
    assert read_finished(tmp_path / "none.jsonl", lines) == {}
    fleet = _Fleet(tmp_path / "none.jsonl", resume=True)
    generate_lines(fleet, lines, batch_size=8)
    assert fleet.asked == [["p1", "p2", "p3"]]


def test_token_id_prompts_resume_by_their_ids(tmp_path):
    lines = read_prompts(_file(tmp_path, json.dumps({"prompt_token_ids": [4, 5]})))
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps({"line": 1, "prompt": None, "prompt_token_ids": [4, 5], "text": "x",
                               "token_ids": [1], "error": None}) + "\n")
    assert set(read_finished(out, lines)) == {1}
    out.write_text(json.dumps({"line": 1, "prompt": None, "prompt_token_ids": [4, 6], "error": None}) + "\n")
    with pytest.raises(InputFileError):
        read_finished(out, lines)


def test_chat_lines_and_session_ids(tmp_path):
    from nemo_gen.core.results import GenerationResult, Sample
    from nemo_gen.jsonl import read_prompts, result_from_row, result_row

    p = tmp_path / "chat.jsonl"
    p.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "session_id": "a"}),
        json.dumps({"messages": [{"role": "user"}]}),
        json.dumps({"prompt": "x", "session_id": 3}),
        json.dumps({"messages": []}),
    ]) + "\n")
    lines = read_prompts(p)
    assert lines[0].prompt == [{"role": "user", "content": "hi"}] and lines[0].session_id == "a" and lines[0].error is None
    assert "'messages' must be a non-empty list" in lines[1].error and "'messages'" in lines[3].error
    assert lines[2].error == "'session_id' must be a string"
    # n samples survive the JSONL round trip a resumed run reads back.
    r = GenerationResult(index=0, prompt="x", prompt_token_ids=[1], text="a", token_ids=[2], weight_version=1,
                         weight_versions=[(1, 1)], samples=[Sample("a", [2], [0.0], "length", [(1, 1)]),
                                                            Sample("b", [3], [0.0], "stop", [(1, 1)])])
    row = json.loads(json.dumps(result_row(lines[0], r)))
    assert [s["text"] for s in row["samples"]] == ["a", "b"]
    back = result_from_row(row, 0)
    assert back.samples == r.samples and back.weight_versions == [(1, 1)]


class _AsyncFleet:
    """A stand-in for a fleet of AsyncLLM shards (``generate_async`` per request): line ``k``
    takes ``delay(k)`` seconds, so lines finish out of input order; records how many requests
    were in flight at once, and can be told to stop (as a kill would) once ``stop_after`` lines
    are answered."""

    def __init__(self, output: Path, resume: bool = False, delay=lambda k: 0.0, stop_after: int | None = None,
                 watch=None):
        self.settings = NemoGenSettings.load(overrides={"run.output": str(output), "run.resume": resume})
        self.shards = [SimpleNamespace(info=ShardInfo(slot=i, weight_version=0, async_engine=True)) for i in range(2)]
        self.delay, self.stop_after, self.watch = delay, stop_after, watch
        self.asked: list[str] = []
        self.answered = 0
        self.in_flight = self.most_in_flight = 0

    async def generate_async(self, prompt, session_id=None, **sampling):
        import asyncio

        self.asked.append(prompt)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay(int(prompt[1:])))
        finally:
            self.in_flight -= 1
        if self.watch:
            self.watch(prompt)
        if self.stop_after is not None and self.answered == self.stop_after:
            raise KeyboardInterrupt
        self.answered += 1
        return GenerationResult(index=0, prompt=prompt, prompt_token_ids=[1], text=prompt.upper(), token_ids=[7],
                                shard=0, weight_version=0)


def test_async_shards_get_one_request_per_line_and_each_line_is_written_when_it_finishes(tmp_path):
    out = tmp_path / "o.jsonl"
    lines = _prompts(tmp_path, 9)
    seen: dict[str, list[int]] = {}
    # p1 is slow: every other line finishes (and is on disk) before it does.
    fleet = _AsyncFleet(out, delay=lambda k: 0.3 if k == 1 else 0.01 * k,
                        watch=lambda p: seen.__setitem__(p, sorted(r["line"] for r in _rows(out))))
    results = generate_lines(fleet, lines, batch_size=4)
    assert fleet.most_in_flight == 4  # batch_size requests at once, never more
    assert sorted(fleet.asked) == sorted(f"p{i}" for i in range(1, 10))
    assert seen["p1"] == list(range(2, 10))  # written one by one as each finished, before p1
    assert [r["line"] for r in _rows(out)] == [2, 3, 4, 5, 6, 7, 8, 9, 1]  # completion order while running
    assert [r.text for r in results] == [f"P{i}" for i in range(1, 10)]
    write_outputs(lines, results, out)
    assert [r["line"] for r in _rows(out)] == list(range(1, 10))  # input order once complete


def test_async_shards_killed_mid_run_keep_every_finished_line_and_resume_exactly_once(tmp_path):
    out = tmp_path / "o.jsonl"
    lines = _prompts(tmp_path, 10, bad_at=4)
    with pytest.raises(KeyboardInterrupt):
        generate_lines(_AsyncFleet(out, delay=lambda k: 0.05 * (k % 3), stop_after=5), lines, batch_size=3)
    kept = {r["line"]: r for r in _rows(out) if r["error"] is None}
    assert len(kept) == 5 and 4 not in kept  # the 5 answered lines, whatever order they finished in
    fleet = _AsyncFleet(out, resume=True)
    results = generate_lines(fleet, lines, batch_size=3)
    assert sorted(fleet.asked, key=lambda p: int(p[1:])) == [lines[i].prompt for i in range(10)
                                                              if lines[i].line not in kept and lines[i].error is None]
    assert results.resumed == frozenset(i for i in range(10) if lines[i].line in kept)
    write_outputs(lines, results, out)
    rows = _rows(out)
    assert [r["line"] for r in rows] == list(range(1, 11))  # every line exactly once, in order
    assert rows[3]["error"] is not None and all(r["error"] is None for i, r in enumerate(rows) if i != 3)
    assert all(rows[line - 1] == row for line, row in kept.items())  # kept lines unchanged


def test_a_signal_exception_that_lands_in_a_loop_callback_still_stops_the_per_line_run():
    """A flow run's SIGTERM raises Prefect's TerminationSignal (a BaseException) wherever the main
    thread is; asyncio would log and swallow it inside a plain callback, and the run go on."""
    import asyncio

    from prefect.exceptions import TerminationSignal

    from nemo_gen.pipeline import _run

    async def generating():
        def signal_lands():
            raise TerminationSignal(15)

        asyncio.get_running_loop().call_soon(signal_lands)
        await asyncio.sleep(5)
        return "went on"

    t0 = time.monotonic()
    with pytest.raises(TerminationSignal):
        _run(generating())
    assert time.monotonic() - t0 < 2


def test_resume_with_no_output_named_is_refused_naming_run_output(tmp_path):
    from nemo_gen.errors import ConfigError
    from nemo_gen.pipeline import resumable

    lines = _prompts(tmp_path, 2)
    with pytest.raises(ConfigError, match="run.output") as err:
        resumable(NemoGenSettings.load(overrides={"run.resume": True}), lines)
    assert err.value.field == "run.output"
    assert resumable(NemoGenSettings.load(overrides={"run.resume": False}), lines) == {}
