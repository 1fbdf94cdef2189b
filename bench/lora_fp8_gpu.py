"""LoRA adapter refits and FP8 rollouts from a bf16 trainer, on one GPU in one run.

    PYTHONPATH=$PWD:/tmp/nemo-gen-site python3 -m bench lora_fp8_gpu --out DIR       (the GPU host)
    PYTHONPATH=$PWD .venv/bin/python -m bench lora_fp8_gpu --device cpu --tiny --out DIR
                                             (a dry run of steps 3-4 on the tiny model, under the engine lock)

The model: a random Llama of ``--layers`` x (hidden 4096, MLP ``--mlp``, 8 KV heads) in bf16,
made on the GPU with HF's own init and the tiny model's tokenizer (default 32 x 14336:
Llama-3-8B's layers, 15 GB; the GPU host has no internet, so no downloaded model). Its GPU copy is the "trainer's
policy". Steps, each recorded as it ends (an error or a passed ``--deadline-s`` is recorded as
such, never a number):

1. ``fp8_refit``: a fleet at ``generation.vllm_cfg.precision: fp8`` (vLLM's online per-tensor
   FP8) launched from the checkpoint: a fresh FP8 engine of those weights, whose greedy tokens
   are the reference. Refits from the policy through ``fleet.weight_sync_client()`` and
   ``nemo_gen_ipc``: to other weights (every tensor negated: tokens must change) and back (tokens
   must equal the reference), then ``--rounds`` timed refits of the same weights; once with bf16
   on the wire (quantized in the engine) and once quantized by the trainer (fp8 + a scale per
   fused layer, ``nemo_gen.vllm_ext.fp8.Fp8Source``: the bytes are counted); then a checkpoint
   refit of the same weights.
2. ``bf16``: a bf16 fleet of the same model, beside the FP8 one (each a half-GPU bundle,
   ``fleet.shards_per_gpu: 2``): full refits, ``nemo_gen_ipc`` from the policy and a checkpoint refit.
3. ``throughput``: rollout tokens/s of both fleets, FP8 and bf16 alternately (the order swapped
   every round), at each batch of ``--batches`` prompts x ``--tokens`` tokens (greedy,
   ignore_eos), ``--sweep-rounds`` rounds: the FP8 / bf16 ratio per batch, the median over rounds.
   Both engines get the same KV cache (``--kv-gib``, vLLM's ``kv_cache_memory_bytes``), enough
   for the largest batch, so neither queues or preempts where the other does not. With each
   batch, the GPU's busy share while it ran (``gpu_busy``, NVML): near 1, the GPU bounds it;
   well below, the processes feeding it do. And vLLM's own counters over the batch (its last
   round: ``engine``): engine steps, tokens a step carried, ms a step, preemptions, the KV
   cache's size in tokens. Then, at
   ``--text-batch`` prompts, each fleet's batch as it runs (its text decoded once per sample by
   the router) against the same batch with a stop string that never matches (vLLM's front end
   decodes every token and logprob entry in the shard's process, as every batch did before):
   the time ratio per fleet, alternated the same way.
4. ``lora``: (both fleets down) a bf16 fleet with LoRA enabled (eager: launch time only; a refit does not run the
   model): an adapter of rank ``--rank`` on every linear layer of every layer, refit from live
   tensors ``--rounds`` times (a new version each) and once from a PEFT directory; the adapter
   changes greedy tokens and each result names the version that made it.

Verdicts: ``fp8_tokens`` (refits back to the checkpoint's weights give the fresh FP8 engine's
tokens, online and trainer-side: FAIL otherwise), ``fp8_speedup_bN`` (FP8 / bf16 tokens/s at
batch N >= 1.3, MISS otherwise), ``adapter_bytes`` (an adapter refit moves <= 1/10 of a full refit's bytes),
``adapter_faster`` (an adapter refit takes less time than a full nemo_gen_ipc refit). Results:
``DIR/lora_fp8_gpu.json`` (bench/lib/result.py's schema), progress on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from bench.front_end import NEVER
from bench.gpu_bench import make_model
from bench.lib.result import make as make_result
from bench.lib.setup import quiet_environment, token_prompts
from bench.lib.stats import check, verdict

NAME = "lora_fp8_gpu"
T0 = time.monotonic()
RESULT: dict = {"steps": {}}
ARGS: dict = {}


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def verdicts() -> dict:
    s = RESULT["steps"]
    out = {k: check(bool(v.get("ok"))) for k, v in s.items() if "skipped" not in v}
    fp8, bf16, lora = s.get("fp8_refit", {}), s.get("bf16", {}), s.get("lora", {})
    if fp8.get("ok"):
        out["fp8_tokens"] = check(all(fp8[m]["tokens_equal_fresh_engine"] for m in ("online", "trainer"))
                                  and fp8["checkpoint"]["tokens_equal_fresh_engine"])
    ratios = {row["batch"]: row["fp8_over_bf16"] for row in s.get("throughput", {}).get("batches", [])
              if row.get("fp8_over_bf16") is not None}
    if ratios:
        RESULT["fp8_over_bf16_tokens_per_s"] = ratios
        for batch, ratio in ratios.items():
            out[f"fp8_speedup_b{batch}"] = verdict(ratio, 1.3, higher_is_better=True)
    full = bf16.get("full_refit_ipc") or bf16.get("full_refit_live")
    if lora.get("ok") and full:
        RESULT["adapter_vs_full"] = {"bytes": lora["live"]["bytes"] / full["bytes"],
                                     "seconds": lora["live"]["refit_s"] / full["refit_s"]}
        if bf16.get("full_refit_checkpoint"):
            RESULT["adapter_vs_full"]["seconds_vs_checkpoint"] = (lora["live"]["refit_s"]
                                                                  / bf16["full_refit_checkpoint"]["refit_s"])
        out["adapter_bytes"] = check(lora["live"]["bytes"] * 10 <= full["bytes"])
        out["adapter_faster"] = verdict(lora["live"]["refit_s"] / full["refit_s"], 1.0, higher_is_better=False)
    return out


def save(out: Path) -> None:
    (out / f"{NAME}.json").write_text(json.dumps(make_result(NAME, ARGS, RESULT, verdicts()), indent=1) + "\n")


def step(name: str, out: Path, args, need_s: float):
    """Run the decorated function now, if it is not skipped and ``need_s`` fits the deadline;
    record its result or its error (later steps still run)."""

    def run(fn):
        if name in args.skip:
            RESULT["steps"][name] = {"skipped": "--skip"}
        elif time.monotonic() - T0 + need_s > args.deadline_s:
            RESULT["steps"][name] = {"skipped": f"{args.deadline_s - (time.monotonic() - T0):.0f}s left, needs ~{need_s:.0f}s"}
        else:
            say(f"{name}: start")
            t = time.monotonic()
            try:
                RESULT["steps"][name] = {"ok": True, "seconds": time.monotonic() - t, **(fn() or {})}
                RESULT["steps"][name]["seconds"] = time.monotonic() - t
            except Exception as exc:  # recorded: later steps may still run
                RESULT["steps"][name] = {"ok": False, "seconds": time.monotonic() - t,
                                         "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        say(f"{name}: {json.dumps(RESULT['steps'][name], default=str)[:600]}")
        save(out)
        return RESULT["steps"][name]

    return run


class GpuBusy:
    """The GPU's busy share while a block runs: NVML's utilization (the share of its last sample
    period in which a kernel ran), sampled every 50 ms on a thread, averaged; ``share`` None where
    there is no GPU or no NVML."""

    def __init__(self, gpu: bool):
        self.gpu, self.samples, self.share = gpu, [], None
        self._stop = threading.Event()

    def _sample(self) -> None:
        import torch

        try:
            while not self._stop.wait(0.05):
                self.samples.append(torch.cuda.utilization(0) / 100)
        except Exception:  # no NVML binding here: no figure, the batch still counts
            self.samples = []

    def __enter__(self) -> "GpuBusy":
        if self.gpu:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.gpu:
            self._stop.set()
            self._thread.join()
            self.share = statistics.fmean(self.samples) if self.samples else None


def engine_counters(fleet) -> dict:
    """vLLM's own running totals over the fleet's engines (``enable_vllm_metrics_logger``): engine
    steps and the tokens they scheduled (``iteration_tokens_total``), preemptions, and the KV
    cache's size (``cache_config_info``). Two of them around a batch say what bounded it: the
    steps it took, the tokens a step carried, whether the KV cache forced preemptions."""
    total = {"steps": 0.0, "step_tokens": 0.0, "preemptions": 0.0, "kv_tokens": 0.0}
    for rows in fleet.vllm_metrics().values():
        for row in rows:
            name = row["name"].removesuffix("_total")
            if name == "vllm:iteration_tokens" and row["kind"] == "histogram":
                total["steps"] += row["count"]
                total["step_tokens"] += row["sum"]
            elif name == "vllm:num_preemptions" and row["kind"] == "counter":
                total["preemptions"] += row["value"]
            elif name == "vllm:cache_config_info":
                labels = row["labels"]
                total["kv_tokens"] += int(labels.get("num_gpu_blocks") or 0) * int(labels.get("block_size") or 0)
    return total


def batch_engine_figures(before: dict, after: dict, seconds: float) -> dict:
    """What the engines did during one batch, from ``engine_counters`` before and after it."""
    steps = after["steps"] - before["steps"]
    return {"engine_steps": steps, "tokens_per_step": (after["step_tokens"] - before["step_tokens"]) / steps
            if steps else None, "ms_per_step": 1e3 * seconds / steps if steps else None,
            "preemptions": after["preemptions"] - before["preemptions"], "kv_cache_tokens": after["kv_tokens"]}


def adapter(model_dir: Path, rank: int, seed: int) -> dict:
    """A PEFT LoRA adapter (live form: config + tensors, on the CPU) of rank ``rank`` on every
    linear layer of the model in ``model_dir``; B nonzero, so it changes greedy tokens."""
    import torch

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head
    dims = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for leaf, (d_in, d_out) in dims.items():
            part = "mlp" if leaf in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{i}.{part}.{leaf}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * 0.05
            tensors[f"{name}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * 0.05
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(dims), "base_model_name_or_path": str(model_dir), "bias": "none",
              "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "modules_to_save": None}
    return {"config": config, "tensors": tensors}


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--tiny", action="store_true", help="the tiny model (a CPU dry run: no fp8 steps)")
    ap.add_argument("--layers", type=int, default=32, help="layers of the random Llama (32 x MLP 14336, 8 KV heads: "
                    "Llama-3-8B's shape, 15 GB in bf16 with the tiny vocabulary)")
    ap.add_argument("--mlp", type=int, default=14336, help="the random Llama's MLP width")
    ap.add_argument("--vocab", type=int, default=None,
                    help="its vocabulary (default the tiny tokenizer's 512; 128256: Llama-3's output layer and sampler, "
                    "the tokenizer widened to match: bench.lib.wide_tokenizer)")
    ap.add_argument("--util", type=float, default=0.35,
                    help="gpu_memory_utilization of each fleet (the FP8 and the bf16 fleet share the GPU)")
    ap.add_argument("--kv-gib", type=float, default=12.0,
                    help="KV cache of each fleet, GiB (the same for both: enough for the largest batch)")
    ap.add_argument("--batches", default="64,128,256,512", help="rollout batches of the throughput sweep")
    ap.add_argument("--sweep-rounds", type=int, default=3, help="timed rounds per batch and fleet")
    ap.add_argument("--text-batch", type=int, default=512,
                    help="prompts of the engine-text comparison (0: none); see step 3")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="timed refits per kind (the first, which sets up, not in the median)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--deadline-s", type=float, default=510)
    ap.add_argument("--work", default="/tmp/nemo-gen-lora-fp8")
    ap.add_argument("--skip", default="", help="steps not to run, comma-separated: fp8_refit,bf16,throughput,lora")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in str(args.batches).split(",") if b]
    args.skip = {s for s in args.skip.split(",") if s}
    ARGS.update({**vars(args), "skip": sorted(args.skip)})
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    quiet_environment()
    gpu = args.device == "gpu"
    if args.tiny and gpu:
        ap.error("--tiny is the CPU dry run: use it with --device cpu")
    if not gpu and not args.tiny:
        ap.error("--device cpu runs the tiny model only: add --tiny")

    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from nemo_gen import GenerationFleet
    from nemo_gen.settings import NemoGenSettings
    from nemo_gen.tiny_model import make_tiny_model
    from nemo_gen.vllm_ext.vllm_backend import CudaIpcTrainerInitInfo, SharedMemoryTrainerInitInfo

    RESULT["stack"] = {"torch": torch.__version__, "python": sys.version.split()[0],
                       "gpu": torch.cuda.get_device_name(0) if gpu else None}
    RESULT["command"] = " ".join(sys.argv)
    tiny = make_tiny_model(work / "tiny")
    state: dict = {}

    @step("model", out, args, 90)
    def _():
        if gpu:
            model_dir = work / (f"llama-{args.layers}l-{args.mlp}" + (f"-v{args.vocab}" if args.vocab else ""))
            policy = make_model(model_dir, args.layers, tiny, mlp=args.mlp, kv_heads=8, vocab=args.vocab)
            note = (f"random Llama, {args.layers} layers x (4096, {args.mlp}), vocabulary {policy.config.vocab_size}, "
                    "bf16, made on the GPU (HF init, seed 0)")
        else:
            from transformers import AutoModelForCausalLM

            model_dir, policy = tiny, AutoModelForCausalLM.from_pretrained(str(tiny), torch_dtype=torch.float32)
            note = "nemo_gen's tiny model (float32, CPU): a dry run"
        state.update(policy=policy.eval(), model_dir=model_dir)
        state["nbytes"] = sum(p.numel() * p.element_size() for p in policy.parameters())
        return {"dir": str(model_dir), "bytes": state["nbytes"], "note": note}

    if "policy" not in state:
        return make_result(NAME, ARGS, RESULT, verdicts())
    policy, model_dir, nbytes = state["policy"], state["model_dir"], state["nbytes"]
    prompts = token_prompts(max(args.batches))
    probe = prompts[:4]
    backend = "nemo_gen_ipc" if gpu else "nemo_gen_shm"

    def settings(name: str, **over):
        base = {"home": str(work / "home"), "model.path": str(model_dir), "fleet.name": f"lora-fp8-{name}",
                "fleet.device": args.device, "fleet.num_shards": 1, "fleet.engine_start_timeout_s": 500,
                "generation.vllm_cfg.max_model_len": 512, "refit.backend": backend, "health.probe_interval_s": 60.0,
                "health.probe_timeout_s": 60.0, "ray.namespace": "nemo_gen_lora_fp8",
                "generation.vllm_cfg.enable_vllm_metrics_logger": True}  # engine_counters
        if gpu:
            base.update({"generation.vllm_cfg.gpu_memory_utilization": args.util, "fleet.shards_per_gpu": 2,
                         "generation.vllm_cfg.enforce_eager": False, "generation.vllm_cfg.precision": "bfloat16",
                         "generation.vllm_kwargs": {"kv_cache_memory_bytes": int(args.kv_gib * 2**30)}})
        return NemoGenSettings.load(overrides={**base, **over})

    def greedy(fleet, **kw):  # one prompt at a time: a fixed batch shape (see bench/gpu_bench.py)
        return [fleet.generate([p], temperature=0, max_new_tokens=16, ignore_eos=True, **kw)[0] for p in probe]

    def negate():  # other weights of the same layout; twice is the identity
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(-1.0)

    def trainer(fleet, quantize=None):
        info = (CudaIpcTrainerInitInfo(quantize=quantize) if gpu
                else SharedMemoryTrainerInitInfo(staging_dir="/dev/shm", quantize=quantize))
        return WeightTransferTrainerFactory.trainer_init(info, client=fleet.weight_sync_client(),
                                                         source=ModuleSource(policy))

    def timed_refits(engine) -> dict:
        times = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            engine.send_weights()
            times.append(time.perf_counter() - t)
            if not engine.client.report.ok:
                raise RuntimeError(f"refit failed: {engine.client.report.to_json()}")
        return {"refit_s": statistics.median(times[1:] or times), "first_refit_s": times[0], "rounds_s": times}

    def rollout(fleet, batch: int, **kw) -> tuple[float, int]:
        t = time.perf_counter()
        results = fleet.generate(prompts[:batch], temperature=0, max_new_tokens=args.tokens, ignore_eos=True, **kw)
        return time.perf_counter() - t, sum(len(r.token_ids) for r in results)

    if not gpu:
        for name in ("fp8_refit",):
            RESULT["steps"][name] = {"skipped": "fp8 runs on GPU fleets only (vLLM's CPU FP8 kernels need AMX)"}
    else:
        @step("fp8_refit", out, args, 240)
        def _():
            t = time.monotonic()
            state["fp8"] = fleet = GenerationFleet.launch(settings("fp8", **{"generation.vllm_cfg.precision": "fp8"}))
            res: dict = {"launch_s": time.monotonic() - t}
            fresh = [r.token_ids for r in greedy(fleet)]
            res["fresh_engine_tokens"] = fresh
            for mode, quantize in (("online", None), ("trainer", "fp8")):
                engine = trainer(fleet, quantize)
                try:
                    negate()
                    engine.send_weights()
                    other = [r.token_ids for r in greedy(fleet)]
                    negate()
                    engine.send_weights()
                    back = [r.token_ids for r in greedy(fleet)]
                    timed = timed_refits(engine)
                    again = [r.token_ids for r in greedy(fleet)]
                    sent = engine.source.nbytes() if quantize else nbytes
                    res[mode] = {**timed, "bytes": sent, "gb_per_s": sent / timed["refit_s"] / 1e9,
                                 "tokens_change_with_other_weights": other != fresh,
                                 "tokens_equal_fresh_engine": back == fresh and again == fresh,
                                 "tokens": {"other": other, "back": back, "after_rounds": again}}
                finally:
                    engine.shutdown()
                    # the trainer-side FP8 copy stays in this process's CUDA cache otherwise: vLLM
                    # then finds too little free memory to start the bf16 fleet beside this one
                    del engine
                    torch.cuda.empty_cache()
                say(f"fp8 {mode}: {json.dumps({k: v for k, v in res[mode].items() if k != 'tokens'})}")
            t = time.perf_counter()
            report = fleet.refit(str(model_dir))
            res["checkpoint"] = {"ok": report.ok, "refit_s": time.perf_counter() - t, "bytes": report.bytes,
                                 "tokens_equal_fresh_engine": [r.token_ids for r in greedy(fleet)] == fresh}
            res["trainer_over_online_bytes"] = res["trainer"]["bytes"] / res["online"]["bytes"]
            return res

    @step("bf16", out, args, 200)
    def _():
        t = time.monotonic()
        free = torch.cuda.mem_get_info()[0] if gpu else 0
        state["bf16"] = fleet = GenerationFleet.launch(settings("bf16"))
        res: dict = {"launch_s": time.monotonic() - t}
        if gpu:  # what vLLM's start-up check compares gpu_memory_utilization x total against
            res["gpu_free_gib_before_launch"] = free / 2**30
        before = [r.token_ids for r in greedy(fleet)]
        engine = trainer(fleet)
        try:
            res["full_refit_live"] = {**timed_refits(engine), "bytes": nbytes, "backend": backend}
        finally:
            engine.shutdown()
        t = time.perf_counter()
        report = fleet.refit(str(model_dir))
        res["full_refit_checkpoint"] = {"ok": report.ok, "refit_s": time.perf_counter() - t, "bytes": report.bytes}
        res["tokens_unchanged_by_refits_of_the_same_weights"] = [r.token_ids for r in greedy(fleet)] == before
        return res

    @step("throughput", out, args, 30 + 4 * args.sweep_rounds * (len(args.batches) + 2 * bool(args.text_batch)))
    def _():
        fleets = {k: state[k] for k in ("fp8", "bf16") if state.get(k) is not None}
        if not fleets:
            raise RuntimeError("no fleet to time: fp8_refit and bf16 launched none")
        for fleet in fleets.values():  # warm: first requests of a size pay for lazy set-up
            rollout(fleet, 8)
        rows = []
        for batch in args.batches:
            times: dict[str, list[float]] = {k: [] for k in fleets}
            tokens: dict[str, int] = {}
            busy: dict[str, list[float]] = {k: [] for k in fleets}
            engine: dict[str, dict] = {}
            for r in range(args.sweep_rounds):
                for k in (list(fleets) if r % 2 == 0 else list(fleets)[::-1]):
                    counted = engine_counters(fleets[k])
                    with GpuBusy(gpu) as meter:
                        seconds, tokens[k] = rollout(fleets[k], batch)
                    times[k].append(seconds)
                    engine[k] = batch_engine_figures(counted, engine_counters(fleets[k]), seconds)  # the last round's
                    if meter.share is not None:
                        busy[k].append(meter.share)
            row = {"batch": batch, "tokens": tokens, "seconds": times,
                   "tokens_per_s": {k: tokens[k] / statistics.median(v) for k, v in times.items()}, "engine": engine}
            if all(busy.values()):  # is the GPU the bound? (NVML's kernel-busy share while the batch ran)
                row["gpu_busy"] = {k: statistics.median(v) for k, v in busy.items()}
            if len(fleets) == 2:
                row["fp8_over_bf16"] = statistics.median(times["bf16"]) / statistics.median(times["fp8"])
                row["round_ratios"] = [b / f for f, b in zip(times["fp8"], times["bf16"])]
            say(f"throughput b={batch}: {json.dumps(row)}")
            rows.append(row)
        res = {"batches": rows, "kv_gib": args.kv_gib, "tokens_per_request": args.tokens}
        if args.text_batch:
            res["engine_text"] = text = {"batch": args.text_batch, "stop_strings": [NEVER]}
            for k, fleet in fleets.items():
                arms: dict[str, list[float]] = {"router_text": [], "engine_text": []}
                for r in range(args.sweep_rounds):
                    for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                        kw = {"stop_strings": [NEVER]} if arm == "engine_text" else {}
                        arms[arm].append(rollout(fleet, args.text_batch, **kw)[0])
                text[k] = {"seconds": arms, "engine_over_router_time": statistics.median(arms["engine_text"])
                           / statistics.median(arms["router_text"])}
                say(f"engine text {k}: {json.dumps(text[k])}")
        return res

    for k in ("fp8", "bf16"):
        if state.get(k) is not None:
            state.pop(k).shutdown()

    @step("lora", out, args, 150)
    def _():
        over = {"generation.vllm_cfg.lora.enabled": True, "generation.vllm_cfg.lora.max_rank": args.rank,
                "generation.vllm_cfg.lora.max_adapters": 2, "generation.vllm_cfg.enforce_eager": True}
        t = time.monotonic()
        with GenerationFleet.launch(settings("lora", **over)) as fleet:
            res: dict = {"launch_s": time.monotonic() - t}
            base = [r.token_ids for r in greedy(fleet)]
            times, reports, served = [], [], []
            for i in range(args.rounds):
                source = adapter(model_dir, args.rank, seed=i)
                t = time.perf_counter()
                report = fleet.refit_adapter("policy-a", source)
                times.append(time.perf_counter() - t)
                reports.append({"version": report.version, "engine_id": report.engine_id, "bytes": report.bytes,
                                "seconds": report.seconds})
                results = greedy(fleet, adapter="policy-a")
                served.append({"version": report.version, "result_versions": sorted({r.adapter_version for r in results}),
                               "tokens": [r.token_ids for r in results]})
            res["live"] = {"refit_s": statistics.median(times[1:] or times), "first_refit_s": times[0],
                           "rounds_s": times, "bytes": reports[-1]["bytes"], "reports": reports,
                           "tensors": len(source["tensors"]), "rank": args.rank}
            res["adapter_changes_tokens"] = all(s["tokens"] != base for s in served)
            res["each_result_names_the_new_version"] = all(s["result_versions"] == [s["version"]] for s in served)
            from safetensors.torch import save_file

            peft = work / "adapter"
            peft.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in source["tensors"].items()}, str(peft / "adapter_model.safetensors"))
            (peft / "adapter_config.json").write_text(json.dumps(source["config"]))
            t = time.perf_counter()
            report = fleet.refit_adapter("policy-b", str(peft))
            res["peft_dir"] = {"refit_s": time.perf_counter() - t, "bytes": report.bytes}
            # the same adapter from a PEFT directory, served beside the live one: on a random bf16 model
            # (near-tied logits) another LoRA slot's rounding can flip a greedy token, so this is a
            # share of equal tokens, not a check (tests/engine/test_lora.py checks exact tokens on CPU)
            peft_tokens = [r.token_ids for r in greedy(fleet, adapter="policy-b")]
            pairs = [(a, b) for x, y in zip(peft_tokens, served[-1]["tokens"]) for a, b in zip(x, y)]
            res["peft_dir_tokens_equal_live_share"] = sum(a == b for a, b in pairs) / max(1, len(pairs))
            res["served"] = served
            if not (res["adapter_changes_tokens"] and res["each_result_names_the_new_version"]):
                raise RuntimeError(f"adapter checks failed: {json.dumps({k: v for k, v in res.items() if k != 'served'})}")
        return res

    doc = make_result(NAME, ARGS, RESULT, verdicts())
    save(out)
    say(f"verdicts: {doc['verdicts']}")
    for key in ("fp8_over_bf16_tokens_per_s", "adapter_vs_full"):
        if key in RESULT:
            say(f"{key}: {RESULT[key]}")
    return doc


if __name__ == "__main__":
    main()
