"""The CPU refit's direct load path (``nemo_gen.vllm_ext.direct_load.DirectLoad``) against vLLM's own
``reload_weights``, which stays the fallback for models the direct path does not handle.

One vLLM engine, in a subprocess (no Ray, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the script can
switch paths): both paths must load the same weights, token for token, and get back to the
original weights exactly. (A refit that splits a stacked layer is refused in phase 1: see
``test_refit_draft.py``, which has the drafter fleet.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nemo_gen.tiny_model import make_tiny_model

pytestmark = pytest.mark.engine

SCRIPT = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def main():
    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    import nemo_gen.vllm_ext.worker_ext as ext
    from nemo_gen.core.manifest import TensorMeta, layout
    from nemo_gen.vllm_ext.staging import SharedMemoryStaging

    a, b, home = sys.argv[1:4]
    llm = LLM(model=a, dtype="float32", enforce_eager=True, max_model_len=256,
              worker_extension_cls="nemo_gen.vllm_ext.worker_ext.NemoGenWorkerExtension")
    prompts = ["The quick brown fox", "Once upon a time", "Hello, my name is"]
    sampling = SamplingParams(temperature=0, max_tokens=12)
    greedy = lambda: [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sampling, use_tqdm=False)]
    worker = llm.llm_engine.model_executor.driver_worker.worker

    def stage(path, name):
        tensors = load_file(os.path.join(path, "model.safetensors"))
        placed, total = layout([TensorMeta(n, tuple(t.shape), "float32") for n, t in tensors.items()])
        staging = SharedMemoryStaging(home, name)
        staging.ensure(total)
        where = {p.name: p for p in placed}
        for n, t in tensors.items():
            staging.write(where[n], t, torch.float32)
        return str(staging.path), total, staging.entries(placed)

    direct = ext.DirectLoad.for_model

    def load(staged, path):
        ext.DirectLoad.for_model = direct if path == "direct" else classmethod(lambda cls, *a: None)
        llm.collective_rpc("nemo_gen_load_staged", args=(*staged, "policy"))
        assert worker.nemo_gen_last_load == path, worker.nemo_gen_last_load
        return greedy()

    staged_a, staged_b = stage(a, "a"), stage(b, "b")
    out = {"path": llm.collective_rpc("nemo_gen_load_path")[0], "a": greedy()}
    out["b_direct"] = load(staged_b, "direct")
    out["a_direct"] = load(staged_a, "direct")
    out["b_reload"] = load(staged_b, "reload_weights")
    out["b_direct_after_reload"] = load(staged_b, "direct")  # the reload left its wrappers behind
    out["a_reload"] = load(staged_a, "reload_weights")
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
"""


def test_direct_load_matches_reload_weights_and_round_trips(tiny_model_dir, tmp_path):
    other = make_tiny_model(tmp_path / "tiny-b", seed=1)
    script = tmp_path / "direct_vs_reload.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir), str(other), str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["path"] == "direct"  # the tiny Llama on CPU is one the direct path handles
    assert out["b_direct"] != out["a"]
    assert out["b_direct"] == out["b_reload"] == out["b_direct_after_reload"]
    assert out["a_direct"] == out["a_reload"] == out["a"]


def test_models_the_direct_path_does_not_handle_fall_back_to_reload_weights():
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from nemo_gen.vllm_ext.direct_load import DirectLoad

    class OtherMethod(QuantizeMethodBase):  # e.g. a quantized linear: its own packing
        def create_weights(self, *args, **kwargs):
            pass

        def apply(self, *args, **kwargs):
            pass

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4), requires_grad=False)

    class Quantized(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4, 4), requires_grad=False)
            self.quant_method = OtherMethod()

    class Hooked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = Norm()

        def process_weights_after_loading(self):
            pass

    config = SimpleNamespace(lora_config=None, model_config=SimpleNamespace(quantization=None))
    plain = torch.nn.Sequential(Norm(), torch.nn.ReLU())
    assert DirectLoad.why_not(plain, config) is None
    assert DirectLoad.for_model(plain, config).kinds == {plain[0]: "plain"}
    assert "uses OtherMethod" in DirectLoad.why_not(torch.nn.Sequential(Norm(), Quantized()), config)
    assert "post-processes its weights as a whole" in DirectLoad.why_not(Hooked(), config)
    lora = SimpleNamespace(lora_config=object(), model_config=config.model_config)
    assert DirectLoad.why_not(plain, lora) == "LoRA is enabled"
    quant = SimpleNamespace(lora_config=None, model_config=SimpleNamespace(quantization="fp8"))
    assert DirectLoad.for_model(plain, quant) is None
