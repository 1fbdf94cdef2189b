"""nemo_gen on a real GPU, in one run: refit bandwidth, launch against a bare vLLM, throughput,
restart after a SIGKILL. Every number is a ratio measured in the same run.

    PYTHONPATH=$PWD:/tmp/nemo-gen-site python3 -m bench gpu_bench --out DIR --log DIR/bench.log \
        2> DIR/bench.log

(``--log`` is where this process's stderr goes: the engines' own log lines, which Ray forwards
to it, give the launch breakdown.) On the host, in order, each step skipped when ``--deadline-s``
would be passed:

1. a random Llama of ``--layers`` x (hidden 4096, MLP 11008) in bf16 (11 layers: 4.5 GB), made
   on the GPU with the tiny model's tokenizer and saved as a checkpoint; the GPU copy stays as
   the "trainer's policy";
2. the device's copy bandwidth (``dst.copy_(src)`` of the model's size): the floor refit is
   measured against;
3. ``GenerationFleet.launch`` of one shard (CUDA graphs and torch.compile on, cold caches of its
   own; vLLM's files read once beforehand, so neither launch pays the page cache for the other) and its breakdown: Ray placement + actor start (launch minus the engine's own start),
   vLLM's weight load, compile, CUDA-graph capture, the rest of engine init;
4. refit through ``fleet.weight_sync_client()`` with ``nemo_gen_ipc`` from the policy on the same
   GPU: end to end (version flip included), inside the engine (start..finish, and the loaders or
   the copy-plan replay alone) and per client step (start / update / finish), on the direct load
   path (first round records the copy plan, later rounds replay it) and on vLLM's layerwise
   reload (switched on the running engine), as fractions of the copy bandwidth;
   then a checkpoint refit (disk -> /dev/shm staging -> GPU); greedy tokens before, after a
   refit with other weights (must differ: CUDA graphs see the new weights) and back (must match);
5. generation throughput through the fleet;
6. a bare ``vllm.LLM`` of the same model in a subprocess (its own cold caches): launch breakdown
   and the same generation -> launch and throughput ratios; then, with both engines up,
   ``--interleave`` rounds of one fleet run and one bare run (order swapped each round): the
   throughput ratio of their medians, measured in the same minutes;
7. SIGKILL of the shard actor -> its GPU memory back (NVML) -> a replacement (no spare; warm
   compile cache shared with the first launch) serving at the fleet's version: restart / launch;
8. vLLM's own ``ipc`` backend through the same client on a fleet started with it (unpacked and
   packed), against step 4's ``nemo_gen_ipc``.

Results: ``DIR/gpu_bench.json`` (everything) and ``DIR/gpu_bench.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bench.lib.result import make as make_result
from bench.lib.setup import quiet_environment, token_prompts
from bench.lib.stats import check
from bench.lib.wide_tokenizer import widen

T0 = time.monotonic()
RESULT: dict = {"steps": {}}
ARGS: dict = {}  # the command line, for the result file
SKIP: set[str] = set()  # steps named by --skip


def elapsed() -> float:
    return time.monotonic() - T0


def save(out: Path) -> None:
    verdicts = {k: check(bool(v.get("ok"))) for k, v in RESULT["steps"].items() if "skipped" not in v}
    (out / "gpu_bench.json").write_text(json.dumps(make_result("gpu_bench", ARGS, RESULT, verdicts), indent=1) + "\n")


def step(name: str, out: Path, deadline_s: float, need_s: float):
    """Decorator-ish: run fn if ``need_s`` seconds remain; record its result or its error."""

    def run(fn):
        if name in SKIP:
            RESULT["steps"][name] = {"skipped": "--skip"}
            save(out)
            return None
        if elapsed() + need_s > deadline_s:
            RESULT["steps"][name] = {"skipped": f"{deadline_s - elapsed():.0f}s left, needs ~{need_s:.0f}s"}
            save(out)
            return None
        t = time.monotonic()
        try:
            value = fn()
            RESULT["steps"][name] = {"ok": True, "seconds": time.monotonic() - t, **(value or {})}
        except Exception as exc:  # recorded: later steps may still run
            import traceback

            RESULT["steps"][name] = {"ok": False, "seconds": time.monotonic() - t,
                                     "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        print(f"[{elapsed():6.1f}s] {name}: {json.dumps(RESULT['steps'][name], default=str)[:400]}", flush=True)
        save(out)
        return RESULT["steps"][name]

    return run


def make_model(path: Path, layers: int, tiny: Path, mlp: int = 11008, kv_heads: int = 32, vocab: int | None = None):
    """A random bf16 Llama of ``layers`` x (hidden 4096, MLP ``mlp``, ``kv_heads`` KV heads) made
    on the GPU with HF's own init and the tiny model's tokenizer, saved as a checkpoint at
    ``path``; returns the GPU module (the trainer's policy of a GPU benchmark). ``vocab``: the
    embedding and output rows (default the tiny tokenizer's 512; a real model's, e.g. Llama-3's
    128256, puts its output layer and sampler on the GPU's step as a real model does), with the
    tokenizer widened to as many tokens (``bench.lib.wide_tokenizer``), so that every sampled id
    decodes to text as a real model's do."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny_cfg = json.loads((tiny / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=vocab or tiny_cfg["vocab_size"], hidden_size=4096, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=kv_heads, max_position_embeddings=1024, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=tiny_cfg.get("bos_token_id"), eos_token_id=tiny_cfg.get("eos_token_id"),
        pad_token_id=tiny_cfg.get("pad_token_id"),
    )
    torch.manual_seed(0)
    with torch.device("cuda"):  # HF's own init (normal(0, 0.02), norms 1), on the GPU: seconds
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="50GB")
    widen(tiny, path, config.vocab_size)  # the tiny tokenizer's files; as wide as the model's rows
    torch.cuda.synchronize()
    return model


def copy_bandwidth(nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / sorted(times)[len(times) // 2] / 1e9


PATTERNS = {
    "weights_load_s": r"Loading weights took ([\d.]+) seconds",
    "model_load_s": r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds",
    "profiling_run_s": r"Initial profiling/warmup run took ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "compile_s": r"init engine \(profile, create kv cache, warmup model\) took [\d.]+ s \(compilation: ([\d.]+) s",
    "kv_cache_tokens": r"KV cache size: ([\d,]+) tokens",
}


def breakdown(text: str) -> dict:
    """The engine's own timings, from its log lines (the last occurrence of each)."""
    out = {}
    for key, pattern in PATTERNS.items():
        found = re.findall(pattern, text)
        if found:
            out[key] = float(found[-1].replace(",", ""))
    return out


def cache_env(tag: str) -> dict[str, str]:
    """Compile/JIT caches of one's own, so the fleet and the bare engine both start cold. Of this
    run's own too: models of any --layers share hidden and MLP sizes, so a run found the kernels an
    earlier run of the same sitting left in a shared cache (the fleet's engine init 18 s against the
    cold bare engine's 41 s, bench/results/2026-12-02/h200-c.md). Within a run, restarts share the launch's."""
    base = f"/tmp/nemo-gen-bench-cache-{os.getpid()}-{tag}"
    return {"VLLM_CACHE_ROOT": f"{base}/vllm", "TRITON_CACHE_DIR": f"{base}/triton",
            "TORCHINDUCTOR_CACHE_DIR": f"{base}/inductor", "FLASHINFER_WORKSPACE_BASE": f"{base}/flashinfer"}


class timed_steps:
    """Wall seconds of each protocol step the trainer engine drives on the fleet's client
    (one ``apply_weight_update``, or start / update / finish): where an end-to-end refit goes
    besides the copy."""

    def __init__(self, client):
        self.client, self.seconds, self._orig = client, {}, {}
        self.started: dict[str, float] = {}  # the last call's start and end (perf_counter)
        self.ended: dict[str, float] = {}
        for name in ("apply_weight_update", "start_weight_update", "update_weights", "finish_weight_update"):
            fn = getattr(client, name, None)
            if fn is None:
                continue
            self._orig[name] = fn

            def timed(*a, _fn=fn, _name=name, **kw):
                t = self.started[_name] = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    self.ended[_name] = time.perf_counter()
                    self.seconds[_name] = self.seconds.get(_name, 0.0) + self.ended[_name] - t

            setattr(client, name, timed)

    def undo(self):
        for name, fn in self._orig.items():
            setattr(self.client, name, fn)


def summarize_rounds(rounds: list[dict], nbytes: int, copy_gbps: float) -> dict:
    """The steady state (median wall of every round after the first, which opens the handles
    and records the copy plan) as fractions of the device's copy bandwidth."""
    later = sorted(rounds[1:], key=lambda r: r["wall_s"])
    steady = later[len(later) // 2]
    gbps = nbytes / steady["wall_s"] / 1e9
    out = {"rounds": rounds, "first_wall_s": rounds[0]["wall_s"], "wall_s": steady["wall_s"], "steady": steady,
           "gbps": gbps, "fraction_of_copy": gbps / copy_gbps}
    if steady.get("engine_load_s"):
        out["engine_fraction_of_copy"] = nbytes / steady["engine_load_s"] / 1e9 / copy_gbps
    if steady.get("loaders_s"):
        out["loaders_fraction_of_copy"] = nbytes / steady["loaders_s"] / 1e9 / copy_gbps
    if steady.get("transfer_s"):  # the engine's update_weights: the chunk's arrival to its bytes in place
        out["transport_fraction_of_copy"] = nbytes / steady["transfer_s"] / 1e9 / copy_gbps
    return out


def in_actor_throughput(handle, prompts: list[list[int]], tokens: int, runs: int = 2) -> dict:
    """Where a fleet's generation time goes, measured inside its shard actor on its own engine
    (no Ray call, no router): ``step_loop`` is nemo_gen's batch loop (``SyncEngine._generate_sync``:
    final outputs, versions from the engine core's labels, results as dicts); ``step_loop_per_step``
    the same with every step's outputs (what a stream gets); ``llm_generate`` is
    vLLM's own ``LLM.generate`` on the same engine (final outputs only), the same sampling as the
    bare run. Best of ``runs`` each. Benchmark use only: it blocks the actor while it runs.
    Beside them, ``actor_call``: the shard actor's own ``generate`` called straight from the
    driver (no router), its wall there and the seconds the actor reports."""
    import ray

    from nemo_gen.core.results import GenerationRequest
    from nemo_gen.core.wire import Sampling

    resolved = Sampling(max_new_tokens=tokens, temperature=0.0, top_p=1.0, ignore_eos=True)
    requests = [GenerationRequest(index=i, prompt_token_ids=p) for i, p in enumerate(prompts)]

    def fn(actor, prompts, requests, resolved, runs):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from nemo_gen.shard.engine import sampling_params

        engine = actor.shard.engine
        vllm_params = SamplingParams(temperature=0.0, max_tokens=resolved.max_new_tokens, ignore_eos=True, logprobs=0)

        def step_loop(per_step=None):
            results = engine._generate_sync(requests, sampling_params(resolved), per_step)
            return sum(len(r.samples[0].token_ids) for r in results)

        def llm_generate():
            outs = engine._llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], vllm_params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        # step_loop_per_step: the same loop with a per-step callback, as a stream runs (every
        # step's outputs to the loop); step_loop: a batch's final outputs only.
        arms = (("step_loop", step_loop), ("step_loop_per_step", lambda: step_loop(lambda tracks: None)),
                ("llm_generate", llm_generate))
        best: dict = {}
        # These arms drive the engine from this thread, outside the actor's one-batch lock: the
        # fleet's probes must not start a batch of their own meanwhile (a probe's batch resets
        # the step loop's tracks: "vLLM returned no output", 2026-12-01 fifth sitting). A
        # control call in progress is what makes a probe answer "skipped".
        engine._rpc_active += 1
        while engine._lock.locked():  # a probe's batch that started before: let it end
            time.sleep(0.01)
        try:
            for _ in range(runs):  # interleaved, so that a noisy moment does not fall on one arm only
                for name, run in arms:
                    t = time.perf_counter()
                    n = run()
                    took = time.perf_counter() - t
                    best[name] = min(best.get(name, (took, n)), (took, n))
        finally:
            engine._rpc_active -= 1
        return {name: {"seconds": sec, "tokens": n, "tokens_per_s": n / sec} for name, (sec, n) in best.items()}

    res = ray.get(handle.actor.__ray_call__.remote(fn, prompts, requests, resolved, runs), timeout=600)
    calls = []
    for _ in range(runs):
        t = time.perf_counter()
        answer = ray.get(handle.actor.call.remote("generate", requests, resolved), timeout=600)
        calls.append({"driver_wall_s": time.perf_counter() - t, "actor_s": answer.seconds})
    res["actor_call"] = min(calls, key=lambda c: c["driver_wall_s"])
    return res


def interleaved_throughput(fleet_run, bare_run, rounds: int, deadline_s: float) -> dict:
    """``rounds`` x (one fleet run, one bare run), the order swapped every round, while both engines
    are up on the GPU. Each ``*_run`` returns ``{"seconds", "tokens", "front_end"}`` (the bare one
    asks the process ``gpu_bare_vllm.py ... serve`` for a run; ``front_end``: where its engine's
    own process spent the run, ``front_end.FrontEndClock``). Stops early at the deadline. The
    ratio is of the medians (the same batch on both: tokens are equal); ``paired_fleet_over_bare``
    is the median of each round's own ratio, which a host that slows down over the rounds (seen on
    the lent H200: both arms 40 % slower by the last round) does not tilt."""
    import statistics

    from bench.front_end import medians

    runs: dict[str, list[dict]] = {"fleet": [], "bare": []}
    for i in range(rounds):
        if elapsed() > deadline_s:
            break
        for arm in (("fleet", "bare") if i % 2 == 0 else ("bare", "fleet")):
            runs[arm].append(bare_run() if arm == "bare" else fleet_run())
    out: dict = {"seconds": {arm: [r["seconds"] for r in v] for arm, v in runs.items()}}
    if runs["fleet"] and runs["bare"]:
        med = {arm: statistics.median(r["seconds"] for r in v) for arm, v in runs.items()}
        out.update(median_s=med, throughput_fleet_over_bare=med["bare"] / med["fleet"],
                   best_fleet_over_bare=min(out["seconds"]["bare"]) / min(out["seconds"]["fleet"]),
                   paired_fleet_over_bare=paired_ratio(out["seconds"]["fleet"], out["seconds"]["bare"]),
                   front_end={arm: medians([r["front_end"] for r in v if r.get("front_end")]) for arm, v in runs.items()})
    return out


def paired_ratio(fleet_s: list[float], bare_s: list[float]) -> float | None:
    """Median over rounds of bare / fleet seconds (throughput of the fleet over the bare engine),
    each round's two runs taken back to back."""
    import statistics

    pairs = [b / f for f, b in zip(fleet_s, bare_s) if f > 0]
    return statistics.median(pairs) if pairs else None


def call_worker(handle, method: str, *args):
    """A worker-extension method on a running shard's engine (sync engine: through the actor's
    ``__ray_call__``; benchmark use only)."""
    import ray

    def fn(actor, method, args):
        return actor.shard.engine._llm.collective_rpc(method, args=args)

    return ray.get(handle.actor.__ray_call__.remote(fn, method, args), timeout=120)


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", required=True, help="the file this process's stderr goes to")
    ap.add_argument("--layers", type=int, default=11)
    ap.add_argument("--util", type=float, default=0.35)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--deadline-s", type=float, default=540)
    ap.add_argument("--work", default="/tmp/nemo-gen-bench")
    ap.add_argument("--refit-rounds", type=int, default=6)
    ap.add_argument("--interleave", type=int, default=5,
                    help="rounds of (fleet run, bare run) with both engines up, after the bare engine's launch")
    ap.add_argument("--bare-config", choices=("plain", "fleet"), default="plain",
                    help="the bare engine's arguments: plain vLLM's (the model, bf16, the same memory share, "
                    "logprobs mode), or the fleet shard's own (nemo_gen's worker extension and weight transfer too)")
    ap.add_argument("--skip", default="", help="steps not to run, comma-separated (e.g. restart_after_sigkill)")
    args = ap.parse_args(argv)
    ARGS.update(vars(args))
    SKIP.update(s for s in args.skip.split(",") if s)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    quiet_environment(vllm_log="INFO")  # the engines' INFO lines carry the launch breakdown

    import torch

    from nemo_gen.tiny_model import make_tiny_model

    RESULT["stack"] = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
                       "python": sys.version.split()[0]}
    RESULT["command"] = " ".join(sys.argv)
    tiny = make_tiny_model(work / "tiny")
    model_dir = work / f"llama-{args.layers}l"
    state: dict = {}

    @step("model", out, args.deadline_s, 60)
    def _():
        state["policy"] = make_model(model_dir, args.layers, tiny)
        nbytes = sum(p.numel() * p.element_size() for p in state["policy"].parameters())
        state["nbytes"] = nbytes
        return {"bytes": nbytes, "params": sum(p.numel() for p in state["policy"].parameters()), "dir": str(model_dir)}

    if "policy" not in state:
        return

    @step("copy_bandwidth", out, args.deadline_s, 10)
    def _():
        state["copy_gbps"] = copy_bandwidth(state["nbytes"])
        return {"gbps": state["copy_gbps"], "bytes": state["nbytes"]}

    import vllm

    from nemo_gen import GenerationFleet
    from nemo_gen.settings import NemoGenSettings

    RESULT["stack"]["vllm"] = vllm.__version__
    import ray

    RESULT["stack"]["ray"] = ray.__version__
    overrides = {
        "home": str(work / "home"), "model.path": str(model_dir), "fleet.name": "gpu-bench", "fleet.device": "gpu",
        "fleet.num_shards": 1, "fleet.engine_start_timeout_s": 500, "generation.vllm_cfg.precision": "bfloat16",
        "generation.vllm_cfg.enforce_eager": False, "generation.vllm_cfg.max_model_len": 512,
        "generation.vllm_cfg.gpu_memory_utilization": args.util, "generation.vllm_cfg.env_vars": cache_env("fleet"),
        "refit.backend": "nemo_gen_ipc", "health.probe_interval_s": 2.0, "health.probe_timeout_s": 30.0,
        "health.restart_backoff_s": 0.1, "health.restart_jitter": 0.0, "health.reap_timeout_s": 20.0,
        "ray.namespace": "nemo_gen_gpu_bench",
    }
    settings = NemoGenSettings.load(overrides=overrides)
    log_path = Path(args.log)

    @step("warm_imports", out, args.deadline_s, 60)
    def _():
        """vLLM, torch and Ray read once into the page cache before either launch: on a fresh host
        the first engine to start read them cold and the second warm (the fleet launched first:
        106 s of engine start against the bare engine's 88 s, 2026-12-02), which is the file
        cache's doing, not a launch's. Compile caches stay cold for both (cache_env)."""
        t = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch, vllm, ray, vllm.v1.engine.core"], check=True,
                       capture_output=True, timeout=300)
        return {"import_s": time.monotonic() - t}

    @step("fleet_launch", out, args.deadline_s, 240)
    def _():
        mark = log_path.stat().st_size if log_path.exists() else 0
        t = time.monotonic()
        state["fleet"] = GenerationFleet.launch(settings)
        launch_s = time.monotonic() - t
        time.sleep(2)  # the engines' last log lines reach the driver
        text = log_path.read_text(errors="replace")[mark:] if log_path.exists() else ""
        info = state["fleet"].shards[0].info
        state["launch_s"] = launch_s
        return {"launch_s": launch_s, "engine_start_s": info.load_s,
                "ray_and_actor_s": launch_s - (info.load_s or 0.0),
                "engine_core_start": info.engine_core_start, **breakdown(text)}

    fleet = state.get("fleet")
    if fleet is None:
        return
    tok_prompts = token_prompts(args.prompts)
    probe = tok_prompts[:4]

    def greedy(of=fleet):
        # One prompt per request, one request at a time (as tests/gpu compares): a batch of four
        # is not one fixed shape. The EngineCore schedules as requests arrive, so how many of them
        # share the first prefill depends on timing, and on a random model whose top logits nearly
        # tie, another batch shape's bf16 rounding can flip a greedy token. Its second sitting of
        # 2026-12-02, engines now at nice 0, gave other tokens with the same weights.
        return [of.generate([p], temperature=0, max_new_tokens=16, ignore_eos=True)[0].token_ids for p in probe]

    def negate(module):  # other weights of the same layout: -w for every tensor; twice is the identity
        with torch.no_grad():
            for p in module.parameters():
                p.mul_(-1.0)

    @step("refit", out, args.deadline_s, 60)
    def _():
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from nemo_gen.vllm_ext.vllm_backend import CudaIpcTrainerInitInfo, vllm_steps_only

        policy, handle = state["policy"], fleet.shards[0]
        before = greedy()
        before_again = greedy()  # is greedy even repeatable here (batch shapes, a probe's request beside it)?
        client = fleet.weight_sync_client()
        engine = WeightTransferTrainerFactory.trainer_init(CudaIpcTrainerInitInfo(), client=client,
                                                           source=ModuleSource(policy))
        res: dict = {"bytes": state["nbytes"], "copy_gbps": state["copy_gbps"]}
        try:
            # "auto": the direct path and the one-call update (what a trainer gets), over the shard's
            # direct line (refit.control_channel); "auto_over_ray": the same over a Ray actor call;
            # "three_steps": the same load driven as vLLM's start / update / finish; "reload_weights":
            # vLLM's layerwise reload on the running engine
            for path, steps_of in (("auto", False), ("auto_over_ray", False), ("three_steps", True),
                                   ("reload_weights", False)):
                load_path = "auto" if path in ("three_steps", "auto_over_ray") else path
                res[f"path_{path}"] = call_worker(handle, "nemo_gen_set_load_path", load_path)[0]
                engine.client = vllm_steps_only(client) if steps_of else client
                fleet.driver.channels = path != "auto_over_ray"
                rounds = []
                for i in range(args.refit_rounds):
                    steps = timed_steps(client)
                    client.timings.clear()
                    t = t_send = time.perf_counter()
                    engine.send_weights()
                    wall = time.perf_counter() - t
                    steps.undo()
                    t = time.perf_counter()  # the sender's own share: the same call send_weights made first
                    engine.sender.update_info(iter(engine.source))
                    sender_s = time.perf_counter() - t
                    t = time.perf_counter()  # ... of which: the source's iteration, the stream sync
                    list(iter(engine.source))
                    source_s = time.perf_counter() - t
                    t = time.perf_counter()
                    torch.cuda.synchronize()
                    sync_s = time.perf_counter() - t
                    stats = ray.get(handle.actor.call.remote("load_stats"), timeout=60)[0]
                    shard = next(iter(client.timings.values()), None)
                    legs = {}
                    if shard and "entered_at" in shard and "apply_weight_update" in steps.started:
                        # the Ray call's two legs (one host, one monotonic clock): the client's
                        # checks + the call reaching the actor, and the answer's way back + the
                        # client's bookkeeping (version flip included)
                        legs = {"to_actor_s": shard["entered_at"] - steps.started["apply_weight_update"],
                                "back_s": steps.ended["apply_weight_update"] - shard["left_at"],
                                "sender_before_apply_s": steps.started["apply_weight_update"] - t_send}
                    rounds.append({**legs, "wall_s": wall, "report_s": client.report.load_seconds, "engine_load_s": stats.seconds,
                                   "loaders_s": stats.load_s, "transfer_s": stats.transfer_s,
                                   "prepare_s": stats.prepare_s, "plan": stats.plan, "steps_s": steps.seconds,
                                   "path": stats.path, "ok": client.report.ok, "sender_s": sender_s,
                                   "sender_source_s": source_s, "sender_sync_s": sync_s,
                                   # one-call only: seconds in the shard actor / its RPC into the engine / the worker
                                   "shard_s": next(iter(client.timings.values()), None)})
                res[path] = summarize_rounds(rounds, state["nbytes"], state["copy_gbps"])
            fleet.driver.channels = True
            res["direct_calls"] = ray.get(handle.actor.info.remote(), timeout=60).direct_calls
            if res["auto"].get("wall_s") and res["auto_over_ray"].get("wall_s"):
                res["ray_over_direct_line"] = res["auto_over_ray"]["wall_s"] / res["auto"]["wall_s"]
            engine.client = client
            call_worker(handle, "nemo_gen_set_load_path", None)

            def digests():  # (the engine's, the trainer's): float64 sums of every parameter
                with torch.no_grad():
                    mine = float(sum(p.detach().double().sum().item() for p in policy.parameters()))
                return call_worker(handle, "nemo_gen_digest")[0], mine

            # the engine holds what it was sent (digests) and serves it (tokens): other weights,
            # loaded by a fresh recording, then the first ones again, by a replay
            negate(policy)
            engine.send_weights()
            flipped, flipped_digests = greedy(), digests()
            negate(policy)
            engine.send_weights()
            back, back_digests = greedy(), digests()
            res["digests_negated"], res["digests_restored"] = flipped_digests, back_digests
            res["engine_holds_what_was_sent"] = all(abs(a - b) <= 1e-6 * max(1.0, abs(b))
                                                    for a, b in (flipped_digests, back_digests))
            res["tokens_change_with_other_weights"] = flipped != before
            res["tokens_follow_the_weights"] = bool(flipped != before and back == before)
        finally:
            fleet.driver.channels = True
            engine.shutdown()
        t = time.perf_counter()
        report = fleet.refit(str(model_dir))
        res["checkpoint"] = {"ok": report.ok, "wall_s": time.perf_counter() - t, "stage_s": report.stage_seconds,
                             "load_s": report.load_seconds, "bytes": report.bytes}
        res["checkpoint"]["gbps"] = report.bytes / res["checkpoint"]["wall_s"] / 1e9
        after_checkpoint = greedy()
        res["tokens_after_checkpoint_refit_equal"] = after_checkpoint == before
        res["greedy_repeatable"] = before_again == before
        res["tokens"] = {"before": before, "before_again": before_again, "negated": flipped, "back": back,
                         "after_checkpoint": after_checkpoint}
        return res

    def throughput(runs=2, warm=True):
        if warm:
            fleet.generate(tok_prompts[:8], temperature=0, max_new_tokens=args.tokens, ignore_eos=True)
        best = None
        for _ in range(runs):
            t = time.perf_counter()
            results = fleet.generate(tok_prompts, temperature=0, max_new_tokens=args.tokens, ignore_eos=True)
            s = time.perf_counter() - t
            n = sum(len(r.token_ids) for r in results)
            if best is None or s < best[0]:
                best = (s, n)
        return {"seconds": best[0], "tokens": best[1], "tokens_per_s": best[1] / best[0]}

    @step("fleet_throughput", out, args.deadline_s, 40)
    def _():
        state["fleet_tps"] = throughput()
        return state["fleet_tps"]

    @step("throughput_breakdown", out, args.deadline_s, 40)
    def _():
        res = in_actor_throughput(fleet.shards[0], tok_prompts, args.tokens)
        if state.get("fleet_tps"):
            fleet_s = state["fleet_tps"]["seconds"]
            res["fleet_generate_s"] = fleet_s
            res["ray_and_router_s"] = fleet_s - res["step_loop"]["seconds"]
            res["step_loop_over_llm_generate_s"] = res["step_loop"]["seconds"] - res["llm_generate"]["seconds"]
        return res

    @step("bare_vllm", out, args.deadline_s, 240)
    def _():
        from bench.front_end import actor_clock

        prompts_file = work / "prompts.json"
        prompts_file.write_text(json.dumps(tok_prompts))
        res_file, bare_log = work / "bare.json", out / "bare_vllm.log"
        env = dict(os.environ, **cache_env("bare"))
        if args.bare_config == "fleet":  # the fleet shard's own engine arguments, outside Ray and nemo_gen
            kwargs_file = work / "fleet_engine_kwargs.json"
            kwargs_file.write_text(json.dumps(fleet.resolved.shards[0].engine_kwargs))
            env["BARE_ENGINE_KWARGS"] = str(kwargs_file)
        t = time.monotonic()
        # The bare engine stays up after its own runs ("serve"): the fleet's and its runs are then
        # interleaved below, in the same minutes of the same GPU (runs minutes apart differed by
        # 14% on one engine, 2026-12-02).
        proc = subprocess.Popen([sys.executable, "-m", "bench.gpu_bare_vllm", str(res_file),
                                 str(model_dir), str(args.util), "512", str(prompts_file), str(args.tokens),
                                 settings.generation.vllm_cfg.logprobs_mode, "serve"],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        # A bare engine that hangs is killed at the deadline (answer() then sees its output end).
        watchdog = threading.Timer(max(60.0, args.deadline_s - elapsed()), proc.kill)
        watchdog.start()
        with open(bare_log, "w") as logf:
            def answer(prefix: str) -> str:  # the bare process's next line with this prefix (its log kept)
                for line in proc.stdout:
                    logf.write(line)
                    if line.startswith(prefix):
                        return line[len(prefix):]
                raise RuntimeError(f"bare vLLM exited {proc.wait()}: {bare_log.read_text()[-2000:]}")

            def ask(line: str) -> dict:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
                return json.loads(answer("BARE "))

            def fleet_run() -> dict:  # the engine is warm (fleet_throughput): the clock sees this batch only
                actor_clock(fleet.shards[0], reset=True)
                res = throughput(runs=1, warm=False)
                return {**res, "front_end": actor_clock(fleet.shards[0], reset=False)}

            try:
                answer("BARE READY")
                wall = time.monotonic() - t
                bare = json.loads(res_file.read_text())
                # First the bare engine as vLLM leaves it, then with its heap frozen as the shard
                # actor's is once its engine is up: what is left is the process, not the GC.
                rounds = interleaved_throughput(fleet_run, lambda: ask("run"), args.interleave, args.deadline_s - 60)
                ask("freeze")
                rounds_frozen = interleaved_throughput(fleet_run, lambda: ask("run"), args.interleave,
                                                       args.deadline_s - 30)
            finally:
                if proc.poll() is None:  # closing its stdin shuts the bare engine down
                    rest, _ = proc.communicate(timeout=120)
                    logf.write(rest or "")
                watchdog.cancel()
        bare.update(breakdown(bare_log.read_text(errors="replace")), process_wall_s=wall)
        launch = RESULT["steps"].get("fleet_launch", {})
        ratios = {}
        if launch.get("launch_s"):
            ratios["launch_over_bare"] = launch["launch_s"] / bare["total_s"]
        if state.get("fleet_tps"):
            ratios["throughput_fleet_over_bare"] = state["fleet_tps"]["tokens_per_s"] / bare["tokens_per_s"]
        return {"bare": bare, "interleaved": rounds, "interleaved_bare_frozen": rounds_frozen, **ratios}

    @step("restart_after_sigkill", out, args.deadline_s, 200)
    def _():
        from nemo_gen.host import gpu_memory

        victim = fleet.status()[0]
        dead = [victim.actor_pid, *victim.engine_pids]
        held = sum(gpu_memory.used_by_pids(dead).values())
        name = fleet.handle(0).name
        t = time.monotonic()
        os.kill(victim.actor_pid, signal.SIGKILL)
        freed = gpu_memory.wait_released(dead, timeout_s=60, poll_s=0.01)
        while not (fleet.handle(0).name != name and fleet.health.state_of(0).value == "healthy"):
            if elapsed() > args.deadline_s + 20:
                raise TimeoutError(f"no replacement serving {time.monotonic() - t:.0f}s after the kill")
            time.sleep(0.05)
        back_s = time.monotonic() - t
        res = {"held_gib": held / 2**30, "gpu_memory_back_s": freed.seconds, "released": freed.released,
               "to_full_strength_s": back_s, "replacement_engine_start_s": fleet.shards[0].info.load_s,
               "serves_fleet_version": fleet.status()[0].weight_version == fleet.weight_version}
        if state.get("launch_s"):
            res["restart_over_launch"] = back_s / state["launch_s"]
        res["tokens_after_restart_ok"] = len(fleet.generate(probe, temperature=0, max_new_tokens=4)) == len(probe)
        return res

    fleet.shutdown()

    @step("vllm_ipc_refit", out, args.deadline_s, 150)
    def _():
        """vLLM's own ``ipc`` backend through the same client, on a fleet started with it (the
        compile cache of the first launch is warm): unpacked (a handle per tensor per refit) and
        packed (a reused buffer, chunked)."""
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        ipc_settings = NemoGenSettings.load(overrides={**overrides, "refit.backend": "ipc", "fleet.name": "gpu-bench-ipc"})
        t = time.monotonic()
        ipc_fleet = GenerationFleet.launch(ipc_settings)
        res = {"launch_s": time.monotonic() - t}
        try:
            # Does vLLM's layerwise reload, fed by its ipc trainer, put the weights where the CUDA
            # graphs read them? Its engine starts from the checkpoint = the policy: the main fleet's
            # tokens; negated weights must change them, the first ones bring them back.
            policy = state["policy"]
            first = greedy(ipc_fleet)
            res["tokens_at_launch_equal_the_main_fleets"] = first == RESULT["steps"].get("refit", {}).get(
                "tokens", {}).get("before")
            client = ipc_fleet.weight_sync_client()
            engine = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(packed=False, rank=0), client=client,
                                                               source=ModuleSource(policy))
            try:
                tokens = {}
                for what in ("negated", "back"):
                    negate(policy)
                    engine.send_weights()
                    tokens[what] = (client.report.ok, greedy(ipc_fleet))
            finally:
                engine.shutdown()
            res["tokens"] = {"launch": first, **{k: v[1] for k, v in tokens.items()}}
            res["tokens_follow_the_weights"] = bool(all(ok for ok, _ in tokens.values())
                                                    and tokens["negated"][1] != first and tokens["back"][1] == first)
            for packed in (False, True):
                client = ipc_fleet.weight_sync_client()
                engine = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(packed=packed, rank=0), client=client,
                                                                   source=ModuleSource(state["policy"]))
                try:
                    rounds = []
                    for _ in range(4):
                        t = time.perf_counter()
                        engine.send_weights()
                        rounds.append({"wall_s": time.perf_counter() - t, "ok": client.report.ok})
                finally:
                    engine.shutdown()
                res["packed" if packed else "unpacked"] = summarize_rounds(rounds, state["nbytes"], state["copy_gbps"])
        finally:
            ipc_fleet.shutdown()
        ours = RESULT["steps"].get("refit", {}).get("auto", {}).get("wall_s")
        if ours:
            res["ours_speedup_over_unpacked"] = res["unpacked"]["wall_s"] / ours
            res["ours_speedup_over_packed"] = res["packed"]["wall_s"] / ours
        return res

    RESULT["total_s"] = elapsed()
    save(out)
    write_markdown(out)
    return RESULT


def write_markdown(out: Path) -> None:
    s = RESULT["steps"]
    rows = []

    def get(step, *keys):
        v = s.get(step, {})
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    def fmt(v, spec=".3g"):
        return "-" if v is None else (format(v, spec) if isinstance(v, (int, float)) else str(v))

    rows.append(("model", f"{fmt(get('model', 'bytes') and get('model', 'bytes') / 1e9)} GB bf16 random Llama"))
    rows.append(("device copy bandwidth", f"{fmt(get('copy_bandwidth', 'gbps'))} GB/s"))
    rows.append(("refit nemo_gen_ipc, auto: over Ray / over the direct line (refit.control_channel)",
                 f"{fmt(get('refit', 'ray_over_direct_line'))}x ({fmt(get('refit', 'direct_calls'))} calls came "
                 "over the line)"))
    for path in ("auto", "auto_over_ray", "three_steps", "reload_weights"):
        rows.append((f"refit nemo_gen_ipc, {path} ({get('refit', f'path_{path}')}): end to end",
                     f"{fmt(get('refit', path, 'wall_s'))} s = {fmt(get('refit', path, 'fraction_of_copy'))} of copy "
                     f"(first, opening handles: {fmt(get('refit', path, 'first_wall_s'))} s)"))
        rows.append((f"refit nemo_gen_ipc, {path}: start..finish inside the engine / loaders only",
                     f"{fmt(get('refit', path, 'engine_fraction_of_copy'))} / "
                     f"{fmt(get('refit', path, 'loaders_fraction_of_copy'))} of copy "
                     f"(loaders {fmt(get('refit', path, 'steady', 'loaders_s'))} s, plan {get('refit', path, 'steady', 'plan')})"))
        rows.append((f"refit nemo_gen_ipc, {path}: the transport (the engine's update_weights: arrival to bytes in place)",
                     f"{fmt(get('refit', path, 'steady', 'transfer_s'))} s = "
                     f"{fmt(get('refit', path, 'transport_fraction_of_copy'))} of copy; "
                     f"module classification {fmt(get('refit', path, 'steady', 'prepare_s'))} s"))
        shard = get('refit', path, 'steady', 'shard_s') or {}
        if shard:
            rows.append((f"refit nemo_gen_ipc, {path}: in the shard actor / its RPC into the engine / the worker",
                         " / ".join(fmt(shard.get(k)) for k in ("actor_s", "engine_rpc_s", "worker_s")) + " s"))
        if get('refit', path, 'steady', 'to_actor_s') is not None:
            rows.append((f"refit nemo_gen_ipc, {path}: sender before the call / the call reaching the actor / its answer back",
                         " / ".join(fmt(get('refit', path, 'steady', k)) for k in
                                    ("sender_before_apply_s", "to_actor_s", "back_s")) + " s"))
        steps = get('refit', path, 'steady', 'steps_s') or {}
        rows.append((f"refit nemo_gen_ipc, {path}: client steps apply / start / update / finish",
                     " / ".join(fmt(steps.get(k)) for k in ("apply_weight_update", "start_weight_update", "update_weights",
                                                            "finish_weight_update")) + " s"))
    for packed in ("unpacked", "packed"):
        rows.append((f"refit vLLM ipc ({packed}) through the fleet: end to end",
                     f"{fmt(get('vllm_ipc_refit', packed, 'wall_s'))} s = {fmt(get('vllm_ipc_refit', packed, 'fraction_of_copy'))} of copy; "
                     f"nemo_gen_ipc is {fmt(get('vllm_ipc_refit', f'ours_speedup_over_{packed}'))}x faster"))
    rows.append(("vLLM ipc: tokens follow the refit weights (negated, then back) / at launch = the main fleet's",
                 f"{fmt(get('vllm_ipc_refit', 'tokens_follow_the_weights'))} / "
                 f"{fmt(get('vllm_ipc_refit', 'tokens_at_launch_equal_the_main_fleets'))}"))
    rows.append(("refit from checkpoint (disk -> shm -> GPU)",
                 f"{fmt(get('refit', 'checkpoint', 'wall_s'))} s, {fmt(get('refit', 'checkpoint', 'gbps'))} GB/s"))
    rows.append(("tokens follow the refit weights (CUDA graphs)", fmt(get('refit', 'tokens_follow_the_weights'))))
    rows.append(("engine digest = trainer digest after a recorded and a replayed refit",
                 fmt(get('refit', 'engine_holds_what_was_sent'))))
    rows.append(("fleet launch / bare vllm.LLM", f"{fmt(get('fleet_launch', 'launch_s'))} s / "
                 f"{fmt(get('bare_vllm', 'bare', 'total_s'))} s = {fmt(get('bare_vllm', 'launch_over_bare'))}"))
    for key in ("engine_start_s", "ray_and_actor_s", *PATTERNS):
        rows.append((f"  fleet {key}", f"{fmt(get('fleet_launch', key))}  (bare: {fmt(get('bare_vllm', 'bare', key))})"))
    rows.append(("  bare import vllm / LLM()", f"{fmt(get('bare_vllm', 'bare', 'import_s'))} s / {fmt(get('bare_vllm', 'bare', 'llm_s'))} s"))
    rows.append(("throughput fleet / bare", f"{fmt(get('fleet_throughput', 'tokens_per_s'))} / "
                 f"{fmt(get('bare_vllm', 'bare', 'tokens_per_s'))} tok/s = {fmt(get('bare_vllm', 'throughput_fleet_over_bare'))}"))
    rows.append(("throughput fleet / bare, interleaved (of medians / best / median of each round's; both engines up)",
                 f"{fmt(get('bare_vllm', 'interleaved', 'throughput_fleet_over_bare'))} / "
                 f"{fmt(get('bare_vllm', 'interleaved', 'best_fleet_over_bare'))} / "
                 f"{fmt(get('bare_vllm', 'interleaved', 'paired_fleet_over_bare'))} "
                 f"(fleet {fmt(get('bare_vllm', 'interleaved', 'median_s', 'fleet'))} s, "
                 f"bare {fmt(get('bare_vllm', 'interleaved', 'median_s', 'bare'))} s)"))
    for key, what in (("interleaved", "as vLLM leaves it"), ("interleaved_bare_frozen", "its heap frozen too")):
        fe = get('bare_vllm', key, 'front_end') or {}
        rows.append((f"  engine process of each (bare {what}), medians: front end / waiting for the EngineCore / GC (full collections)",
                     "; ".join(f"{arm} {fmt(m.get('proc_s'))} / {fmt(m.get('wait_s'))} / {fmt(m.get('gc_s'))} s "
                               f"({fmt(m.get('gc_full'))})" for arm, m in fe.items()) or "-"))
    rows.append(("throughput fleet / bare, interleaved, the bare engine's heap frozen too (of medians / best / "
                 "median of each round's)",
                 f"{fmt(get('bare_vllm', 'interleaved_bare_frozen', 'throughput_fleet_over_bare'))} / "
                 f"{fmt(get('bare_vllm', 'interleaved_bare_frozen', 'best_fleet_over_bare'))} / "
                 f"{fmt(get('bare_vllm', 'interleaved_bare_frozen', 'paired_fleet_over_bare'))} "
                 f"(fleet {fmt(get('bare_vllm', 'interleaved_bare_frozen', 'median_s', 'fleet'))} s, "
                 f"bare {fmt(get('bare_vllm', 'interleaved_bare_frozen', 'median_s', 'bare'))} s)"))
    rows.append(("  the same batch in the shard actor: nemo_gen's step loop (final outputs / every step's) / vLLM's LLM.generate",
                 f"{fmt(get('throughput_breakdown', 'step_loop', 'seconds'))} s / "
                 f"{fmt(get('throughput_breakdown', 'step_loop_per_step', 'seconds'))} s / "
                 f"{fmt(get('throughput_breakdown', 'llm_generate', 'seconds'))} s "
                 f"(fleet.generate {fmt(get('throughput_breakdown', 'fleet_generate_s'))} s)"))
    rows.append(("SIGKILL -> GPU memory back", f"{fmt(get('restart_after_sigkill', 'gpu_memory_back_s'))} s "
                 f"({fmt(get('restart_after_sigkill', 'held_gib'))} GiB)"))
    rows.append(("SIGKILL -> full strength, no spare", f"{fmt(get('restart_after_sigkill', 'to_full_strength_s'))} s = "
                 f"{fmt(get('restart_after_sigkill', 'restart_over_launch'))} of a launch"))
    lines = ["| measure | value |", "|---|---|", *[f"| {a} | {b} |" for a, b in rows]]
    failed = {k: v.get("error") or v.get("skipped") for k, v in s.items() if not v.get("ok")}
    if failed:
        lines += ["", "Not measured: " + "; ".join(f"{k}: {v}" for k, v in failed.items())]
    (out / "gpu_bench.md").write_text("\n".join(lines) + "\n")
