"""Resumable outputs (nemo_gen.jsonl, nemo_gen.pipeline): chat lines resume; a row cut by a kill is
dropped and generated again wherever it sits, after any number of kills; the output's fingerprint
(model, sampling, weight version, input) must match a resume's, which is refused naming the field;
an existing output is refused without --resume or --overwrite, before anything starts; the final
file is fsynced before its rename and its directory after.

The reliability review's probe B (finding 8) is the first three tests, as it ran."""

from __future__ import annotations

import json
import os
import random
import stat
from pathlib import Path

import pytest

from nemo_gen.core.results import GenerationResult as R
from nemo_gen.errors import ConfigError, InputFileError
from nemo_gen.jsonl import (OutputWriter, check_fingerprint, fingerprint_path, read_finished, read_prompts,
                            result_row, write_fingerprint, write_jsonl)
from nemo_gen.pipeline import generate_lines, resumable, run_fingerprint, write_outputs
from nemo_gen.settings import NemoGenSettings


def _chat_file(tmp_path: Path) -> Path:
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    return p


def _plain(tmp_path: Path, n: int = 3) -> list:
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(n)))
    return read_prompts(p)


# --------------------------------------------------------------------------------------------
# probe B


def test_probe_b_a_chat_line_resumes_by_its_messages(tmp_path):
    chat = read_prompts(_chat_file(tmp_path))
    # the row as the run writes it: prompt = the rendered chat template text
    with OutputWriter(tmp_path / "c.out") as w:
        w.write([result_row(chat[0], R(0, "<s>user: hi", [1, 5], "ok", [7]))])
    done = read_finished(tmp_path / "c.out", chat)
    assert sorted(done) == [1]
    assert done[1]["messages"] == [{"role": "user", "content": "hi"}]


def test_probe_b_a_chat_row_of_other_messages_is_refused(tmp_path):
    chat = read_prompts(_chat_file(tmp_path))
    row = result_row(chat[0], R(0, "<s>user: hi", [1, 5], "ok", [7]))
    (tmp_path / "c.out").write_text(json.dumps({**row, "messages": [{"role": "user", "content": "bye"}]}) + "\n")
    with pytest.raises(InputFileError, match="different prompt than input line 1"):
        read_finished(tmp_path / "c.out", chat)


def test_probe_b_a_row_cut_by_the_first_kill_does_not_block_the_resume_after_the_second(tmp_path):
    L = _plain(tmp_path)
    row = lambda i: json.dumps(result_row(L[i], R(i, f"p{i}", [1], "x", [2])))  # noqa: E731
    out = tmp_path / "p.out"
    out.write_text(row(0) + "\n" + row(1)[:25])  # kill 1: line 2 cut mid-write
    assert sorted(read_finished(out, L)) == [1]
    with OutputWriter(out, append=True) as w:  # the resumed run finishes line 2, then kill 2
        w.write([json.loads(row(1))])
    assert sorted(read_finished(out, L)) == [1, 2]
    assert out.read_text() == row(0) + "\n" + row(1) + "\n"  # the cut tail was cut off, not kept mid-file


def test_cut_rows_anywhere_in_the_file_are_dropped_and_their_lines_redone(tmp_path):
    """An output an earlier writer left with cut rows mid-file (kept on lines of their own), one
    cut inside a multi-byte character, one cut within the row's first bytes."""
    L = _plain(tmp_path, 4)
    rows = [json.dumps(result_row(L[i], R(i, f"p{i}", [1], "ü✓", [2])), ensure_ascii=False) for i in range(4)]
    cut_in_char = rows[2].encode()[: rows[2].encode().index("✓".encode()) + 1]
    out = tmp_path / "p.out"
    out.write_bytes(b"\n".join([rows[0].encode(), rows[1].encode()[:30], cut_in_char, b'{"li', rows[3].encode()[:-1],
                                rows[1].encode(), b""]))
    assert sorted(read_finished(out, L)) == [1, 2]  # 3 cut, 4 cut just before its closing brace
    out.write_text(rows[0] + "\ngarbage\n" + rows[1] + "\n")  # not a cut row: not a nemo-gen output
    with pytest.raises(InputFileError, match="line 2 is not valid JSON"):
        read_finished(out, L)


# --------------------------------------------------------------------------------------------
# kills at random bytes, with a stand-in fleet: every final output equals an uninterrupted one's


class _Killed(BaseException):
    """The stand-in for SIGKILL: raised after the output was cut at a random byte."""


class _Fleet:
    """Answers each line deterministically (chat lines rendered as a template would be); can be
    told to 'kill' the run on a call: the bytes written so far by this run are cut at a random
    point (a kill cuts a write anywhere) and _Killed raised."""

    def __init__(self, out: Path, resume: bool, weight_version: int = 0, kill_on_call: int | None = None,
                 rng: random.Random | None = None, **settings):
        self.settings = NemoGenSettings.load(overrides={"run.output": str(out), "run.resume": resume, **settings})
        self.weight_version, self.kill_on_call, self.rng, self.out = weight_version, kill_on_call, rng, out
        self.shards, self.calls = [object()], 0
        self.size_at_start = out.stat().st_size if out.exists() else 0

    def generate(self, prompts, **sampling):
        self.calls += 1
        if self.calls == self.kill_on_call:
            size = self.out.stat().st_size
            with open(self.out, "r+b") as f:
                f.truncate(self.rng.randint(min(self.size_at_start + 1, size), size))
            raise _Killed
        results = []
        for i, p in enumerate(prompts):
            text = "".join(f"<s>{m['role']}: {m['content']}" for m in p) if isinstance(p, list) else p
            results.append(R(i, text, [len(text)], f"{text.upper()} ü✓", [7, len(text)], shard=0,
                             weight_version=self.weight_version))
        return results


def _mixed(tmp_path: Path, n: int = 12) -> list:
    p = tmp_path / "mixed.jsonl"
    p.write_text("".join((json.dumps({"messages": [{"role": "user", "content": f"q{i}"}], "id": i}) if i % 2 else
                          json.dumps({"prompt": f"p{i}", "id": i})) + "\n" for i in range(n)))
    return read_prompts(p)


@pytest.mark.parametrize("seed", range(40))
def test_killed_three_times_at_random_bytes_then_resumed_equals_an_uninterrupted_run(tmp_path, seed):
    rng = random.Random(seed)
    lines = _mixed(tmp_path)
    ref = tmp_path / "ref.jsonl"
    write_outputs(lines, generate_lines(_Fleet(ref, resume=False), lines, batch_size=2), ref)

    out = tmp_path / "out.jsonl"
    for kill in range(3):
        todo = len(lines) - len(read_finished(out, lines))
        fleet = _Fleet(out, resume=kill > 0, kill_on_call=rng.randint(1, (todo + 1) // 2), rng=rng)
        with pytest.raises(_Killed):
            generate_lines(fleet, lines, batch_size=2)
    results = generate_lines(_Fleet(out, resume=True), lines, batch_size=2)  # never refuses its own output
    write_outputs(lines, results, out)
    assert out.read_text() == ref.read_text()


# --------------------------------------------------------------------------------------------
# the fingerprint


def _settings(tmp_path: Path, **overrides) -> NemoGenSettings:
    return NemoGenSettings.load(overrides={"run.output": str(tmp_path / "out.jsonl"), "run.resume": True,
                                           "model.path": str(tmp_path / "model"), **overrides})


def _made_by(tmp_path: Path, lines, weight_version: int = 0, **overrides) -> Path:
    out = tmp_path / "out.jsonl"
    generate_lines(_Fleet(out, resume=False, weight_version=weight_version,
                          **{"model.path": str(tmp_path / "model"), **overrides}), lines, batch_size=4)
    return out


def test_the_fingerprint_is_written_beside_the_output_and_rows_stay_plain(tmp_path):
    lines = _mixed(tmp_path, 4)
    out = _made_by(tmp_path, lines, **{"generation.temperature": 0.0})
    doc = json.loads(fingerprint_path(out).read_text())
    assert fingerprint_path(out).name == "out.jsonl.fingerprint.json"
    assert doc["fields"]["generation.temperature"] == 0.0 and doc["fields"]["weight_version"] == 0
    assert doc["fields"]["model.path"] == str((tmp_path / "model").resolve())
    assert {"model.files", "model.tokenizer", "generation.max_new_tokens", "run.input"} <= set(doc["fields"])
    assert all(isinstance(json.loads(l)["line"], int) for l in out.read_text().splitlines())  # no header row


@pytest.mark.parametrize("field, value", [("generation.temperature", 0.7), ("generation.max_new_tokens", 5),
                                          ("generation.top_p", 0.5), ("model.path", "other-model")])
def test_resume_with_other_settings_is_refused_before_launch_naming_the_field(tmp_path, field, value):
    lines = _mixed(tmp_path, 4)
    out = _made_by(tmp_path, lines)
    before = out.read_bytes()
    if field == "model.path":
        value = str(tmp_path / value)
    with pytest.raises(ConfigError) as err:
        resumable(_settings(tmp_path, **{field: value}), lines)
    assert err.value.field == field
    assert str(fingerprint_path(out)) in str(err.value) and "--overwrite" in str(err.value)
    assert out.read_bytes() == before
    assert sorted(resumable(_settings(tmp_path), lines)) == [1, 2, 3, 4]  # the same settings resume


def test_resume_of_another_input_or_changed_weights_is_refused_naming_it(tmp_path):
    lines = _mixed(tmp_path, 4)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"x" * 10)
    _made_by(tmp_path, lines)
    with pytest.raises(ConfigError) as err:
        resumable(_settings(tmp_path), _mixed(tmp_path, 5))  # a line added to the input
    assert err.value.field == "run.input"
    (tmp_path / "model" / "model.safetensors").write_bytes(b"y" * 11)  # new weights at the same path
    with pytest.raises(ConfigError) as err:
        resumable(_settings(tmp_path), lines)
    assert err.value.field == "model.files"


def test_resume_on_another_weight_version_is_refused_once_the_fleet_is_up(tmp_path):
    lines = _mixed(tmp_path, 4)
    out = _made_by(tmp_path, lines, weight_version=3)
    before = out.read_bytes()
    settings = {"model.path": str(tmp_path / "model")}
    assert sorted(resumable(_settings(tmp_path), lines)) == [1, 2, 3, 4]  # not known before launch
    with pytest.raises(ConfigError, match="was made with 3, this run has 4") as err:
        generate_lines(_Fleet(out, resume=True, weight_version=4, **settings), lines, batch_size=4)
    assert err.value.field == "weight_version"
    assert out.read_bytes() == before
    generate_lines(_Fleet(out, resume=True, weight_version=3, **settings), lines, batch_size=4)


def test_an_output_with_rows_and_no_fingerprint_is_refused(tmp_path):
    lines = _plain(tmp_path)
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(result_row(lines[0], R(0, "p0", [1], "x", [2]))) + "\n")
    with pytest.raises(ConfigError, match="has no fingerprint") as err:
        resumable(_settings(tmp_path), lines)
    assert err.value.field == "run.resume" and str(fingerprint_path(out)) in str(err.value)
    fingerprint_path(out).write_text("{not json")
    with pytest.raises(InputFileError, match="not valid JSON"):
        resumable(_settings(tmp_path), lines)


def test_an_empty_output_resumes_whatever_its_fingerprint(tmp_path):
    lines = _plain(tmp_path)
    out = tmp_path / "out.jsonl"
    out.write_text("")
    write_fingerprint(out, {"generation.temperature": 9.0})
    assert resumable(_settings(tmp_path), lines) == {}
    generate_lines(_Fleet(out, resume=True, **{"model.path": str(tmp_path / "model")}), lines, batch_size=4)
    check_fingerprint(out, run_fingerprint(_settings(tmp_path), lines, 0))  # rewritten for this run


# --------------------------------------------------------------------------------------------
# an existing output: --resume, --overwrite, or refused before anything starts


def test_an_existing_output_is_refused_without_resume_or_overwrite(tmp_path):
    lines = _plain(tmp_path)
    out = _made_by(tmp_path, lines)
    before = out.read_bytes()
    with pytest.raises(ConfigError, match="already exists") as err:
        resumable(_settings(tmp_path, **{"run.resume": False}), lines)
    assert err.value.field == "run.output" and str(out) in str(err.value)
    with pytest.raises(ConfigError, match="already exists"):  # generate_lines refuses too
        generate_lines(_Fleet(out, resume=False), lines, batch_size=4)
    assert out.read_bytes() == before
    with pytest.raises(ConfigError) as err:
        resumable(_settings(tmp_path, **{"run.overwrite": True}), lines)  # and --resume
    assert err.value.field == "run.overwrite"
    assert resumable(_settings(tmp_path, **{"run.resume": False, "run.overwrite": True}), lines) == {}
    # with overwrite: the old rows and fingerprint are replaced by this run's
    generate_lines(_Fleet(out, resume=False, weight_version=5, **{"run.overwrite": True}), lines, batch_size=4)
    assert json.loads(fingerprint_path(out).read_text())["fields"]["weight_version"] == 5


def test_an_empty_or_missing_output_needs_no_overwrite(tmp_path):
    lines = _plain(tmp_path)
    (tmp_path / "out.jsonl").write_text("")
    assert resumable(_settings(tmp_path, **{"run.resume": False}), lines) == {}
    (tmp_path / "out.jsonl").unlink()
    assert resumable(_settings(tmp_path, **{"run.resume": False}), lines) == {}


# --------------------------------------------------------------------------------------------
# fsync


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.mark.parametrize("write", ["output", "fingerprint"])
def test_the_file_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch, write):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append((f"fsync-{kind}", _fd_path(fd)))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "out.jsonl"
    if write == "output":
        write_jsonl(target, [{"line": 1}])
    else:
        write_fingerprint(target, {"weight_version": 0})
        target = fingerprint_path(target)
    assert [e[0] for e in events] == ["fsync-file", "replace", "fsync-dir"]
    tmp = events[1][1]
    assert events[0][1] == tmp and events[1][2] == str(target)  # the very file that is renamed
    assert events[2][1] == str(tmp_path)
