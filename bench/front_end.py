"""Where a ``vllm.LLM``'s own process spends a batch: its front end, side by side in a shard
actor and in a plain process, with the garbage collector's share.

vLLM's sync engine is two processes: the EngineCore schedules and runs the model, the process
that holds the ``LLM`` (a shard actor, or a bare script) turns each step's outputs into request
state (detokenizing, logprob objects). They run in parallel, so a batch takes the longer of the
two per step: on a GPU, where a decode step of a small model takes milliseconds, the front end
can be the bound. ``FrontEndClock`` splits a batch's wall time in that process into

- ``proc_s``: vLLM's ``OutputProcessor.process_outputs`` (the front end's own work),
- ``wait_s``: waiting for the EngineCore's next outputs (``get_output``),
- ``gc_s`` / ``gc_full``: seconds in the garbage collector, and its full (oldest-generation)
  collections, wherever in this process they fell.

Used by ``gpu_bare_vllm.py`` and ``gpu_bench.py`` (GPU) and, as a CPU benchmark, by this file's
``main``: a one-shard CPU fleet and a plain process on the fleet shard's own engine arguments,
their batches interleaved; the plain process (``gpu_bare_vllm.py``'s ``serve``) runs first as vLLM
leaves it, then with its heap frozen as the shard actor's is (``nemo_gen.shard.vllm_compat.freeze_heap``).
A third phase runs the same batch through ``fleet.generate``, the clock on the shard's engine: as
the fleet runs a batch (``fleet``: the engine decodes no text, the router decodes each sample
once) against the same batch with a stop string no sample contains (``fleet_engine_text``: vLLM's
front end decodes every token and every logprob entry's token, as it did for every batch before).

Run: ``python -m bench front_end [--prompts 512] [--tokens 64] [--rounds 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.lib import stats
from bench.lib.result import write_result
from bench.lib.setup import one_shard_tiny, quiet_environment, token_prompts

KEYS = ("wall_s", "proc_s", "wait_s", "gc_s", "gc_full", "steps", "frozen", "call_s")
NEVER = "\x00\x01never\x01\x00"  # a stop string no sample contains: the engine decodes every token


class FrontEndClock:
    """Timers on one ``vllm.LLM``'s front end (its output processor and its wait for the
    EngineCore) and on this process's garbage collector. ``reset`` before a batch, ``read``
    after it. Benchmark use only: it wraps two of vLLM's internal methods."""

    def __init__(self, llm):
        engine = llm.llm_engine
        self._acc: dict[str, float] = {}
        self.reset()
        processor, core = engine.output_processor, engine.engine_core
        acc = self._acc

        def timed(fn, key: str, count: str | None = None):
            def wrapper(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    acc[key] += time.perf_counter() - t
                    if count:
                        acc[count] += 1

            return wrapper

        processor.process_outputs = timed(processor.process_outputs, "proc_s", count="steps")
        core.get_output = timed(core.get_output, "wait_s")
        started: list[float] = []

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                started.append(time.perf_counter())
            elif started:
                acc["gc_s"] += time.perf_counter() - started.pop()
                acc["gc_full"] += info.get("generation") == 2

        gc.callbacks.append(on_gc)

    def reset(self) -> None:
        self._acc.update(proc_s=0.0, wait_s=0.0, gc_s=0.0, gc_full=0, steps=0)
        self._t0 = time.perf_counter()

    def read(self) -> dict:
        return {"wall_s": time.perf_counter() - self._t0, **self._acc, "frozen": gc.get_freeze_count()}


def clock_of(llm) -> FrontEndClock:
    """The clock on ``llm`` (installed on first use)."""
    clock = getattr(llm, "_nemo_gen_front_end", None)
    if clock is None:
        clock = llm._nemo_gen_front_end = FrontEndClock(llm)
    return clock


def medians(runs: list[dict]) -> dict:
    return stats.medians(runs, KEYS)


class PlainEngine:
    """``gpu_bare_vllm.py ... serve`` started on a fleet shard's own engine arguments and environment
    (``spec``: its ``ShardSpec``; the script's ``BARE_ENGINE_KWARGS``), up and warm: the same
    engine outside Ray and nemo_gen, timed by the same clock."""

    def __init__(self, spec, prompts: list[list[int]], tokens: int, work: Path):
        (work / "plain-kwargs.json").write_text(json.dumps(spec.engine_kwargs))
        (work / "plain-prompts.json").write_text(json.dumps(prompts))
        kwargs = spec.engine_kwargs
        # model, memory share and length are the script's plain-vLLM arguments: unused here
        # (BARE_ENGINE_KWARGS replaces them), given for its argument list.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.gpu_bare_vllm", str(work / "plain.json"),
             kwargs["model"], "0", "0", str(work / "plain-prompts.json"), str(tokens),
             kwargs.get("logprobs_mode", "processed_logprobs"), "serve"],
            env={**os.environ, **spec.engine_env, "BARE_ENGINE_KWARGS": str(work / "plain-kwargs.json")},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._answer("BARE READY")

    def _answer(self, prefix: str) -> str:
        for line in self.proc.stdout:  # vLLM's own log lines share its stdout
            if line.startswith(prefix):
                return line[len(prefix):]
        raise RuntimeError(f"the plain engine exited {self.proc.wait()}")

    def ask(self, line: str) -> dict:
        """``run``: one timed batch, the clock's reading; ``freeze``: freeze its heap."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self._answer("BARE ")).get("front_end", {})

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.communicate(timeout=120)  # the end of its stdin: the engine stops


def _by_value() -> None:
    """Functions of this module sent to a shard actor travel by value: the actor cannot import
    bench (its worker need not have this checkout on its path)."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def actor_clock(handle, reset: bool) -> dict | None:
    """The clock on a shard's engine, inside its actor: installed and reset (``reset``), or read."""
    import ray

    _by_value()

    def fn(actor, reset):
        clock = clock_of(actor.shard.engine._llm)
        if reset:
            clock.reset()
            return None
        return clock.read()

    return ray.get(handle.actor.__ray_call__.remote(fn, reset), timeout=60)


def in_actor_batch(handle, prompts: list[list[int]], tokens: int) -> dict:
    """One ``LLM.generate`` of ``prompts`` on a shard's own engine, inside its actor, with the
    front-end clock: what the plain process runs, in the actor's process."""
    import ray

    _by_value()

    def fn(actor, prompts, tokens):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine = actor.shard.engine
        clock = clock_of(engine._llm)
        sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0)
        engine._rpc_active += 1  # the fleet's probes answer "skipped" instead of starting a batch
        try:
            while engine._lock.locked():
                time.sleep(0.01)
            clock.reset()
            engine._llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
            return clock.read()
        finally:
            engine._rpc_active -= 1

    return ray.get(handle.actor.__ray_call__.remote(fn, prompts, tokens), timeout=600)


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    quiet_environment()

    from nemo_gen import GenerationFleet

    settings, work = one_shard_tiny("front-end")
    prompts = token_prompts(args.prompts)
    fleet = GenerationFleet.launch(settings)
    plain = None
    runs: dict[str, list[dict]] = {"actor": [], "plain": [], "plain_frozen": [], "fleet": [], "fleet_engine_text": []}
    try:
        plain = PlainEngine(fleet.resolved.shards[0], prompts, args.tokens, work)
        in_actor_batch(fleet.shards[0], prompts[:8], args.tokens)  # warm
        for phase in ("plain", "plain_frozen"):
            if phase == "plain_frozen":
                plain.ask("freeze")
            for i in range(args.rounds):
                for arm in (("actor", phase) if i % 2 == 0 else (phase, "actor")):
                    runs[arm].append(in_actor_batch(fleet.shards[0], prompts, args.tokens) if arm == "actor"
                                     else plain.ask("run"))
        for i in range(args.rounds):
            for arm in (("fleet", "fleet_engine_text") if i % 2 == 0 else ("fleet_engine_text", "fleet")):
                actor_clock(fleet.shards[0], reset=True)
                t = time.perf_counter()
                fleet.generate(prompts, temperature=0, max_new_tokens=args.tokens, ignore_eos=True, logprobs=0,
                               **({"stop_strings": [NEVER]} if arm == "fleet_engine_text" else {}))
                runs[arm].append({**actor_clock(fleet.shards[0], reset=False), "call_s": time.perf_counter() - t})
    finally:
        if plain is not None:
            plain.close()
        fleet.shutdown()
    summary = {arm: medians(r) for arm, r in runs.items()}
    print(f"{'median of ' + str(args.rounds):<22}" + "".join(f"{k:>10}" for k in KEYS))
    for arm, m in summary.items():
        print(f"{arm:<22}" + "".join(f"{m.get(k, float('nan')):>10.3g}" for k in KEYS))
    f, e = summary["fleet"], summary["fleet_engine_text"]
    print(f"fleet.generate: front-end work (proc_s) with the router's text / the engine's: {f['proc_s'] / e['proc_s']:.2f}; "
          f"the call's time: {f['call_s'] / e['call_s']:.2f}")
    a, b = summary["actor"], summary["plain"]
    print(f"\nGC's share of a batch: shard actor (heap frozen) {a['gc_s'] / a['wall_s']:.1%}, plain process "
          f"{b['gc_s'] / b['wall_s']:.1%}; front-end work (proc_s) actor / plain: {a['proc_s'] / b['proc_s']:.2f}; "
          f"load average {os.getloadavg()[0]:.1f}")
    return write_result(args.json, "front_end", args, {"runs": runs, "median": summary,
                                                       "load_average": os.getloadavg()[0]})
