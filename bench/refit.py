"""Refit benchmark: a ~440 MB model refit into a running 2-shard fleet, measured side by side.

Prints, all measured in this one run (the machine is shared and noisy: each arm is repeated
and the median reported):

- this machine's memory-copy bandwidth (torch copy between two pre-touched buffers);
- refit wall time and effective bandwidth (model bytes / refit seconds), from a checkpoint
  directory and from live tensors, as a fraction of the copy bandwidth (target >= 0.5);
- the speed-up over the alternative of restarting the engines on the new checkpoint
  (target >= 20x);
- the speed-up over sending one tensor per RPC (OpenRLHF's pattern), the slow baseline (the
  parts of a stacked layer, q/k/v and gate/up, travel together: the engine reloads them whole);
- a refit driven by vLLM's own trainer API (a trainer engine over ``fleet.weight_sync_client()``,
  backend ``nemo_gen_shm``, the policy a torch module);
- the floor no transport can beat on this engine: each shard's time in vLLM's CPU weight
  repacking (oneDNN), which every weight change must redo, and the bandwidth fraction it allows.

Run: ``make bench-refit`` or ``python -m bench refit [--rounds 3] [--json out.json]``.
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
from bench.lib.stats import verdict


# ~110 M parameters, ~440 MB in float32: hidden 1024, 6 layers, head_dim 64, vocab 16384.
MODEL = dict(hidden_size=1024, num_layers=6, num_heads=16, intermediate_size=2816, vocab_size=16384,
             max_position_embeddings=1024)


def copy_bandwidth(nbytes: int, rounds: int = 5) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # touched: measure copies, not page faults
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


# The parts of one stacked layer (vLLM's packed_modules_mapping for Llama): the engine holds
# them as one tensor and reloads it whole, so they cannot travel in separate RPCs.
STACKED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def per_tensor_refit(fleet, path: str) -> tuple[float, int]:
    """The slow baseline: one RPC round trip per tensor (stage it, then load it alone), except
    that the parts of a stacked layer (q/k/v, gate/up) go together — loading one part alone
    would leave the rest of that layer uninitialized (and is refused). Returns (seconds, RPCs)."""
    import ray
    import torch

    from nemo_gen.settings import policies
    from nemo_gen.core.manifest import layout
    from nemo_gen.core.wire import LoadRefit
    from nemo_gen.fleet.weight_sources import CheckpointSource

    src = CheckpointSource(path)
    metas = src.manifest()
    placed, total = layout(metas)
    staging = fleet.weights.staging()
    staging.ensure(total)
    groups: dict[str, list] = {}
    for place in placed:
        parent, _, leaf = place.name.rsplit(".", 1)[0].rpartition(".")
        groups.setdefault(f"{parent}.{STACKED[leaf]}" if leaf in STACKED else place.name, []).append(place)

    dtype = getattr(torch, fleet.refitter.engine_dtype)
    t0 = time.perf_counter()
    for group in groups.values():
        for name, tensor in src.read([p.name for p in group]):
            staging.write(next(p for p in group if p.name == name), tensor, dtype)
        entries = staging.entries(group)
        msg = LoadRefit(str(staging.path), total, [("policy", entries)], fleet.weight_version, 600, None,
                        policies.in_flight(fleet.settings, "drain"))
        refs = [h.actor.call.remote("load_refit", msg) for h in fleet.shards]
        ray.get(refs, timeout=600)
    return time.perf_counter() - t0, len(groups)


def trainer_api_refits(fleet, model_dir: Path, rounds: int) -> list[float]:
    """Refits driven the way a trainer written against vLLM's API does it: a trainer engine
    (backend nemo_gen_shm) over fleet.weight_sync_client(), the policy a torch module."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from nemo_gen.vllm_ext.vllm_backend import SharedMemoryTrainerInitInfo

    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    client = fleet.weight_sync_client()
    engine = WeightTransferTrainerFactory.trainer_init(
        SharedMemoryTrainerInitInfo(staging_dir=str(fleet.settings.refit.staging_dir)),
        client=client, source=ModuleSource(policy),
    )
    times = []
    try:
        engine.send_weights()  # first touch of its staging pages; not measured
        for _ in range(rounds):
            t = time.perf_counter()
            engine.send_weights()
            times.append(time.perf_counter() - t)
            assert client.report.ok, client.report.to_json()
    finally:
        engine.shutdown()
    return times


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--skip-restart", action="store_true", help="skip the engine-restart baseline")
    p.add_argument("--load-path", choices=("direct", "reload_weights"), default="direct",
                   help="how the workers load a refit: the direct path (the default, chosen per model) or, "
                        "for comparison, vLLM's reload_weights for every refit")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    quiet_environment()

    import ray
    from safetensors.torch import load_file

    from nemo_gen import GenerationFleet, NemoGenSettings
    from nemo_gen.vllm_ext.worker_ext import FORCE_RELOAD_ENV
    from nemo_gen.tiny_model import make_tiny_model

    home = Path(os.environ.get("NEMO_GEN_BENCH_HOME", Path(tempfile.gettempdir()) / "nemo-gen-bench"))
    a = make_tiny_model(home / "bench-a", seed=0, **MODEL)
    b = make_tiny_model(home / "bench-b", seed=1, **MODEL)
    model_bytes = os.path.getsize(b / "model.safetensors")
    print(f"model: {model_bytes / 1e6:.0f} MB on disk, {args.shards} shards")

    def settings(name, path, shards):
        return NemoGenSettings.load(overrides={
            "home": str(home), "model.path": str(path), "fleet.name": name, "fleet.num_shards": shards,
            "fleet.device": "cpu", "ray.log_to_driver": False, "generation.vllm_cfg.max_model_len": 512,
            "fleet.cpu_kvcache_space_gb": 1,
            **({"generation.vllm_cfg.env_vars": {FORCE_RELOAD_ENV: "reload_weights"}}
               if args.load_path == "reload_weights" else {}),
        })

    out: dict = {"model_bytes": model_bytes, "shards": args.shards, "load_path": args.load_path}
    print(f"refit load path: {args.load_path}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    copy_bw = copy_bandwidth(model_bytes)
    out["copy_gb_per_s"] = copy_bw / 1e9
    print(f"memory copy bandwidth: {copy_bw / 1e9:.2f} GB/s")

    t0 = time.perf_counter()
    fleet = GenerationFleet.launch(settings("bench-refit", a, args.shards))
    cold_start = time.perf_counter() - t0
    try:
        live = load_file(str(b / "model.safetensors"))
        ckpt_times, live_times, reports = [], [], []
        fleet.refit(str(b))  # first touch of the staging pages; not measured
        for i in range(args.rounds):
            for src, times in ((str(a if i % 2 else b), ckpt_times), (live, live_times)):
                t = time.perf_counter()
                report = fleet.refit(src)
                times.append(time.perf_counter() - t)
                assert report.ok, report.to_json()
                reports.append(report.to_json())
        ckpt_s, live_s = statistics.median(ckpt_times), statistics.median(live_times)
        last = reports[-1]
        out.update({
            "refit_checkpoint_s": ckpt_s, "refit_live_s": live_s,
            "refit_checkpoint_all_s": ckpt_times, "refit_live_all_s": live_times,
            "stage_s": last["stage_seconds"], "load_s": last["load_seconds"],
            "checkpoint_fraction_of_copy": (model_bytes / ckpt_s) / copy_bw,
            "live_fraction_of_copy": (model_bytes / live_s) / copy_bw,
        })
        print(f"refit from checkpoint: {ckpt_s:.2f} s median ({model_bytes / ckpt_s / 1e9:.2f} GB/s, "
              f"{out['checkpoint_fraction_of_copy']:.2f} of copy bandwidth)  runs {[round(t, 2) for t in ckpt_times]}")
        print(f"refit from live tensors: {live_s:.2f} s median ({model_bytes / live_s / 1e9:.2f} GB/s, "
              f"{out['live_fraction_of_copy']:.2f} of copy bandwidth)  runs {[round(t, 2) for t in live_times]}")
        print(f"  last refit: stage {last['stage_seconds']:.2f} s, verify+load {last['load_seconds']:.2f} s "
              f"(per shard {[round(s['seconds'], 2) for s in last['shards']]})")
        trainer_times = trainer_api_refits(fleet, b, args.rounds)
        out["refit_trainer_api_s"] = statistics.median(trainer_times)
        out["trainer_api_fraction_of_copy"] = (model_bytes / out["refit_trainer_api_s"]) / copy_bw
        print(f"refit via vLLM's trainer API (nemo_gen_shm): {out['refit_trainer_api_s']:.2f} s median "
              f"({out['trainer_api_fraction_of_copy']:.2f} of copy bandwidth)  runs {[round(t, 2) for t in trainer_times]}")

        fleet.refit(str(b))
        stats = [st for h in fleet.shards for st in ray.get(h.actor.call.remote("load_stats"), timeout=60)]
        repack = [st.repack_s for st in stats if st.repack_s is not None]
        if repack:
            floor = max(repack)  # shards load in parallel: the slowest one's repack bounds the refit
            out["repack_s_per_shard"] = repack
            out["load_s_per_shard"] = [st.seconds for st in stats]
            out["ceiling_fraction_of_copy"] = (model_bytes / floor) / copy_bw
            print(f"  per shard: load {[round(st.seconds, 2) for st in stats]} s, of which oneDNN repack "
                  f"{[round(r, 2) for r in repack]} s ({model_bytes / floor / 1e9:.2f} GB/s) -> no transport can "
                  f"exceed {out['ceiling_fraction_of_copy']:.2f} of copy bandwidth on these engines")

        per_tensor, rpcs = per_tensor_refit(fleet, str(b))
        out["per_tensor_rpc_s"] = per_tensor
        out["per_tensor_rpcs"] = rpcs
        out["speedup_vs_per_tensor_rpc"] = per_tensor / ckpt_s
        print(f"one tensor per RPC ({rpcs} RPCs, stacked parts together): {per_tensor:.2f} s -> bucketed refit "
              f"is {per_tensor / ckpt_s:.1f}x faster")
    finally:
        fleet.shutdown()

    if not args.skip_restart:
        # The alternative to a refit: stop the engines and start them on the new checkpoint.
        t0 = time.perf_counter()
        restarted = GenerationFleet.launch(settings("bench-restart", b, args.shards))
        restart_s = time.perf_counter() - t0
        restarted.shutdown()
        out["restart_s"] = restart_s
        out["first_launch_s"] = cold_start
        out["speedup_vs_restart"] = restart_s / ckpt_s
        print(f"restart {args.shards} engines on the checkpoint: {restart_s:.1f} s (first launch {cold_start:.1f} s) "
              f"-> refit is {restart_s / ckpt_s:.0f}x faster")

    out["load_average_end"] = os.getloadavg()[0]
    print(f"\nsummary (load path {args.load_path}; load average {out['load_average_end']:.1f} at the end)")
    print(f"  bandwidth, checkpoint: {out['checkpoint_fraction_of_copy']:.2f} of copy (target >= 0.5)")
    print(f"  bandwidth, live:       {out['live_fraction_of_copy']:.2f} of copy (target >= 0.5)")
    if "speedup_vs_restart" in out:
        print(f"  vs restart:            {out['speedup_vs_restart']:.0f}x (target >= 20x)")
    print(f"  bandwidth, trainer API: {out['trainer_api_fraction_of_copy']:.2f} of copy (target >= 0.5)")
    if "ceiling_fraction_of_copy" in out:
        print(f"  ceiling (repack alone): {out['ceiling_fraction_of_copy']:.2f} of copy")
    print(f"  vs one tensor per RPC: {out['speedup_vs_per_tensor_rpc']:.1f}x")
    verdicts = {k: verdict(out[f"{k}_fraction_of_copy"], 0.5, higher_is_better=True)
                for k in ("checkpoint", "live", "trainer_api")}
    if "speedup_vs_restart" in out:
        verdicts["vs_restart"] = verdict(out["speedup_vs_restart"], 20, higher_is_better=True)
    return write_result(args.json, "refit", args, out, verdicts)
