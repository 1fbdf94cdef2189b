"""examples/grpo.py without engines: its GPU configuration resolves into the launch plan the GPU
run needs (the 1b preset has >= 1e9 parameters, one bf16 shard with CUDA graphs and
``nemo_gen_ipc`` beside the trainer), the task and the advantages compute what the docstring says,
and the trainer's step — the same code on the GPU, there in bf16 — updates the module in place
(its storages never move, which ``nemo_gen_ipc``'s once-shared handles rely on), matches itself
across micro-batch sizes, and finds no mismatch against logprobs of its own weights.
tests/e2e/test_grpo.py runs the loop on real engines."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_example

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def grpo():
    return load_example("grpo")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from nemo_gen.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("grpo-unit") / "tiny")


def test_help_runs_without_engines():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "grpo.py"), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for flag in ("--steps", "--mode", "--seed", "--device", "--out", "--prompts", "--group", "--model-size"):
        assert flag in out.stdout


def test_the_1b_preset_has_a_billion_parameters(grpo):
    from nemo_gen.tiny_model import tiny_model_num_params

    shape = {k: v for k, v in grpo.MODEL_SIZES["1b"].items() if k in ("hidden_size", "num_layers", "intermediate_size")}
    assert tiny_model_num_params(vocab_size=512, **shape) >= 1_000_000_000


def test_the_gpu_run_resolves_to_one_colocated_bf16_shard(grpo, tiny):
    from nemo_gen.fleet.resolve import resolve_generation

    args = grpo.parse_args(["--device", "gpu", "--model-size", "1b", "--prompts", "64", "--group", "8",
                            "--max-new-tokens", "128", "--mode", "async"])
    assert grpo.resolve_refit(args) == "client" and args.lr == grpo.MODEL_SIZES["1b"]["lr"]
    settings = grpo.fleet_settings(args, tiny)
    assert settings.refit.in_flight == "keep" and settings.refit.max_staleness == args.max_staleness_tokens
    assert not settings.generation.vllm_cfg.async_engine and not settings.refit.recompute_kv
    on_async = grpo.fleet_settings(grpo.parse_args(["--mode", "async", "--engine", "async", "--recompute-kv"]), tiny)
    assert on_async.generation.vllm_cfg.async_engine and on_async.refit.in_flight == "keep"
    assert on_async.refit.recompute_kv
    plan = resolve_generation(settings, cluster=None)
    kw = plan.shards[0].engine_kwargs
    assert len(plan.shards) == 1 and kw["load_format"] == "dummy"  # weights come from the trainer
    assert kw["dtype"] == "bfloat16" and kw["enforce_eager"] is False
    assert kw["weight_transfer_config"] == {"backend": "nemo_gen_ipc"}
    assert kw["gpu_memory_utilization"] == args.gpu_memory_utilization
    assert args.max_new_tokens + 32 <= kw["max_model_len"]  # prompts of the task are < 32 tokens


def test_the_task_starts_at_chance_and_has_room(grpo, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    task = grpo.DigitTask(tok)
    assert len(task.digits) >= 10 and 0.01 < task.chance < 0.1  # low start, ceiling 1.0
    prompts = task.prompts(8, random.Random(0))
    assert all(len(tok(p)["input_ids"]) < 32 for p in prompts)
    seven, word = tok.convert_tokens_to_ids("7"), tok("the")["input_ids"][-1]
    assert task.reward([seven, seven, word, word]) == 0.5 and task.reward([word]) == 0.0


def test_group_advantages(grpo):
    c = [grpo.Completion(g, [1], [5], [0.0], [(0, 1)], reward=r)
         for g, r in [(0, 0.0), (0, 1.0), (1, 0.5), (1, 0.5)]]
    grpo.group_advantages(c)
    assert [round(x.advantage, 4) for x in c] == [-1.0, 1.0, 0.0, 0.0]  # a tied group teaches nothing


def test_covered_is_the_union_inside_the_window(grpo):
    assert grpo.covered([(0, 2), (1, 3), (5, 6)], 1, 5.5) == pytest.approx(2.5)
    assert grpo.covered([], 0, 1) == 0.0


def _batch(grpo, trainer, tok, n=6, tokens=5, seed=0):
    """Completions sampled from the trainer's own model, with its own logprobs as the engine's."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = tok(f"Tell me about the river {i}:")["input_ids"]
        ids = torch.randint(4, 500, (tokens,), generator=gen).tolist()
        out.append(grpo.Completion(i // 3, prompt, ids, [0.0] * tokens, [(0, tokens)], reward=float(i % 3)))
    with torch.no_grad():
        logp, mask = trainer._logprobs(out)
    for row, c in enumerate(out):
        c.engine_logprobs = logp[row, :len(c.token_ids)].tolist()
    grpo.group_advantages(out)
    return out


def test_the_trainer_steps_in_place_and_micro_batches_agree(grpo, tiny):
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    results = []
    for micro in (64, 2):
        args = grpo.parse_args(["--model", str(tiny), "--micro-batch", str(micro)])
        trainer = grpo.Trainer(tiny, args)
        before = {n: (p.data_ptr(), p.detach().clone()) for n, p in trainer.model.named_parameters()}
        stats = trainer.step(_batch(grpo, trainer, tok), version=0)
        after = dict(trainer.model.named_parameters())
        # the module was updated, in place: the refit (and nemo_gen_ipc's shared handles) read these storages
        assert all(after[n].data_ptr() == ptr for n, (ptr, _) in before.items())
        assert any(not torch.equal(after[n], old) for n, (_, old) in before.items())
        assert stats["logprob_mismatch"] < 1e-6 and stats["logprob_mismatch_fresh"] < 1e-6
        assert stats["logprob_mismatch_stale"] is None and stats["clip_fraction"] == 0.0
        results.append([m.grad for m in trainer.master])
    # a token-level mean over the whole batch, however it is split: the same gradient (compared
    # before Adam, whose first step turns float noise in a near-zero gradient into +-lr)
    for whole, split in zip(*results):
        assert torch.allclose(whole, split, rtol=1e-4, atol=1e-8)


def test_colocated_is_a_gpu_sync_run_whose_engines_sleep(grpo, tiny, capsys):
    from nemo_gen.fleet.resolve import resolve_generation

    for argv in (["--colocated"], ["--colocated", "--device", "gpu", "--mode", "async"]):
        with pytest.raises(SystemExit):
            grpo.parse_args(argv)
        assert "--colocated needs --device gpu" in capsys.readouterr().err
    args = grpo.parse_args(["--colocated", "--device", "gpu"])
    settings = grpo.fleet_settings(args, tiny)
    assert settings.generation.colocated.enabled
    assert resolve_generation(settings, cluster=None).shards[0].engine_kwargs["enable_sleep_mode"] is True
