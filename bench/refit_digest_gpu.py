"""The weight digest's cost against a 16 GB ``nemo_gen_ipc`` refit, on one GPU (for a GPU sitting).

A random bf16 Llama of ``--layers`` x hidden 4096 (40 layers: ~16 GB; ``bench.gpu_bench.make_model``)
is the trainer's policy on the GPU; a 1-shard fleet on the same GPU refits from it through
``nemo_gen_ipc`` (CUDA IPC: the loaders copy straight out of the trainer's memory). Measured in
this one run:

- the refit's median seconds (``engine.send_weights()``, ``--rounds`` each way, the policy negated
  between rounds so every refit moves other values), with the digest (the trainer engine hashes
  what it sends, the shard's workers hash what they load and compare) and without it
  (``client.digest`` off), alternating;
- the digest kernel (``nemo_gen.vllm_ext.digest.tensor_digest``, fused by ``torch.compile`` on
  CUDA) over every policy tensor, eager and compiled, after a warm-up: seconds and GB/s against
  the device's copy bandwidth (``dst.copy_(src)`` of the same bytes);
- ``digest_fraction``: (refit with - refit without) / refit without, target <= 0.3 (one more
  read of the weights on each side at the device's bandwidth); ``kernel_fraction``: twice the
  kernel's seconds over the refit's without, what the two reads alone should cost.

Run on the GPU host:
``python -m bench refit_digest_gpu [--layers 40] [--rounds 5] --out DIR``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.lib.result import write_result
from bench.lib.setup import quiet_environment
from bench.lib.stats import check, verdict


def timed_digests(tensors: list, fn) -> tuple[float, list[int]]:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    values = [fn(t) for t in tensors]  # each digest's .item() waits for its kernel
    torch.cuda.synchronize()
    return time.perf_counter() - t0, values


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=40, help="decoder layers of hidden 4096 (40: ~16 GB in bf16)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--util", type=float, default=0.45, help="the engine's share of GPU memory")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "nemo-gen-bench"))
    p.add_argument("--out", type=Path, required=True, help="folder for refit_digest_gpu.json")
    args = p.parse_args(argv)
    quiet_environment()

    import torch

    import nemo_gen.vllm_ext.digest as kernel
    from bench.gpu_bench import copy_bandwidth, make_model
    from nemo_gen.tiny_model import make_tiny_model

    work = Path(args.work)
    tiny = make_tiny_model(work / "tiny")
    policy = make_model(work / f"digest-llama-{args.layers}l", args.layers, tiny)
    tensors = [t.detach() for t in policy.state_dict().values()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out: dict = {"bytes": nbytes, "layers": args.layers, "gpu": torch.cuda.get_device_name(0)}
    out["copy_gb_per_s"] = copy_bandwidth(nbytes)

    timed_digests(tensors[:2], kernel.tensor_digest)  # compile the fused kernel (not measured)
    compiled = [timed_digests(tensors, kernel.tensor_digest) for _ in range(3)]
    out["digest_s"] = statistics.median(s for s, _ in compiled)
    out["digest_gb_per_s"] = nbytes / out["digest_s"] / 1e9
    # the same arithmetic, unfused: what fusing saves
    out["eager_digest_s"], eager_values = timed_digests(tensors, lambda t: kernel.tensor_digest(t, fused=False))
    out["eager_equals_fused"] = eager_values == compiled[0][1]
    out["digests_repeat"] = len({tuple(v) for _, v in compiled}) == 1
    print(f"{nbytes / 1e9:.1f} GB: digest {out['digest_s'] * 1e3:.1f} ms ({out['digest_gb_per_s']:.0f} GB/s; "
          f"eager {out['eager_digest_s'] * 1e3:.1f} ms), copy {out['copy_gb_per_s']:.0f} GB/s")

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from nemo_gen import GenerationFleet, NemoGenSettings
    from nemo_gen.vllm_ext.vllm_backend import CudaIpcTrainerInitInfo

    fleet = GenerationFleet.launch(NemoGenSettings.load(overrides={
        "home": str(work / "home"), "model.path": str(work / f"digest-llama-{args.layers}l"),
        "fleet.name": "gpu-digest", "fleet.device": "gpu", "fleet.num_shards": 1, "fleet.engine_start_timeout_s": 500,
        "generation.vllm_cfg.precision": "bfloat16", "generation.vllm_cfg.max_model_len": 512,
        "generation.vllm_cfg.gpu_memory_utilization": args.util, "refit.backend": "nemo_gen_ipc",
        "ray.namespace": "nemo_gen_gpu_digest",
    }))
    try:
        client = fleet.weight_sync_client()
        engine = WeightTransferTrainerFactory.trainer_init(CudaIpcTrainerInitInfo(), client=client,
                                                           source=ModuleSource(policy))
        engine.send_weights()  # handles exported and opened once, the kernel compiled; not measured
        refits: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for digest in (True, False):
                client.digest = digest
                with torch.no_grad():
                    for t in policy.parameters():
                        t.mul_(-1.0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.send_weights()
                refits[digest].append(time.perf_counter() - t0)
                assert client.report.ok and (client.report.digest is not None) == digest, client.report.to_json()
        engine.shutdown()
    finally:
        fleet.shutdown()
    out["refit_s_digest"] = statistics.median(refits[True])
    out["refit_s"] = statistics.median(refits[False])
    out["refit_gb_per_s"] = nbytes / out["refit_s"] / 1e9
    out["digest_fraction"] = (out["refit_s_digest"] - out["refit_s"]) / out["refit_s"]
    out["kernel_fraction"] = 2 * out["digest_s"] / out["refit_s"]
    print(f"nemo_gen_ipc refit {out['refit_s'] * 1e3:.1f} ms ({out['refit_gb_per_s']:.0f} GB/s), "
          f"{out['refit_s_digest'] * 1e3:.1f} ms with the digest: +{out['digest_fraction']:.2f} "
          f"(the kernel's two reads: {out['kernel_fraction']:.2f})")
    verdicts = {"digest_fraction": verdict(out["digest_fraction"], 0.3, higher_is_better=False),
                "digests_repeat": check(out["digests_repeat"] and out["eager_equals_fused"])}
    args.out.mkdir(parents=True, exist_ok=True)
    return write_result(args.out / "refit_digest_gpu.json", "refit_digest_gpu", args, out, verdicts)


if __name__ == "__main__":
    main()
