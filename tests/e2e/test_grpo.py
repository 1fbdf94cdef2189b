"""examples/grpo.py learns through a real fleet, in both modes: one vLLM CPU engine (the tiny
model, fleet.mode train, refit.in_flight keep) serves a sync run (refit by ``fleet.refit(model)``)
and then an async run (refit through ``fleet.weight_sync_client()`` and vLLM's trainer engine,
``nemo_gen_shm``, landing on the running rollout), 20 steps of 8 prompts x 8 samples x 16 tokens
each, the trainer in fp32 on this CPU.

Every assertion below fails when the refits are skipped (the trainer learns, the engines keep
the initial weights): run the module with ``NEMO_GEN_TEST_SKIP_REFIT=1`` to see them fail — only
each run's first push (the initial weights) then reaches the engines.
"""

from __future__ import annotations

import os
import statistics

import pytest

from tests.conftest import TEST_NAMESPACE
from tests.helpers import load_example

pytestmark = pytest.mark.e2e

STEPS = 20
# The initial, nearly uniform policy scores the chance rate, 15 digit tokens of 512 (~0.03). If
# nothing the trainer learns reaches the engines, the last 5 steps' mean reward differs from the
# first 5's by sampling noise only: sigma ~0.0035 for the difference of two means of 5 x 1024
# tokens at p = 0.03. A rise of 0.15 is five times the chance rate and over 40 sigma, and less than
# half of what 20 steps gave here (sync 0.70-0.72 above the first 5, async, a step behind, 0.41-0.51).
REWARD_RISE = 0.15
# fp32 on both sides, the same weights: the engine's logprobs (oneDNN kernels) and the trainer's
# (PyTorch's) differ by summation order only — at most 3e-7 nats on average over a step here.
# 1e-5 leaves 30x, four orders of magnitude below what one step of training changes (~0.1).
SYNC_MISMATCH = 1e-5
# Async mode samples one step behind the trainer: the trainer's logprobs are its new weights',
# the engine's the weights before the last step. One AdamW step at this learning rate moved the
# sampled tokens' mean |log p| by 0.06-0.22 here; 0.5 bounds one step's change with room, and a
# sample two or more steps behind is dropped (--max-lag 1) instead of being trained on.
ASYNC_MISMATCH = 0.5
MAX_LAG = 1


@pytest.fixture(scope="module")
def runs(ray_cluster, tiny_model_dir, tmp_path_factory):
    from nemo_gen import GenerationFleet

    grpo = load_example("grpo")
    out = tmp_path_factory.mktemp("grpo")

    def args(mode: str, refit: str):
        return grpo.parse_args(["--mode", mode, "--steps", str(STEPS), "--model", str(tiny_model_dir),
                                "--refit", refit, "--max-lag", str(MAX_LAG), "--out", str(out / mode), "--quiet"])

    settings = grpo.fleet_settings(args("async", "client"), tiny_model_dir, overrides={
        "home": str(out / "home"), "ray.namespace": TEST_NAMESPACE,
        "fleet.name": "grpo-test", "health.probe_interval_s": 60})
    with pytest.MonkeyPatch.context() as mp:
        if os.environ.get("NEMO_GEN_TEST_SKIP_REFIT") == "1":  # the mutation: only the first push lands
            push = grpo.WeightPusher.push

            def first_only(self, version):
                if not getattr(self, "pushed", False):
                    self.pushed = True
                    push(self, version)

            mp.setattr(grpo.WeightPusher, "push", first_only)
        with GenerationFleet.launch(settings) as fleet:
            records = {"sync": grpo.run(fleet, tiny_model_dir, args("sync", "module"), out / "sync"),
                       "async": grpo.run(fleet, tiny_model_dir, args("async", "client"), out / "async")}
    for mode, recs in records.items():
        grpo.plot(recs, out / mode / "run.png", mode)
        print(mode, grpo.summary(recs))
    return records, out


def mean_reward(records) -> float:
    return statistics.fmean(r["reward_mean"] for r in records)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_reward_rises(runs, mode):
    records = runs[0][mode]
    assert len(records) == STEPS
    first, last = mean_reward(records[:5]), mean_reward(records[-5:])
    assert last - first > REWARD_RISE, f"{mode}: reward {first:.3f} over the first 5 steps, {last:.3f} over the last 5"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_weight_versions_advance_by_one_per_step(runs, mode):
    records = runs[0][mode]
    served = [r["weight_version"] for r in records]
    assert [b - a for a, b in zip(served, served[1:])] == [1] * (len(served) - 1), served
    # ... and the fleet serves what the trainer pushed: its weights after the step
    assert all(r["weight_version"] == r["trainer_version"] + 1 for r in records), served


def test_sync_every_sample_is_from_the_trainers_current_weights(runs):
    for r in runs[0]["sync"]:
        assert r["sample_versions"] == {str(r["trainer_version"]): r["tokens"]}, r["step"]
        assert r["staleness"] == {"0": r["samples"]} and r["dropped"] == 0


def test_async_no_sample_is_older_than_the_bound(runs):
    records = runs[0]["async"]
    for r in records:
        assert max(int(s) for s in r["staleness"]) <= MAX_LAG, (r["step"], r["staleness"])
        assert r["dropped"] == 0
    # the rollouts ran one step behind the trainer: every token came from its current weights or
    # the ones before (a refit landing mid-rollout switches a sample to the current ones), and
    # samples begun on the weights before are there (a sync loop would have none)
    assert all(set(r["sample_versions"]) <= {str(r["trainer_version"] - 1), str(r["trainer_version"])}
               for r in records)
    assert any(r["staleness"].get("1") for r in records)


def test_sync_logprob_mismatch(runs):
    mismatch = [r["logprob_mismatch"] for r in runs[0]["sync"]]
    assert None not in mismatch and max(mismatch) < SYNC_MISMATCH, mismatch


def test_async_logprob_mismatch(runs):
    # every step trained (none had all its samples dropped), within one step's change
    mismatch = [r["logprob_mismatch"] for r in runs[0]["async"]]
    assert None not in mismatch and max(mismatch) < ASYNC_MISMATCH, mismatch


def test_outputs_written(runs):
    import json

    records, out = runs
    for mode in ("sync", "async"):
        lines = (out / mode / "steps.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == records[mode]
        assert (out / mode / "run.png").stat().st_size > 10_000
