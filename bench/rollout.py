"""Rollouts at the GPU's limit: nemo_gen's fleet against a bare vLLM at its best settings, by batch,
and where a step's time goes.

    PYTHONPATH=$PWD:/tmp/nemo-gen-site python3 -m bench rollout --out DIR        (the GPU host)
    PYTHONPATH=$PWD .venv/bin/python -m bench rollout --device cpu --tiny --out DIR
                                        (the CPU dry run on the tiny model, under the engine lock)

For each model of ``--models`` and precision of ``--precisions``: one ``GenerationFleet`` (one
shard, ``vllm_cfg.async_engine`` per ``--engine``), its batches timed, the fleet shut down; then a
bare ``vllm.LLM`` in a process of its own (``bench/rollout_bare.py``) on the same engine settings,
the same batches. The work is what RL asks for: ``--batches`` prompts of 32 tokens x ``--tokens``
new tokens, temperature 1, EOS ignored, the logprob of every sampled token (``logprobs=0``). Both
engines: ``max_num_seqs`` and the CUDA-graph capture size cover the largest batch (nemo_gen's
``vllm_cfg.max_num_seqs`` / ``max_cudagraph_capture_size``), vLLM's async scheduling (its
default), vLLM's stats on (the step counters below read them). The bare engine adds vLLM's best
per request: ``detokenize=False`` (the fleet's router decodes text once, at the end).

Models (GPU): ``8b``, a random Llama of Llama-3-8B's shape with its vocabulary (32 x (4096,
14336), 8 KV heads, 128,256 rows; bf16, made on the GPU as lora_fp8_gpu does); ``1b``,
examples/grpo.py's 1.13 B Llama (the tiny tokenizer's 512 rows). ``--tiny``: nemo_gen's tiny model.

Per batch and arm (``--rounds`` runs; medians): tokens/s; ``ms_per_step`` and ``tokens_per_step``
from vLLM's own counters (engine steps, tokens scheduled); ``gpu_busy`` (NVML's share of time a
kernel ran, sampled every 50 ms while the batch ran); ``roofline``: the step's floor from the
copy bandwidth and matrix rates measured in this run (bench/lib/roofline.py) and the measured
tokens/s as a fraction of the floor's. ``--profile-batch``: one more run of that batch with
py-spy sampling every busy process (the shard actor, the EngineCore, the driver; the bare
process and its EngineCore) a second into it (bench/lib/pyspy.py): top frames by process.

Verdicts: ``tokens_bN`` (every sequence got ``--tokens`` tokens, each with its logprob: FAIL
otherwise), ``fleet_over_bare_bN`` (fleet / bare tokens/s >= 0.9, MISS otherwise). Results:
``DIR/rollout.json`` (bench/lib/result.py's schema), written after every arm; a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.lib.result import make as make_result
from bench.lib.setup import quiet_environment, token_prompts
from bench.lib.stats import check, verdict

NAME = "rollout"
PROMPT_TOKENS = 32
TARGET = 0.9  # fleet / bare tokens/s
MODELS = {  # name -> (how it is made, its shape)
    "8b": {"layers": 32, "mlp": 14336, "kv_heads": 8, "vocab": 128256},  # bench.gpu_bench.make_model
    "1b": {"hidden_size": 2048, "num_layers": 22, "num_heads": 32, "intermediate_size": 5632},  # examples/grpo.py's
}
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def measure(run: Callable[[int], tuple[float, int, int]], counters: Callable[[], dict | None], args,
            gpu: bool, profile_dir: Path | None, progress: Callable[[dict], None]) -> dict[str, Any]:
    """Each batch of ``args.batches`` ``args.rounds`` times (``run(batch)`` -> seconds, tokens,
    tokens with a logprob), with the GPU's busy share and vLLM's counters around each; then, if
    asked, the profile batch under py-spy. Shared by the fleet and the bare process."""
    from bench.lora_fp8_gpu import GpuBusy, batch_engine_figures

    rows: dict[str, Any] = {}
    run(min(8, min(args.batches)))  # warm: the first requests of a size pay for lazy set-up
    for batch in args.batches:
        seconds, busy, engine = [], [], None
        for _ in range(args.rounds):
            before = counters()
            with GpuBusy(gpu) as meter:
                s, tokens, with_logprob = run(batch)
            seconds.append(s)
            if before is not None:
                engine = batch_engine_figures(before, counters(), s)  # the last round's
            if meter.share is not None:
                busy.append(meter.share)
        rows[str(batch)] = {"batch": batch, "tokens": tokens, "tokens_with_logprob": with_logprob, "seconds": seconds,
                            "tokens_per_s": tokens / statistics.median(seconds),
                            "gpu_busy": statistics.median(busy) if busy else None, "engine": engine}
        say(f"  b={batch}: {json.dumps(rows[str(batch)])}")
        progress(rows)
    out: dict[str, Any] = {"batches": rows}
    if args.profile_batch and profile_dir is not None:
        from bench.lib.pyspy import Profile

        with Profile(profile_dir, args.profile_delay_s, args.profile_s) as prof:
            s, tokens, _ = run(args.profile_batch)
            again = 0
            while prof.running() and again < 20:  # the batch again until the record ends: it sees batches only
                run(args.profile_batch)
                again += 1
        out["profile"] = {"batch": args.profile_batch, "seconds": s, "tokens_per_s": tokens / s, "batches_after": again,
                          **prof.summary()}
    return out


def fleet_arm(args, model_dir: Path, precision: str, prompts: list[list[int]], work: Path, out: Path,
              progress: Callable[[dict], None]) -> dict[str, Any]:
    from bench.lora_fp8_gpu import engine_counters
    from nemo_gen import GenerationFleet
    from nemo_gen.settings import NemoGenSettings

    gpu = args.device == "gpu"
    over: dict[str, Any] = {
        "home": str(work / "home"), "model.path": str(model_dir), "fleet.name": "rollout", "fleet.device": args.device,
        "fleet.num_shards": args.shards, "fleet.engine_start_timeout_s": 550, "health.probe_interval_s": 60.0,
        "health.probe_timeout_s": 60.0, "ray.namespace": "nemo_gen_rollout",
        "generation.vllm_cfg.max_model_len": args.max_model_len, "generation.vllm_cfg.enable_vllm_metrics_logger": True,
        "generation.vllm_cfg.async_engine": args.engine == "async",
        "generation.vllm_cfg.max_num_seqs": max(args.batches + [args.profile_batch])}
    if gpu:
        over.update({"fleet.shards_per_gpu": args.shards, "generation.vllm_cfg.gpu_memory_utilization": args.util / args.shards,
                     "generation.vllm_cfg.enforce_eager": False,
                     "generation.vllm_cfg.precision": precision,
                     "generation.vllm_cfg.max_cudagraph_capture_size": max(args.batches + [args.profile_batch])})
    t = time.monotonic()
    with GenerationFleet.launch(NemoGenSettings.load(overrides=over)) as fleet:
        launch_s = time.monotonic() - t
        say(f"fleet up in {launch_s:.0f} s")

        def run(batch: int) -> tuple[float, int, int]:
            t = time.perf_counter()
            results = fleet.generate(prompts[:batch], temperature=1.0, max_new_tokens=args.tokens, ignore_eos=True,
                                     logprobs=0)
            s = time.perf_counter() - t
            return s, sum(len(r.token_ids) for r in results), sum(len(r.logprobs) for r in results)

        res = measure(run, lambda: engine_counters(fleet), args, gpu, out / "profile-fleet", progress)
    return {"launch_s": launch_s, "engine": args.engine, **res}


def bare_arm(args, model_dir: Path, precision: str, out: Path, deadline: float) -> dict[str, Any]:
    """``bench/rollout_bare.py`` in a process of its own, bounded by ``deadline`` (monotonic);
    what it wrote by then (it writes after each batch)."""
    spec = {"model": str(model_dir), "device": args.device, "precision": precision, "util": args.util,
            "max_model_len": args.max_model_len, "max_num_seqs": max(args.batches + [args.profile_batch]),
            "batches": args.batches, "rounds": args.rounds, "tokens": args.tokens, "prompt_tokens": PROMPT_TOKENS,
            "profile_batch": args.profile_batch, "profile_s": args.profile_s, "profile_delay_s": args.profile_delay_s,
            "out": str(out / "bare.json"), "profile_dir": str(out / "profile-bare")}
    (out / "bare-spec.json").write_text(json.dumps(spec))
    if args.device == "gpu":  # the fleet's engine is gone, its memory may not be back yet: vLLM checks at start
        import torch

        t = time.monotonic()
        while time.monotonic() - t < 60:
            free, total = torch.cuda.mem_get_info()
            if free >= (args.util + 0.02) * total:
                break
            time.sleep(0.5)
    env = dict(os.environ)
    if args.device == "cpu":  # the fleet sets these for its CPU engines; a plain process gets the same
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})
    (out / "bare.json").unlink(missing_ok=True)
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.rollout_bare", str(out / "bare-spec.json")], env=env,
                              timeout=max(30.0, deadline - time.monotonic()), capture_output=True, text=True)
        rc: Any = proc.returncode
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = "timeout", str(exc.stdout or "")[-3000:]
    (out / "bare.log").write_text(tail)
    got = json.loads((out / "bare.json").read_text()) if (out / "bare.json").exists() else {}
    if rc != 0:
        got["error"] = f"rc {rc}: {tail[-1500:]}"
    return got


def compare(fleet: dict, bare: dict, floor: Callable[[int], dict] | None) -> list[dict[str, Any]]:
    """One row per batch: both arms' tokens/s, their ratio, ms a step, busy share, roofline fraction."""
    rows = []
    for key, f in (fleet.get("batches") or {}).items():
        b = (bare.get("batches") or {}).get(key, {})
        row: dict[str, Any] = {"batch": f["batch"], "fleet_tokens_per_s": f["tokens_per_s"],
                               "bare_tokens_per_s": b.get("tokens_per_s")}
        row["fleet_over_bare"] = f["tokens_per_s"] / b["tokens_per_s"] if b.get("tokens_per_s") else None
        for arm, r in (("fleet", f), ("bare", b)):
            engine = r.get("engine") or {}
            row[f"{arm}_ms_per_step"] = engine.get("ms_per_step")
            row[f"{arm}_tokens_per_step"] = engine.get("tokens_per_step")
            row[f"{arm}_gpu_busy"] = r.get("gpu_busy")
        if floor is not None:
            fl = floor(f["batch"])
            row["floor_ms_per_step"], row["floor_bound"] = fl["floor_ms"], fl["bound"]
            for arm in ("fleet", "bare"):
                tps = row[f"{arm}_tokens_per_s"]
                row[f"{arm}_roofline"] = tps / fl["tokens_per_s"] if tps else None
        rows.append(row)
    return rows


def make(args, name: str, work: Path, tiny: Path) -> Path:
    """The model's directory (made once per work directory)."""
    if name == "tiny":
        return tiny
    spec = MODELS[name]
    if name == "8b":
        path = work / f"llama-8b-v{spec['vocab']}"
        if not (path / "config.json").exists():
            import torch

            from bench.gpu_bench import make_model

            make_model(path, spec["layers"], tiny, mlp=spec["mlp"], kv_heads=spec["kv_heads"], vocab=spec["vocab"])
            torch.cuda.empty_cache()  # the module is dropped here: its GPU memory goes back to the engines
        return path
    from nemo_gen.tiny_model import make_tiny_model

    return make_tiny_model(work / "llama-1b", **spec)


def fmt(v: Any, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def table(results: dict[str, Any]) -> str:
    lines = ["model     prec  batch  fleet tok/s  bare tok/s  fleet/bare  ms/step fleet  bare  floor  busy fleet  bare"
             "  roofline fleet  bare"]
    for key, r in results.items():
        model, prec = key.split("/")
        for row in r.get("rows", []):
            lines.append(f"{model:<9} {prec:<5} {row['batch']:>5}  {fmt(row['fleet_tokens_per_s']):>11}  "
                         f"{fmt(row['bare_tokens_per_s']):>10}  {fmt(row['fleet_over_bare'], '.3f'):>10}  "
                         f"{fmt(row['fleet_ms_per_step'], '.2f'):>13}  {fmt(row['bare_ms_per_step'], '.2f'):>5}  "
                         f"{fmt(row.get('floor_ms_per_step'), '.2f'):>5}  {fmt(row['fleet_gpu_busy'], '.2f'):>10}  "
                         f"{fmt(row['bare_gpu_busy'], '.2f'):>4}  {fmt(row.get('fleet_roofline'), '.3f'):>14}  "
                         f"{fmt(row.get('bare_roofline'), '.3f'):>4}")
    return "\n".join(lines)


def verdicts(results: dict[str, Any], tokens: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, r in results.items():
        tag = key.replace("/", "_")
        for arm in ("fleet", "bare"):
            for b, row in ((r.get(arm) or {}).get("batches") or {}).items():
                want = int(b) * tokens
                out[f"{tag}_{arm}_tokens_b{b}"] = check(row["tokens"] == want and row["tokens_with_logprob"] == want)
        for row in r.get("rows", []):
            if row["fleet_over_bare"] is not None:
                out[f"{tag}_fleet_over_bare_b{row['batch']}"] = verdict(row["fleet_over_bare"], TARGET,
                                                                       higher_is_better=True)
    return out


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench rollout", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--tiny", action="store_true", help="nemo_gen's tiny model (the CPU dry run)")
    ap.add_argument("--models", default="8b,1b", help="comma-separated: 8b, 1b (GPU)")
    ap.add_argument("--precisions", default="bfloat16", help="comma-separated: bfloat16, fp8 (GPU)")
    ap.add_argument("--batches", default="512,64,256,1024", help="sequences a batch, in the order run")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per sequence")
    ap.add_argument("--rounds", type=int, default=2, help="timed runs of each batch per arm (median)")
    ap.add_argument("--engine", choices=("sync", "async"), default="sync", help="the fleet's vLLM engine")
    ap.add_argument("--arms", default="fleet,bare", help="which arms run: fleet, bare")
    ap.add_argument("--profile-batch", type=int, default=0, help="one more run of this batch under py-spy (0: none)")
    ap.add_argument("--profile-s", type=float, default=3.0, help="seconds py-spy records (whole seconds)")
    ap.add_argument("--profile-delay-s", type=float, default=1.0)
    ap.add_argument("--util", type=float, default=0.8, help="gpu_memory_utilization of each arm (one at a time)")
    ap.add_argument("--shards", type=int, default=1, help="the fleet's engines, all on the one GPU, --util split "
                    "among them (2: two engine cores feed the GPU, each half the batch)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--deadline-s", type=float, default=560, help="the bare arm is cut off by then")
    ap.add_argument("--work", default=None, help="models are made here (default: a fresh temporary directory)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in str(args.batches).split(",") if b]
    args.models = ["tiny"] if args.tiny else [m for m in args.models.split(",") if m]
    args.precisions = [p for p in args.precisions.split(",") if p]
    args.arms = {a for a in args.arms.split(",") if a}
    if args.tiny != (args.device == "cpu"):
        ap.error("--tiny is the CPU dry run: --device cpu --tiny together, or neither")
    if unknown := [m for m in args.models if m not in (*MODELS, "tiny")]:
        ap.error(f"unknown model(s) {unknown}: use {sorted(MODELS)}")
    if args.device == "cpu" and args.precisions != ["bfloat16"]:
        ap.error("the CPU dry run takes no --precisions (its engines run float32)")
    if min(args.batches, default=0) < 1 or args.tokens < 1 or args.rounds < 1 or args.shards < 1:
        ap.error("--batches, --tokens, --rounds and --shards must be at least 1")
    if not args.arms or args.arms - {"fleet", "bare"}:
        ap.error("--arms: fleet, bare or both")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse(argv)
    quiet_environment()
    gpu = args.device == "gpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import tempfile

    from nemo_gen.tiny_model import make_tiny_model

    work = Path(args.work or tempfile.mkdtemp(prefix="nemo-gen-rollout-"))
    work.mkdir(parents=True, exist_ok=True)
    tiny = make_tiny_model(work / "tiny")
    prompts = token_prompts(max(args.batches + [args.profile_batch]), PROMPT_TOKENS)
    arguments = {**vars(args), "arms": sorted(args.arms)}
    metrics: dict[str, Any] = {"command": " ".join(sys.argv), "results": {}}
    results = metrics["results"]

    def save() -> dict:
        doc = make_result(NAME, arguments, metrics, verdicts(results, args.tokens))
        (out / f"{NAME}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        return doc

    if gpu:
        import torch

        from bench.lib.roofline import measure_peaks

        metrics["stack"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
        metrics["peaks"] = measure_peaks()
        say(f"peaks: {metrics['peaks']}")
    deadline = T0 + args.deadline_s
    for model in args.models:
        model_dir = make(args, model, work, tiny)
        for precision in args.precisions:
            key = f"{model}/{precision}"
            r: dict[str, Any] = results.setdefault(key, {"model_dir": str(model_dir)})
            arm_out = out / key.replace("/", "-")
            arm_out.mkdir(parents=True, exist_ok=True)
            floor = None
            if gpu:
                from bench.lib.roofline import shape, step_floor

                s = shape(model_dir)
                r["shape"] = s
                floor = lambda b, s=s: step_floor(s, b, PROMPT_TOKENS + args.tokens / 2, precision, metrics["peaks"])  # noqa: E731
            for arm in ("fleet", "bare"):
                if arm not in args.arms:
                    continue
                say(f"{key}: {arm}")
                try:
                    if arm == "fleet":
                        r["fleet"] = fleet_arm(args, model_dir, precision, prompts, work, arm_out,
                                               lambda rows: (r.update(fleet={"batches": rows}), save()))
                    else:
                        r["bare"] = bare_arm(args, model_dir, precision, arm_out, deadline)
                except Exception as exc:  # recorded; the other arm and models still run
                    import traceback

                    r[arm] = {**(r.get(arm) or {}), "error": f"{type(exc).__name__}: {exc}",
                              "trace": traceback.format_exc()[-3000:]}
                r["rows"] = compare(r.get("fleet") or {}, r.get("bare") or {}, floor)
                save()
    doc = save()
    print(table(results), flush=True)
    say(f"verdicts: {doc['verdicts']}")
    return doc


if __name__ == "__main__":
    main()
