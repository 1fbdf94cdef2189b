"""The generation pipeline's steps as plain functions, and the whole pipeline without Prefect.

Each Prefect task in ``tasks/`` is a thin call into one of these; ``run_pipeline`` chains
them directly, which is what a library user (or the benchmark's baseline) gets with no
orchestrator at all.

It also decides what a run may do with an output that is already there (``resumable``, before
anything starts; ``generate_lines`` again once the fleet is up): continue it (``run.resume``,
when its fingerprint, ``run_fingerprint``, matches this run's), replace it (``run.overwrite``),
or refuse.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from nemo_gen import progress
from nemo_gen.core.results import GenerationResult
from nemo_gen.jsonl import (OutputWriter, PromptLine, check_fingerprint, holds_rows, read_finished, read_prompts,
                            remove_fingerprint, result_from_row, result_row, write_fingerprint, write_jsonl)
from nemo_gen.errors import ConfigError, InfraError
from nemo_gen.settings import NemoGenSettings


def load_prompts(settings: NemoGenSettings) -> list[PromptLine]:
    """The prompts to run: ``run.input`` when set, else the built-in ones."""
    if settings.run.input is not None:
        return read_prompts(settings.run.input)
    return [PromptLine(line=i + 1, prompt=p, record={"prompt": p}) for i, p in enumerate(settings.run.prompts)]


class LineResults(list):
    """One ``GenerationResult`` (or None for a malformed line) per input line; ``resumed``: the
    indexes whose result was read back from the output of an earlier, interrupted run."""

    def __init__(self, items=(), resumed: frozenset[int] = frozenset()):
        super().__init__(items)
        self.resumed = resumed


def resumable(settings: NemoGenSettings, lines: Sequence[PromptLine]) -> dict[int, dict[str, Any]]:
    """With ``run.resume``: the lines ``run.output`` already holds (by input line number),
    checked against ``lines``; empty otherwise. Call it before anything starts: every refusal
    about the output comes from here (a ``DataError``, exit 2) — a bad output file
    (InputFileError naming it and its line), an output made with another fingerprint
    (ConfigError naming the field; the weight version, known once the fleet is up, is checked by
    ``generate_lines``), ``run.resume`` with no ``run.output`` to continue (a fresh timestamped
    file would hold nothing to resume from), and an existing output without ``run.resume`` or
    ``run.overwrite`` (starting would truncate it)."""
    check_output(settings.run.output, settings.run.resume, settings.run.overwrite)
    if not settings.run.resume:
        return {}
    check_fingerprint(settings.run.output, run_fingerprint(settings, lines), skip=("weight_version",))
    return read_finished(settings.run.output, lines)


def check_output(output: str | Path | None, resume: bool, overwrite: bool) -> None:
    """Refuse what would lose or mix rows: ``resume`` with no output named, ``resume`` and
    ``overwrite`` together, an output that holds rows with neither (ConfigError naming the setting)."""
    if resume and overwrite:
        raise ConfigError("run.resume keeps the output's rows, run.overwrite discards them: choose one "
                          "(--resume or --overwrite)", field="run.overwrite")
    if resume and output is None:
        raise ConfigError("run.resume continues the output of an earlier run: name that file "
                          "(--output, run.output)", field="run.output")
    if not resume and not overwrite and output is not None and holds_rows(output):
        raise ConfigError(f"{output} already exists and holds rows (an earlier run's?): --resume continues it "
                          "(run.resume), --overwrite replaces it (run.overwrite)", field="run.output")


# What a resumed run must share with the one that made the output: what decides the tokens.
_SAMPLING = ("max_new_tokens", "temperature", "n", "top_p", "top_k", "stop_token_ids", "stop_strings",
             "bad_words", "ignore_eos")
# Checkpoint files whose change means other weights or another tokenizer at the same path.
_MODEL_FILES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model")
_NOT_YET = object()


def run_fingerprint(settings: NemoGenSettings, lines: Sequence[PromptLine], weight_version: Any = _NOT_YET,
                    sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """What produces this run's rows, as the output's fingerprint records it (dotted names, so a
    mismatch names the setting): the model (its directory, and each checkpoint file's name, size
    and modification time: hashing the weights would read gigabytes), the tokenizer, the sampling
    settings (``sampling``: per-call values over ``generation``'s), the dtype, vLLM's seed, the
    input (a hash of its parsed lines) and ``weight_version`` (left out until the fleet is up)."""
    g = settings.generation
    fields: dict[str, Any] = {
        "model.path": str(settings.model_dir().resolve()),
        "model.files": _files_digest(settings.model_dir()),
        "model.tokenizer": str(settings.tokenizer_dir().resolve()),
        **{f"generation.{k}": (sampling or {}).get(k, getattr(g, k)) for k in _SAMPLING},
        "generation.vllm_cfg.precision": g.vllm_cfg.precision,
        "generation.vllm_kwargs.seed": g.vllm_kwargs.get("seed"),
        "run.input": _lines_digest(lines),
    }
    for key in sorted(set(sampling or ()) - set(_SAMPLING)):
        fields[f"generation.{key}"] = sampling[key]
    if weight_version is not _NOT_YET:
        fields["weight_version"] = weight_version
    return fields


def _about(settings: NemoGenSettings | None) -> dict[str, Any]:
    """What the fingerprint file tells a person beside its fields (never compared)."""
    if settings is None:
        return {}
    return {"model": settings.model_name(),
            "input": str(settings.run.input) if settings.run.input is not None else "run.prompts (built in)"}


def _files_digest(directory: Path) -> str:
    try:
        entries = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in Path(directory).iterdir()
                         if e.is_file() and e.name.endswith(_MODEL_FILES))
    except OSError:
        return "unreadable"
    return "sha256:" + hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _lines_digest(lines: Sequence[PromptLine]) -> str:
    rows = [[line.line, line.record, line.error] for line in lines]
    return "sha256:" + hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def with_output(settings: NemoGenSettings, name: str) -> NemoGenSettings:
    """``settings`` with ``run.output`` named (``default_output``), so that each line is written
    there as it finishes rather than only at the end."""
    if settings.run.output is not None:
        return settings
    run = settings.run.model_copy(update={"output": default_output(settings, name)})
    return settings.model_copy(update={"run": run})


def serves_concurrently(fleet) -> bool:
    """Whether every shard runs vLLM's AsyncLLM (``generation.vllm_cfg.async_engine``), which
    batches concurrent requests itself. The sync engine takes one call at a time: requests sent
    to it one by one would run one by one."""
    infos = [getattr(h, "info", None) for h in getattr(fleet, "shards", ())]
    return bool(infos) and all(getattr(info, "async_engine", False) for info in infos)


def generate_lines(
    fleet,
    lines: Sequence[PromptLine],
    batch_size: int,
    output: str | Path | None = None,
    resume: bool | None = None,
    overwrite: bool | None = None,
    **sampling: Any,
) -> LineResults:
    """Generate every valid line; malformed lines get ``None`` (their error travels with the line).

    ``output`` (default: the fleet's ``run.output``): each finished line is appended to it, flushed,
    so a killed run keeps what it finished (``write_outputs`` then puts the file in input order).
    ``resume`` (default: ``run.resume``): lines that file already holds are not generated again;
    their results are read back from it, once its fingerprint matches this run's (weight version
    included: ``fleet.weight_version``). Otherwise an output that holds rows is refused unless
    ``overwrite`` (default: ``run.overwrite``); the fingerprint is written before the first row.

    On AsyncLLM shards (``serves_concurrently``) each line is its own request
    (``fleet.generate_async``), ``batch_size`` of them in flight at once and a new one sent as
    each finishes, so every line is written the moment it completes. The sync engine answers a
    call only when all of it is done: there, ``batch_size`` lines go in one ``fleet.generate``
    call and are written when it returns."""
    settings = getattr(fleet, "settings", None)
    if output is None and settings is not None:
        output = settings.run.output
    if resume is None:
        resume = bool(settings is not None and settings.run.resume)
    if overwrite is None:
        overwrite = bool(settings is not None and settings.run.overwrite)
    done: dict[int, dict[str, Any]] = {}
    if output is not None:
        check_output(output, resume, overwrite)
        fingerprint = run_fingerprint(settings or NemoGenSettings.load(), lines,
                                      getattr(fleet, "weight_version", None), sampling)
        if resume:
            check_fingerprint(output, fingerprint)
            done = read_finished(output, lines)
    out: list[GenerationResult | None] = [None] * len(lines)
    resumed = set()
    for i, line in enumerate(lines):
        if line.line in done:
            out[i] = result_from_row(done[line.line], i)
            resumed.add(i)
    valid = [i for i, line in enumerate(lines) if line.error is None]
    todo = [i for i in valid if i not in resumed]
    writer = None
    if output is not None:
        if not resume:
            # Fingerprint gone before the rows are: a kill in between leaves an output that is
            # refused (rows without a fingerprint) or empty, never old rows under a new fingerprint.
            remove_fingerprint(output)
        writer = OutputWriter(output, append=resume)
        if not resume or not holds_rows(output):
            write_fingerprint(output, fingerprint, about=_about(settings))
    report = _Progress(len(resumed), len(valid))

    def finished(indexes: Sequence[int]) -> None:
        if writer is not None:
            writer.write(result_row(lines[i], out[i]) for i in indexes)
        report.add(len(indexes))

    try:
        if writer is not None:
            writer.write(result_row(line, None, line.error) for line in lines if line.error is not None)
        report.emit()
        if serves_concurrently(fleet):
            _run(_per_line(fleet, lines, todo, batch_size, out, finished, sampling))
        else:
            for start in range(0, len(todo), batch_size):
                chunk = todo[start : start + batch_size]
                sessions = [lines[i].session_id for i in chunk]
                results = fleet.generate([lines[i].prompt for i in chunk],
                                         session_id=sessions if any(sessions) else None, **sampling)
                for i, result in zip(chunk, results):
                    out[i] = result
                finished(chunk)
        report.emit()
    finally:
        if writer is not None:
            writer.close()
    missing = [lines[i].line for i in todo if out[i] is None]
    if missing:  # never hand write_outputs a "finished" run with holes in it
        raise InfraError(f"{len(missing)} lines were not generated (the first: input line {missing[0]})")
    return LineResults(out, frozenset(resumed))


async def _per_line(fleet, lines: Sequence[PromptLine], todo: Sequence[int], in_flight: int,
                    out: list, finished, sampling: dict[str, Any]) -> None:
    """``in_flight`` workers take the next line as each of theirs finishes; the first error
    (a request the fleet refuses outright, a timeout) ends the run, as on the batch path."""
    pending = iter(todo)

    async def worker() -> None:
        for i in pending:
            line = lines[i]
            out[i] = await fleet.generate_async(line.prompt, session_id=line.session_id, **sampling)
            finished((i,))

    await asyncio.gather(*(worker() for _ in range(min(in_flight, len(todo)))))


def _run(coro) -> Any:
    """``asyncio.run`` for a coroutine that a signal may stop: Ctrl-C / SIGTERM raise
    ``Interrupted`` (a KeyboardInterrupt) in this thread, and a flow run's SIGTERM Prefect's
    ``TerminationSignal`` (a BaseException). asyncio passes such an exception on when it lands in
    a task or in the loop's wait, but reports and swallows it when it lands in a plain callback:
    that one is kept, the run cancelled and it raised here. The "exception was never retrieved"
    reports of the tasks it stopped are dropped: the exception going up is the one report."""
    landed: list[BaseException] = []

    def handler(loop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if exc is None or isinstance(exc, Exception):
            loop.default_exception_handler(context)
        elif "handle" in context and not landed:  # swallowed by a callback: stop the run with it
            landed.append(exc)
            for task in asyncio.all_tasks(loop):
                task.cancel()

    try:
        with asyncio.Runner() as runner:
            runner.get_loop().set_exception_handler(handler)
            try:
                return runner.run(coro)
            except asyncio.CancelledError:
                if landed:
                    raise landed[0] from None
                raise
    finally:
        # A signal that lands while the loop is being made leaves ``coro`` never started: closed,
        # it prints no "coroutine ... was never awaited" warning after the interrupted line.
        coro.close()


class _Progress:
    """``generate`` progress events: at most one per ``every_s`` while lines finish one by one."""

    def __init__(self, done: int, total: int, every_s: float = 0.5):
        self.done, self.total, self.every_s = done, total, every_s
        self._last = 0.0

    def add(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self._last >= self.every_s:
            self.emit()

    def emit(self) -> None:
        self._last = time.monotonic()
        progress.emit("generate", done=self.done, total=self.total)


def initial_refit(fleet, settings: NemoGenSettings) -> dict[str, Any] | None:
    """Train mode: engines started on dummy weights; load the real ones before any request.
    Returns the refit report (as JSON), or None in eval mode (engines loaded the checkpoint)."""
    if settings.is_eval():
        return None
    progress.emit("step", name="refit", status="running")
    report = fleet.refit(fleet.resolved.model_dir)
    if not report.ok:
        raise InfraError(f"initial refit failed on shards {[s.shard for s in report.failed]}: {report.failed[0].error}")
    progress.emit("refit", **report.to_json())
    return report.to_json()


def default_output(settings: NemoGenSettings, name: str) -> Path:
    if settings.run.output is not None:
        return Path(settings.run.output)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return settings.home / "outputs" / f"{name}-{stamp}.jsonl"


def write_outputs(lines: Sequence[PromptLine], results: Sequence[GenerationResult | None], path: Path) -> Path:
    rows = [result_row(line, result, line.error) for line, result in zip(lines, results)]
    return write_jsonl(path, rows)


def summarize(fleet, lines: Sequence[PromptLine], results: Sequence[GenerationResult | None], path: Path, seconds: float) -> dict[str, Any]:
    """The run's summary. Lines resumed from an earlier run's output count as completed; the
    token counts and tokens/s are this run's generation only."""
    resumed = getattr(results, "resumed", frozenset())
    done = [r for r in results if r is not None]
    ok = [r for r in done if r.ok]
    fresh = [r for i, r in enumerate(results) if r is not None and r.ok and i not in resumed]
    def generated(r: GenerationResult) -> int:  # every sample of a group counts
        return sum(len(s.token_ids) for s in r.samples) if r.samples else len(r.token_ids)

    tokens = sum(generated(r) for r in fresh)
    per_shard: dict[int, dict[str, int]] = {}
    for r in fresh:
        entry = per_shard.setdefault(r.shard, {"requests": 0, "tokens": 0})
        entry["requests"] += 1
        entry["tokens"] += generated(r)
    return {
        "shards": len(fleet.shards),
        "requests": len(lines),
        "completed": len(ok),
        "resumed": len(resumed),
        "failed": len(lines) - len(ok),
        "errors": [
            {"line": line.line, "error": line.error or (result.error if result else None)}
            for line, result in zip(lines, results)
            if line.error or (result is not None and not result.ok)
        ],
        "generated_tokens": tokens,
        "generate_seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "weight_versions": sorted({r.weight_version for r in ok if r.weight_version is not None}),
        "per_shard": {str(k): v for k, v in sorted(per_shard.items())},
        "output": str(path),
    }


def run_pipeline(settings: NemoGenSettings, name: str = "run") -> dict[str, Any]:
    """Every step, in order, as plain calls: the pipeline with no orchestrator."""
    from nemo_gen.environment import configure_environment
    from nemo_gen.fleet.cluster import cluster_resources, init_ray, shutdown_ray
    from nemo_gen.fleet.fleet import GenerationFleet
    from nemo_gen.fleet.resolve import resolve_generation
    from nemo_gen.fleet.driver import shard_driver

    lines = load_prompts(settings)  # a bad input file (or output to resume) fails before anything starts
    resumable(settings, lines)
    settings = with_output(settings, name)
    configure_environment(settings)
    conn = init_ray(settings.ray)
    fleet = None
    try:
        resolved = resolve_generation(settings, cluster_resources())
        driver = shard_driver(settings)
        handles = driver.launch_all(resolved.shards, progress.shard_event)
        fleet = GenerationFleet(resolved, handles, ray_connection=conn if conn.owned else None, driver=driver)
        refit = initial_refit(fleet, settings)
        t0 = time.perf_counter()
        results = generate_lines(fleet, lines, settings.run.batch_size)
        seconds = time.perf_counter() - t0
        path = write_outputs(lines, results, settings.run.output)
        return {**summarize(fleet, lines, results, path, seconds), "refit": refit}
    finally:
        if fleet is not None:
            fleet.shutdown()
        elif conn.owned:
            shutdown_ray(conn)
