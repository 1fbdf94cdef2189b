"""A replayed refit (the copy plan) on a CUDA engine with CUDA graphs and torch.compile on, against
the engine's other load paths for the same values: the weights the engine holds (a float64
digest of every parameter, against the trainer's) and the greedy tokens.

    python -m pytest tests/gpu/test_refit_replay_gpu.py -v

Sequence (one fleet of one shard, ``nemo_gen_ipc`` from a trainer module in this process):
record (values A) -> replay (-A) -> vLLM's layerwise reload (-A) -> record again (A) ->
replay (-A) -> replay (A). Every step's digest must be the trainer's, and the same values must
give the same tokens whichever path loaded them.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from nemo_gen import GenerationFleet
    from nemo_gen.vllm_ext.vllm_backend import CudaIpcTrainerInitInfo
    from nemo_gen.settings import NemoGenSettings
    from nemo_gen.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("replay")
    model = make_tiny_model(root / "a")
    settings = NemoGenSettings.load(overrides={
        "home": str(root / "home"), "model.path": str(model), "fleet.name": "gpu-replay", "fleet.device": "gpu",
        "fleet.num_shards": 1, "fleet.engine_start_timeout_s": 400, "generation.vllm_cfg.precision": "bfloat16",
        "generation.vllm_cfg.enforce_eager": False, "generation.vllm_cfg.max_model_len": 256,
        "generation.vllm_cfg.gpu_memory_utilization": 0.1, "refit.backend": "nemo_gen_ipc",
        "ray.namespace": "nemo_gen_gpu_replay",
    })
    fleet = GenerationFleet.launch(settings)
    policy = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).cuda()
    client = fleet.weight_sync_client()
    engine = WeightTransferTrainerFactory.trainer_init(CudaIpcTrainerInitInfo(), client=client, source=ModuleSource(policy))
    yield fleet, policy, client, engine
    engine.shutdown()
    fleet.shutdown()


def test_replayed_refits_load_what_every_other_path_loads(setup):
    import ray

    fleet, policy, client, engine = setup
    handle = fleet.shards[0]
    prompts = [[1] + [(7 * i + j) % 250 + 4 for j in range(15)] for i in range(4)]

    def worker(method, *args):
        def fn(actor, method, args):
            return actor.shard.engine._llm.collective_rpc(method, args=args)

        return ray.get(handle.actor.__ray_call__.remote(fn, method, args), timeout=120)[0]

    def trainer_digest():
        with torch.no_grad():
            return float(sum(p.detach().double().sum().item() for p in policy.parameters()))

    def negate():
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(-1.0)

    def tokens():
        return [r.token_ids for r in fleet.generate(prompts, temperature=0, max_new_tokens=12, ignore_eos=True)]

    launched = tokens()
    log = []

    def send(label):
        t = time.perf_counter()
        engine.send_weights()
        wall = time.perf_counter() - t
        assert client.report.ok, client.report
        stats = ray.get(handle.actor.call.remote("load_stats"), timeout=60)[0]
        got, want = worker("nemo_gen_digest"), trainer_digest()
        entry = {"step": label, "plan": stats.plan, "path": stats.path, "digest": got, "trainer": want,
                 "wall_ms": round(wall * 1e3, 2), "tokens": tokens()}
        log.append(entry)
        assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), log
        return entry

    a = send("record A")
    assert a["plan"] == "recorded" and a["tokens"] == launched, log
    negate()
    neg = send("replay -A")
    assert neg["plan"] == "replayed" and neg["tokens"] != launched, log
    worker("nemo_gen_set_load_path", "reload_weights")
    try:
        reload = send("reload -A")
    finally:
        worker("nemo_gen_set_load_path", None)
    assert reload["path"] == "reload_weights" and reload["tokens"] == neg["tokens"], log
    negate()
    again = send("record A after reload")
    assert again["plan"] == "recorded" and again["tokens"] == launched, log
    negate()
    assert send("replay -A")["tokens"] == neg["tokens"], log
    negate()
    last = send("replay A")
    assert last["plan"] == "replayed" and last["tokens"] == launched, log
    print("\n" + "\n".join(f"{e['step']:<24} {e['plan']!s:<10} {e['wall_ms']:>7} ms digest {e['digest']:.6g}" for e in log))
