"""examples/grpo.py's trainer on a real GPU, at the size of the GPU run, without engines: the
1b preset (a random-init Llama of 1.13 B parameters, made locally) loaded in bf16, one step on
64 prompts x 8 samples x 128 tokens in micro-batches, twice.

- the step's peak memory leaves the engine its share of the device (the run's default
  ``--gpu-memory-utilization``, plus headroom);
- the module is updated in place (every parameter at the address it had), so ``nemo_gen_ipc``'s
  sender builds its update info once and every later refit sends that same layout, handles
  shared once;
- the trainer's bf16 logprobs of its own samples, as an engine would report them, give no
  mismatch, and no ratio is clipped.

Needs CUDA (skipped elsewhere). Prints the step's seconds and peak GiB (the run's train phase).
``NEMO_GEN_RL_WORK``: where the model is made (kept; bench/gpu_sitting.sh's rl run finds it there).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.helpers import load_example

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_1b_trainer_steps_in_place_beside_the_engine(tmp_path):
    from nemo_gen.vllm_ext.cuda_ipc import IpcSender

    grpo = load_example("grpo")
    args = grpo.parse_args(["--device", "gpu", "--model-size", "1b", "--prompts", "64", "--group", "8",
                            "--max-new-tokens", "128", "--work", os.environ.get("NEMO_GEN_RL_WORK") or str(tmp_path)])
    t = time.perf_counter()
    model_dir = grpo.make_model(args)
    made_s = time.perf_counter() - t
    t = time.perf_counter()
    trainer = grpo.Trainer(model_dir, args)
    load_s = time.perf_counter() - t
    params = sum(p.numel() for p in trainer.model.parameters())
    assert params >= 1_000_000_000 and next(trainer.model.parameters()).dtype == torch.bfloat16

    gen = torch.Generator().manual_seed(0)
    batch = []
    for i in range(args.prompts * args.group):
        ids = torch.randint(4, 500, (args.max_new_tokens,), generator=gen).tolist()
        batch.append(grpo.Completion(i // args.group, [1] + list(range(40, 52)), ids, [], [(0, len(ids))],
                                     reward=float(i % 3)))
    with torch.no_grad():  # what an engine holding these weights reports: the trainer's own logprobs
        for i in range(0, len(batch), args.micro_batch):
            logp, _ = trainer._logprobs(batch[i:i + args.micro_batch])
            for row, c in enumerate(batch[i:i + args.micro_batch]):
                c.engine_logprobs = logp[row].tolist()
    grpo.group_advantages(batch)

    sender = IpcSender()
    first = sender.update_info(trainer.model.named_parameters())
    addresses = {n: p.data_ptr() for n, p in trainer.model.named_parameters()}
    torch.cuda.reset_peak_memory_stats()
    seconds, stats = [], []
    for version in range(2):
        t = time.perf_counter()
        stats.append(trainer.step(batch, version))
        seconds.append(time.perf_counter() - t)
        assert sender.update_info(trainer.model.named_parameters()) is first  # one layout, handles shared once
    assert {n: p.data_ptr() for n, p in trainer.model.named_parameters()} == addresses
    peak = torch.cuda.max_memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    print(f"1b trainer: {params / 1e9:.2f} B params, made in {made_s:.0f} s, loaded in {load_s:.0f} s; step "
          f"{seconds} s on {len(batch)} x {args.max_new_tokens} tokens, peak {peak / 2**30:.1f} GiB of "
          f"{total / 2**30:.0f}; {stats}")
    assert peak < (1 - args.gpu_memory_utilization - 0.1) * total
    # bf16 both times: the first step sees (up to the kernels autograd picks) its own logprobs
    assert stats[0]["logprob_mismatch"] < 0.02 and stats[0]["clip_fraction"] < 0.01 and stats[0]["grad_norm"] > 0
    assert stats[1]["logprob_mismatch"] > stats[0]["logprob_mismatch"]  # the first step moved the weights
    sender.close()
