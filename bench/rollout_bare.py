"""A bare ``vllm.LLM`` (no Ray, no nemo_gen) at vLLM's best settings for a rollout: the baseline
``bench/rollout.py`` compares a fleet's batches with. Run by it as a subprocess::

    python -m bench.rollout_bare SPEC.json

SPEC (written by bench/rollout.py): the model, device, precision, memory share, ``max_num_seqs``
(also the CUDA-graph capture size), the batches, rounds, tokens, the profile batch and where the
result goes. The engine: async scheduling on, ``max_num_seqs`` and the graph capture size cover
the largest batch, vLLM's stats on (its step counters); each request ``detokenize=False`` with the
logprob of the sampled token (what RL reads), temperature 1, EOS ignored. The batches run through
``bench.rollout.measure``, as the fleet's do; the result is written after every batch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    gpu = spec["device"] == "gpu"
    from bench.lib.setup import quiet_environment, token_prompts

    quiet_environment()
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from bench.rollout import measure, say
    from nemo_gen.shard import vllm_compat

    kwargs = {"model": spec["model"], "max_model_len": spec["max_model_len"], "max_num_seqs": spec["max_num_seqs"],
              "seed": 0, "disable_log_stats": False, "async_scheduling": True}
    if gpu:
        kwargs.update(gpu_memory_utilization=spec["util"], dtype="bfloat16",
                      max_cudagraph_capture_size=spec["max_num_seqs"])
        if spec["precision"] == "fp8":
            kwargs["quantization"] = "fp8_per_tensor"  # as nemo_gen's precision: fp8
    else:
        kwargs.update(dtype="float32", enforce_eager=True)
        kwargs.pop("async_scheduling")  # vLLM's CPU executor decides for itself
    llm = LLM(**kwargs)
    launch_s = time.monotonic() - t0
    say(f"bare LLM up in {launch_s:.0f} s")
    prompts = [TokensPrompt(prompt_token_ids=p) for p in token_prompts(max(spec["batches"] + [spec["profile_batch"]]),
                                                                        spec["prompt_tokens"])]
    sampling = SamplingParams(temperature=1.0, max_tokens=spec["tokens"], ignore_eos=True, logprobs=0, detokenize=False)

    def run(batch: int) -> tuple[float, int, int]:
        t = time.perf_counter()
        outs = llm.generate(prompts[:batch], sampling, use_tqdm=False)
        s = time.perf_counter() - t
        return (s, sum(len(o.outputs[0].token_ids) for o in outs),
                sum(len(o.outputs[0].logprobs or ()) for o in outs))

    from bench.lora_fp8_gpu import engine_counters

    engine = SimpleNamespace(vllm_metrics=lambda: {0: vllm_compat.metrics(llm.llm_engine)})
    config = llm.llm_engine.vllm_config
    doc: dict = {"launch_s": launch_s, "engine_args": kwargs,
                 "async_scheduling": config.scheduler_config.async_scheduling,
                 "max_num_seqs": config.scheduler_config.max_num_seqs,
                 "cudagraph_capture_sizes": config.compilation_config.cudagraph_capture_sizes}

    def write(rows: dict) -> None:
        out.write_text(json.dumps({**doc, "batches": rows}, default=str))

    args = SimpleNamespace(batches=spec["batches"], rounds=spec["rounds"], profile_batch=spec["profile_batch"],
                           profile_s=spec["profile_s"], profile_delay_s=spec["profile_delay_s"])
    doc.update(measure(run, lambda: engine_counters(engine), args, gpu, Path(spec["profile_dir"]), write))
    out.write_text(json.dumps(doc, default=str))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
