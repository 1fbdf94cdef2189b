"""The weight digest's cost as a fraction of a refit's own time, on CPU (tiny-model family).

A 1-shard fleet refits a ~110 MB float32 model (hidden 512, 8 layers) from live tensors, with
``refit.digest`` on and off in alternating rounds (the same fleet; the setting is the
refitter's, flipped between rounds), and reports:

- the refit's median seconds each way, and their difference as a fraction of the refit without
  the digest (``digest_fraction``: what the digest adds, trainer side and shard side together);
- the trainer side's own digest seconds (``RefitReport.digest_seconds``) and its fraction;
- the digest kernel's bandwidth over the same bytes against this machine's memory copy.

No target on CPU: the fraction is measured (the issue's target, <= 0.3, is the GPU's:
``refit_digest_gpu``). Here the digest runs eagerly, eight passes over each 8-byte word where a
fused kernel reads it once, on the same two cores as the engines, so it costs several copies'
time per side; the check: every result carries the refit's digest.
Run: ``flock /tmp/nemo_gen_engine.lock python -m bench refit_digest [--rounds 5] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.lib.result import write_result
from bench.lib.setup import quiet_environment
from bench.lib.stats import check

MODEL = dict(hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1536, vocab_size=16384,
             max_position_embeddings=512)


def hash_bandwidth(tensors: dict, rounds: int = 3) -> float:
    """Bytes per second of ``tensor_digest`` over ``tensors`` (median of ``rounds``)."""
    from nemo_gen.vllm_ext.digest import tensor_digest

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for t in tensors.values():
            tensor_digest(t)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="refits each way (digest on, off), alternating")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    quiet_environment()

    import ray
    from safetensors.torch import load_file

    from bench.refit import copy_bandwidth
    from nemo_gen import GenerationFleet, NemoGenSettings
    from nemo_gen.tiny_model import make_tiny_model

    home = Path(os.environ.get("NEMO_GEN_BENCH_HOME", Path(tempfile.gettempdir()) / "nemo-gen-bench"))
    a = make_tiny_model(home / "digest-a", seed=0, **MODEL)
    b = make_tiny_model(home / "digest-b", seed=1, **MODEL)
    model_bytes = os.path.getsize(b / "model.safetensors")
    settings = NemoGenSettings.load(overrides={
        "home": str(home), "model.path": str(a), "fleet.name": "bench-digest", "fleet.num_shards": 1,
        "fleet.device": "cpu", "ray.log_to_driver": False, "generation.vllm_cfg.max_model_len": 256,
        "fleet.cpu_kvcache_space_gb": 1,
    })
    out: dict = {"model_bytes": model_bytes, "rounds": args.rounds}
    print(f"model: {model_bytes / 1e6:.0f} MB; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    sources = [load_file(str(m / "model.safetensors")) for m in (a, b)]
    out["copy_gb_per_s"] = copy_bandwidth(model_bytes) / 1e9
    out["hash_gb_per_s"] = hash_bandwidth(sources[1]) / 1e9
    print(f"memory copy {out['copy_gb_per_s']:.2f} GB/s; digest kernel {out['hash_gb_per_s']:.2f} GB/s")

    fleet = GenerationFleet.launch(settings)
    try:
        fleet.refit(sources[1])  # first touch of the staging pages; not measured
        on, off, trainer, digests_ok = [], [], [], True
        for i in range(args.rounds):
            for digest, times in ((True, on), (False, off)):
                fleet.refitter.digest = digest
                t0 = time.perf_counter()
                report = fleet.refit(sources[i % 2])
                times.append(time.perf_counter() - t0)
                assert report.ok, report.to_json()
                if digest:
                    trainer.append(report.digest_seconds)
                    results = fleet.generate(["digest"], max_new_tokens=2)
                    digests_ok &= all(r.weight_digests == [report.digest] for r in results)
        fleet.refitter.digest = True
    finally:
        fleet.shutdown()
        ray.shutdown()

    out["refit_s_digest"] = statistics.median(on)
    out["refit_s_no_digest"] = statistics.median(off)
    out["trainer_digest_s"] = statistics.median(trainer)
    out["digest_fraction"] = (out["refit_s_digest"] - out["refit_s_no_digest"]) / out["refit_s_no_digest"]
    out["trainer_digest_fraction"] = out["trainer_digest_s"] / out["refit_s_no_digest"]
    out["results_carry_digest"] = digests_ok
    print(f"refit: {out['refit_s_digest'] * 1e3:.0f} ms with the digest, {out['refit_s_no_digest'] * 1e3:.0f} ms "
          f"without -> the digest adds {out['digest_fraction']:.2f} of the refit's time "
          f"(trainer side {out['trainer_digest_s'] * 1e3:.0f} ms = {out['trainer_digest_fraction']:.2f})")
    verdicts = {"results_carry_digest": check(digests_ok)}
    return write_result(args.json, "refit_digest", args, out, verdicts)


if __name__ == "__main__":
    main()
