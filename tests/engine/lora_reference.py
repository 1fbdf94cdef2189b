"""A fresh vLLM engine started with LoRA, serving adapters from their PEFT directories as vLLM
itself loads them (``LoRARequest``): the reference for what a fleet's adapter refit must
generate. Run as ``python -m tests.engine.lora_reference SPEC.json OUT.json`` — its own process,
so the engine is gone when it exits. SPEC: model, max_rank, prompts (token ids), max_tokens,
adapters (name -> directory); optional: dtype (default float32), quantization (vLLM's, e.g.
``fp8_per_tensor``: what a fleet at ``precision: fp8`` runs), gpu_memory_utilization (a CUDA
engine's share), one_by_one (each prompt its own batch: the shape a GPU comparison needs, where
bf16 tokens may depend on what else is in the batch). OUT: "base" and each adapter's name ->
greedy token ids per prompt."""

from __future__ import annotations

import json
import os
import sys


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    extra = {k: spec[k] for k in ("gpu_memory_utilization", "quantization") if k in spec}
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True, max_model_len=256,
              enable_lora=True, max_lora_rank=spec["max_rank"], max_loras=1, max_cpu_loras=len(spec["adapters"]) + 1,
              **extra)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]

    def greedy(lora=None):
        batches = [[p] for p in prompts] if spec.get("one_by_one") else [prompts]
        return [list(o.outputs[0].token_ids) for batch in batches
                for o in llm.generate(batch, params, lora_request=lora, use_tqdm=False)]

    out = {"base": greedy()}
    for i, (name, path) in enumerate(sorted(spec["adapters"].items()), start=1):
        out[name] = greedy(LoRARequest(name, i, path))
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(*sys.argv[1:3])
