"""A bare vLLM CUDA engine (no Ray, no fleet): the reference for what a set of weights generates.

Run as a script by ``tests/gpu/test_fleet_gpu.py`` (a vLLM engine needs a ``__main__`` guard and
a process of its own)::

    python tests/gpu/reference_engine.py OUT.json MODEL_B MODEL_A PROMPTS_JSON MAX_TOKENS UTIL

It starts one engine on MODEL_B (bf16, eager, its own share of the GPU, started under the GPU
start lock the fleet's engines take) and records, prompt by prompt (batch 1, so no batch shape
can change the numerics):

- ``fresh_b``: greedy tokens of an engine that loaded MODEL_B at start;
- then refits this same engine in place through nemo_gen's worker extension, staged from the
  checkpoints, on both load paths: ``a_direct`` (MODEL_A, direct load), ``b_reload`` (MODEL_B,
  vLLM's layerwise reload), ``b_direct_after_reload`` (direct again, after the reload's
  wrappers), ``a_reload``; and ``path``, what the worker says a refit takes here.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the load path can be
switched between refits.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # the start lock is per visible GPU
    out_path, model_b, model_a, prompts_json, max_tokens, util = sys.argv[1:7]
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import nemo_gen.vllm_ext.worker_ext as ext
    from nemo_gen.core.engine_args import WORKER_EXTENSION
    from nemo_gen.core.manifest import TensorMeta, layout
    from nemo_gen.host.gpu_memory import engine_start_lock
    from nemo_gen.vllm_ext.staging import SharedMemoryStaging

    prompts = json.loads(prompts_json)
    t0 = time.monotonic()
    with engine_start_lock():
        llm = LLM(model=model_b, dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
                  gpu_memory_utilization=float(util), disable_log_stats=True,
                  worker_extension_cls=WORKER_EXTENSION)  # what the fleet's engines load
    start_s = time.monotonic() - t0
    # As the fleet's shards sample (nemo_gen.shard.engine.sampling_params), EOS ignored.
    sampling = SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=int(max_tokens),
                              ignore_eos=True, logprobs=0)

    def greedy():
        return [list(llm.generate([TokensPrompt(prompt_token_ids=p)], sampling, use_tqdm=False)[0].outputs[0].token_ids)
                for p in prompts]

    worker = llm.llm_engine.model_executor.driver_worker.worker
    home = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    def stage(path, name):
        tensors = load_file(os.path.join(path, "model.safetensors"))
        metas = [TensorMeta(n, tuple(t.shape), "bfloat16" if t.is_floating_point() else str(t.dtype).removeprefix("torch."))
                 for n, t in tensors.items()]
        placed, total = layout(metas)
        staging = SharedMemoryStaging(home, f"reference-{os.getpid()}-{name}")
        staging.ensure(total)
        where = {p.name: p for p in placed}
        for n, t in tensors.items():
            staging.write(where[n], t, getattr(torch, where[n].meta.dtype))
        return staging, (str(staging.path), total, staging.entries(placed))

    direct = ext.DirectLoad.for_model

    def load(staged, path):
        ext.DirectLoad.for_model = direct if path == "direct" else classmethod(lambda cls, *a: None)
        llm.collective_rpc("nemo_gen_load_staged", args=(*staged, "policy"))
        if worker.nemo_gen_last_load != path:
            raise AssertionError(f"loaded through {worker.nemo_gen_last_load}, not {path}")
        return greedy()

    out = {"start_s": start_s, "path": llm.collective_rpc("nemo_gen_load_path")[0], "fresh_b": greedy()}
    sa, staged_a = stage(model_a, "a")
    sb, staged_b = stage(model_b, "b")
    try:
        out["a_direct"] = load(staged_a, "direct")
        out["b_reload"] = load(staged_b, "reload_weights")
        out["b_direct_after_reload"] = load(staged_b, "direct")
        out["a_reload"] = load(staged_a, "reload_weights")
    finally:
        sa.close()
        sb.close()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
