"""GRPO through a GenerationFleet: rollouts from vLLM engines, a transformers trainer, live refits.

    .venv/bin/python examples/grpo.py --mode sync  --steps 30 --out runs/sync     # CPU, the tiny model
    .venv/bin/python examples/grpo.py --mode async --steps 30 --out runs/async
    python examples/grpo.py --device gpu --model-size 1b --prompts 64 --group 8 --max-new-tokens 128 \
        --mode async --steps 20 --out runs/gpu-async                                # one GPU, colocated

Each step: ``fleet.generate(prompts, n=G)`` samples a group of G completions per prompt, with the
logprob of every sampled token -> a programmatic reward per completion -> advantages normalized
within each group -> one clipped policy-gradient step of the trainer (transformers, the same
checkpoint; fp32 on CPU, bf16 on CUDA) -> the trainer's live module pushed into the engines
(``fleet.refit(model)``, or ``fleet.weight_sync_client()`` driven by vLLM's trainer engine with
``nemo_gen_ipc`` on the GPU: the engines copy the weights straight out of the trainer's memory).

The task: *answer in digits*. The reward of a completion is the share of its tokens that are
digit tokens ("7", " 3"...). Why a random-weight model learns it in minutes: the tiny
tokenizer has 512 tokens of which 15 are digits, so the initial, nearly uniform policy scores
~0.03 and the ceiling is 1.0 — and raising the probability of one fixed class of tokens, whatever
the context, is what a policy gradient does fastest: every sampled digit pushes the same output
rows up, every other token pushes them down, and the group baseline tells the two apart (with
G=8 samples of 16 tokens most groups hold a completion with more digits than its siblings). No
knowledge is needed, only a shift of the output distribution. On CPU, at the defaults, the tiny
model's reward passes 0.5 after ~15 steps and 0.9 after ~20 in sync mode (async, which learns
from samples a step old, ~5 steps later): about 10 seconds of training after the fleet starts.

The loss (per sampled token t of completion i, A_i its group-normalized advantage):
    ratio = exp(logp_trainer(t) - logp_engine(t))          importance ratio against the sampler
    loss  = -mean_t min(ratio * A_i, clip(ratio, 1 - eps, 1 + eps) * A_i)
``logp_engine`` is what the fleet returned with the sample: the policy that actually sampled it.

``--mode sync``: on-policy. Generate, train, refit, generate again: every sample comes from the
trainer's current weights (its ``weight_versions`` say so), and the trainer waits for rollouts.

``--mode async``: one step off-policy. The next step's rollouts are started before the trainer
steps, so the engines generate while the trainer trains; the refit lands on running requests
with ``refit.in_flight: keep`` (they are frozen with their KV cache, the weights swapped under
them, and they resume), bounded by ``refit.max_staleness`` (when a request has more tokens than
that from older weights, the running requests go on with their KV recomputed by the new weights).
``--engine async`` runs the same on vLLM's AsyncLLM. A sample's staleness is the trainer's
version minus the oldest version in its ``weight_versions``; samples staler than ``--max-lag``
are DROPPED from the loss, not down-weighted: a clean cut, so that every gradient comes from
samples at most --max-lag versions behind the weights it updates. With one rollout in flight at
a time no sample is more than one step old, so the rule acts only if a refit goes missing.

``--colocated`` (GPU, sync): NeMo-RL's colocated layout. The engines sleep (vLLM's sleep mode,
level 1: weights to CPU memory, KV cache dropped) through each train step, so the trainer has
their memory; then wake(weights) -> refit -> wake(kv_cache), NeMo-RL's order.

Writes ``OUT/steps.jsonl`` (one line per step, appended as it ends) and ``OUT/run.png`` (the
reward curve, and each step's time stacked by phase).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nemo_gen.tiny_model import make_tiny_model

if TYPE_CHECKING:  # the trainer's half of this file runs without Ray or vLLM; main() imports them
    from nemo_gen import GenerationFleet, NemoGenSettings

# Model shapes the example can make (random-init Llamas with the tiny model's 512-token
# tokenizer); `lr` is the Adam learning rate that size gets unless --lr says otherwise.
MODEL_SIZES = {
    "tiny": dict(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256, lr=3e-3),
    "100m": dict(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048, lr=3e-4),
    "1b": dict(hidden_size=2048, num_layers=22, num_heads=32, intermediate_size=5632, lr=1e-4),  # 1.13 B
}

# ----------------------------------------------------------------------------- the task

SUBJECTS = ("the river", "the old mill", "the market", "the train", "the engine", "the fleet", "the baker",
            "the library", "the game on Sunday", "the weather", "the bridge", "the morning")
TEMPLATES = ("Tell me about {}:", "A note on {}:", "What happened at {}?", "Write about {}.", "{} today:")


class DigitTask:
    """Prompts about anything; the reward is the share of a completion's tokens that are digits."""

    def __init__(self, tokenizer):
        vocab = range(len(tokenizer))
        self.digits = {i for i in vocab if (s := tokenizer.decode([i]).strip()) and s.isascii() and s.isdigit()}
        self.chance = len(self.digits) / len(tokenizer)  # the reward of a uniform policy

    def prompts(self, n: int, rng: random.Random) -> list[str]:
        return [rng.choice(TEMPLATES).format(rng.choice(SUBJECTS)).capitalize() for _ in range(n)]

    def reward(self, token_ids: list[int]) -> float:
        return sum(t in self.digits for t in token_ids) / max(1, len(token_ids))


# ----------------------------------------------------------------------------- rollouts


@dataclass
class Completion:
    """One sample of a group, as the trainer needs it."""

    group: int
    prompt_ids: list[int]
    token_ids: list[int]
    engine_logprobs: list[float]
    weight_versions: list[tuple[int, int]]  # (version, tokens) spans, in generation order
    reward: float = 0.0
    advantage: float = 0.0


@dataclass
class Rollout:
    completions: list[Completion]
    started: float  # time.perf_counter() when generate was called
    ended: float

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def rollout(fleet: GenerationFleet, prompts: list[str], args) -> Rollout:
    """G samples of every prompt, at temperature 1 (the policy itself), with the sampled tokens'
    logprobs. ``ignore_eos``: every completion is --max-new-tokens long, so a reward that is a share
    of its tokens compares like with like."""
    started = time.perf_counter()
    results = fleet.generate(prompts, n=args.group, temperature=1.0, top_p=1.0, top_k=None,
                             max_new_tokens=args.max_new_tokens, ignore_eos=True)
    ended = time.perf_counter()
    completions = []
    for g, result in enumerate(results):
        if not result.ok:
            raise RuntimeError(f"prompt {g} failed: {result.error}")
        for s in result.samples:
            completions.append(Completion(g, list(result.prompt_token_ids), list(s.token_ids), list(s.logprobs),
                                          [tuple(span) for span in s.weight_versions]))
    return Rollout(completions, started, ended)


def group_advantages(completions: list[Completion]) -> None:
    """GRPO's baseline: each reward against its own group's mean, in units of the group's std
    (a group whose samples all scored the same teaches nothing: advantage 0)."""
    groups: dict[int, list[Completion]] = {}
    for c in completions:
        groups.setdefault(c.group, []).append(c)
    for members in groups.values():
        rewards = [c.reward for c in members]
        mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
        for c in members:
            c.advantage = (c.reward - mean) / (std + 1e-6) if std > 0 else 0.0


def staleness(c: Completion, version: int) -> int:
    """How many versions behind the trainer the oldest of the sample's tokens is."""
    return version - min(v for v, _ in c.weight_versions)


# ----------------------------------------------------------------------------- the trainer


class Trainer:
    """The policy: the checkpoint loaded with transformers, AdamW, the clipped policy-gradient
    step. ``step`` returns what the step did (loss, grad norm, clip fraction, logprob mismatch).

    The module runs in the engines' dtype (fp32 on CPU, bf16 on CUDA) and is what the refit
    reads; AdamW steps an fp32 master copy of every parameter, copied back into the module after
    each step (in place: the module's storages, which ``nemo_gen_ipc`` shares with the engines
    once, never move). In pure bf16 an Adam update smaller than half a bf16 step of its weight —
    most of them, at RL learning rates — would round away to nothing."""

    def __init__(self, model_dir: Path, args):
        from transformers import AutoModelForCausalLM

        self.device = torch.device("cuda" if args.device == "gpu" else "cpu")
        if self.device.type == "cpu":
            torch.set_num_threads(args.threads)  # the engines run on cores of their own
        dtype = torch.bfloat16 if args.device == "gpu" else torch.float32  # as the engines run it
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(self.device)
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.master, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.clip = args.clip
        self.micro_batch = args.micro_batch

    def _logprobs(self, batch: list[Completion]) -> tuple[torch.Tensor, torch.Tensor]:
        """The trainer's logprob of every sampled token, (rows, longest completion), and its mask.
        Rows are right-padded: causal attention never lets a real token see the padding after it."""
        longest = max(len(c.token_ids) for c in batch)
        ids = self._pad([c.prompt_ids + c.token_ids for c in batch], torch.long)
        # the logits at position p predict token p + 1: a completion's tokens from the prompt's last
        at = self._pad([range(len(c.prompt_ids) - 1, len(c.prompt_ids) - 1 + len(c.token_ids)) for c in batch],
                       torch.long, longest)
        targets = self._pad([c.token_ids for c in batch], torch.long, longest)
        mask = self._pad([[True] * len(c.token_ids) for c in batch], torch.bool, longest)
        logits = self.model(input_ids=ids).logits
        picked = logits[torch.arange(len(batch), device=self.device)[:, None], at].float()
        return torch.log_softmax(picked, dim=-1).gather(-1, targets[..., None])[..., 0], mask

    def _pad(self, rows, dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
        rows = [list(r) for r in rows]
        width = width or max(len(r) for r in rows)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=dtype).to(self.device)

    def step(self, batch: list[Completion], version: int) -> dict:
        """One optimizer step on ``batch``; ``version``: the version of the trainer's weights now."""
        for p in self.params:
            p.grad = None
        total = sum(len(c.token_ids) for c in batch)
        sums = torch.zeros(6, dtype=torch.float64, device=self.device)  # summed on the device: one sync a step
        for i in range(0, len(batch), self.micro_batch):
            part = batch[i:i + self.micro_batch]
            logp, mask = self._logprobs(part)
            engine = self._pad([c.engine_logprobs for c in part], torch.float32, logp.shape[1])
            advantage = torch.tensor([c.advantage for c in part], device=self.device)[:, None]
            ratio = torch.exp(logp - engine)
            clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
            objective = torch.minimum(ratio * advantage, clipped * advantage)
            loss = -(objective * mask).sum() / total  # a token-level mean over the whole batch
            loss.backward()
            with torch.no_grad():  # what the step saw: the ratio's clip, and trainer against engine
                # by whether the trainer's weights sampled the token (fresh) or older ones did
                fresh = self._pad([[v == version for v, n in c.weight_versions for _ in range(n)] for c in part],
                                  torch.bool, logp.shape[1]) & mask
                gap = (logp - engine).abs() * mask
                sums += torch.stack([loss, ((ratio != clipped) & mask).sum(), gap.sum(), (gap * fresh).sum(),
                                     fresh.sum(), (gap * (mask & ~fresh)).sum()]).double()
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float() if p.grad is not None else None
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.master, 1.0))
        self.optimizer.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                p.copy_(m)
        loss, clipped, gap, gap_fresh, n_fresh, gap_stale = sums.tolist()  # (waits for the step to finish)
        n_stale = total - n_fresh
        return {"loss": loss, "grad_norm": grad_norm, "clip_fraction": clipped / total,
                "logprob_mismatch": gap / total,
                "logprob_mismatch_fresh": gap_fresh / n_fresh if n_fresh else None,
                "logprob_mismatch_stale": gap_stale / n_stale if n_stale else None}


# ----------------------------------------------------------------------------- refit


class WeightPusher:
    """Pushes the trainer's live module into every shard at a given version.

    ``module``: ``fleet.refit(model)`` (staged through shared memory on the driver's node).
    ``client``: ``fleet.weight_sync_client()`` driven by one of vLLM's trainer engines — the path a
    trainer written against vLLM's refit API takes; on CUDA with ``nemo_gen_ipc`` (the engines were
    started with it, ``refit.backend``), on CPU with ``nemo_gen_shm``."""

    def __init__(self, fleet: GenerationFleet, model: torch.nn.Module, how: str, device: str, in_flight: str):
        self.fleet, self.model, self.how, self.in_flight = fleet, model, how, in_flight
        if how == "client":
            from vllm.distributed.weight_transfer.base import ModuleSource
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

            from nemo_gen.vllm_ext.vllm_backend import CudaIpcTrainerInitInfo, SharedMemoryTrainerInitInfo

            init = CudaIpcTrainerInitInfo() if device == "gpu" else SharedMemoryTrainerInitInfo()
            self.client = fleet.weight_sync_client(in_flight=in_flight)
            self.engine = WeightTransferTrainerFactory.trainer_init(init, client=self.client,
                                                                    source=ModuleSource(model))

    def push(self, version: int) -> None:
        if self.how == "client":
            self.client.version = version
            self.engine.send_weights()
            report = self.client.report
        else:
            report = self.fleet.refit(self.model, version=version, in_flight=self.in_flight)
        if not report.ok:
            raise RuntimeError(f"refit to version {version} failed: {report.to_json()}")

    def close(self) -> None:
        if self.how == "client":
            self.engine.shutdown()


# ----------------------------------------------------------------------------- the loop


def covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] inside at least one of the intervals."""
    spans = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, end = 0.0, lo
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def run(fleet: GenerationFleet, model_dir: Path, args, out: Path) -> list[dict]:
    """``args.steps`` GRPO steps on ``fleet`` from the checkpoint's weights; one record per step,
    also appended to ``out/steps.jsonl``. The fleet may have served anything before: the trainer's
    initial weights are pushed first, as the next version."""
    from transformers import AutoTokenizer

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    task = DigitTask(AutoTokenizer.from_pretrained(str(model_dir)))
    trainer = Trainer(model_dir, args)
    in_flight = "keep" if args.mode == "async" else "drain"
    pusher = WeightPusher(fleet, trainer.model, resolve_refit(args), args.device, in_flight)
    version = 0 if fleet.weight_version is None else fleet.weight_version + 1
    pusher.push(version)  # the engines now serve exactly the trainer's weights: `version`
    out.mkdir(parents=True, exist_ok=True)
    log = out / "steps.jsonl"
    log.write_text("")
    deadline = time.perf_counter() + args.max_seconds if args.max_seconds else math.inf
    records, busy = [], []  # busy: (start, end) of every rollout, train step and refit
    pool = ThreadPoolExecutor(1, thread_name_prefix="rollout")
    pending = pool.submit(rollout, fleet, task.prompts(args.prompts, rng), args) if args.mode == "async" else None
    try:
        for step in range(args.steps):
            last = step + 1 == args.steps or time.perf_counter() > deadline
            t0 = time.perf_counter()
            if args.mode == "sync":
                batch = rollout(fleet, task.prompts(args.prompts, rng), args)
            else:  # this step's rollouts started a step ago; the next step's start now, on `version`
                batch, submitted = pending.result(), time.perf_counter()
                pending = None if last else pool.submit(rollout, fleet, task.prompts(args.prompts, rng), args)
            waited = time.perf_counter() - t0
            for c in batch.completions:
                c.reward = task.reward(c.token_ids)
            group_advantages(batch.completions)
            stale = [staleness(c, version) for c in batch.completions]
            bound = args.max_lag if args.mode == "async" else None  # sync: on-policy by construction
            used = [c for c, s in zip(batch.completions, stale) if bound is None or s <= bound]

            t1 = time.perf_counter()
            if args.colocated:  # the engines give the trainer their memory (vLLM's sleep, level 1)
                fleet.sleep(1)
            t_slept = time.perf_counter()
            stats = trainer.step(used, version) if used else {"logprob_mismatch": None}
            t2 = time.perf_counter()
            if args.colocated:  # NeMo-RL's order: wake(weights) -> refit -> wake(kv_cache)
                fleet.wake(["weights"])
            pusher.push(version + 1)  # in async mode it lands on the running rollout (keep)
            if args.colocated:
                fleet.wake(["kv_cache"])
            t3 = time.perf_counter()
            busy += [(batch.started, batch.ended), (t1, t2), (t2, t3)]
            if pending is not None:  # the next step's rollout, running since it was submitted (or done)
                busy.append((submitted, pending.result().ended if pending.done() else t3))
            record = {"step": step, "mode": args.mode, "weight_version": fleet.weight_version,
                      "trainer_version": version, **describe(batch, stale, used), "wait_s": waited,
                      "train_s": t2 - t_slept, "refit_s": t3 - t2, "step_s": t3 - t0, "sleep_s": t_slept - t1,
                      "idle_s": (t3 - t0) - covered(busy, t0, t3), **stats}
            version += 1
            records.append(record)
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if not args.quiet:
                print(f"step {step:3d}  reward {record['reward_mean']:.3f}  trained v{record['trainer_version']}  "
                      f"{record['step_s']:.2f}s (wait {waited:.2f} train {t2 - t_slept:.2f} refit {t3 - t2:.3f})  "
                      f"staleness {record['staleness']}  mismatch {fmt(record['logprob_mismatch'])}", flush=True)
            if last:
                break
    finally:
        if pending is not None:
            pending.exception()  # waits for a rollout still running (the fleet serves the next caller)
        pool.shutdown(wait=True)
        pusher.close()
    return records


def describe(batch: Rollout, stale: list[int], used: list[Completion]) -> dict:
    """A step's samples: rewards, tokens, the versions that sampled them, their staleness."""
    rewards = [c.reward for c in batch.completions]
    versions: dict[int, int] = {}
    for c in batch.completions:
        for v, n in c.weight_versions:
            versions[v] = versions.get(v, 0) + n
    return {"reward_mean": statistics.fmean(rewards), "reward_std": statistics.pstdev(rewards),
            "samples": len(rewards), "used": len(used), "dropped": len(rewards) - len(used),
            "tokens": sum(len(c.token_ids) for c in batch.completions), "rollout_s": batch.seconds,
            "sample_versions": {str(v): n for v, n in sorted(versions.items())},  # tokens per version
            "staleness": {str(s): stale.count(s) for s in sorted(set(stale))},  # samples per staleness
            "spanning_versions": sum(len(c.weight_versions) > 1 for c in batch.completions)}


def fmt(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def resolve_refit(args) -> str:
    return args.refit if args.refit != "auto" else ("client" if args.device == "gpu" else "module")


# ----------------------------------------------------------------------------- set-up and outputs


def make_model(args) -> Path:
    """``--model DIR`` as given, or a random-init Llama of ``--model-size`` made locally (once)."""
    if args.model:
        return Path(args.model)
    shape = {k: v for k, v in MODEL_SIZES[args.model_size].items() if k != "lr"}
    return make_tiny_model(Path(args.work) / f"llama-{args.model_size}-seed{args.seed}", seed=args.seed, **shape)


def fleet_settings(args, model_dir: Path, overrides: dict | None = None) -> NemoGenSettings:
    """A train-mode fleet (dummy weights until the trainer's first push) able to take refits
    in flight; on the GPU one shard beside the trainer, bf16, CUDA graphs, ``nemo_gen_ipc``."""
    from nemo_gen import NemoGenSettings

    base = {
        "model.path": str(model_dir), "fleet.name": "grpo", "fleet.mode": "train", "fleet.num_shards": args.shards,
        "fleet.device": args.device, "refit.in_flight": "keep", "refit.max_staleness": args.max_staleness_tokens,
        "refit.recompute_kv": args.recompute_kv, "generation.vllm_cfg.max_model_len": args.max_model_len,
        "generation.vllm_cfg.async_engine": args.engine == "async",
    }
    if args.colocated:  # engines with vLLM's sleep mode: asleep while the trainer steps
        base["generation.colocated.enabled"] = True
    if args.device == "gpu":
        base.update({"refit.backend": "nemo_gen_ipc", "generation.vllm_cfg.precision": "bfloat16",
                     "generation.vllm_cfg.enforce_eager": False, "fleet.shards_per_gpu": args.shards,
                     "generation.vllm_cfg.gpu_memory_utilization": args.gpu_memory_utilization})
    return NemoGenSettings.load(overrides={**base, **(overrides or {})})


def title(args) -> str:
    return (f"GRPO, {args.mode}: {args.model_size} model on {args.device.upper()}, {args.prompts} prompts x "
            f"{args.group} samples x {args.max_new_tokens} tokens")


PHASES = (("wait_s", "waiting for rollouts"), ("train_s", "train"), ("refit_s", "refit"))


def plot(records: list[dict], path: Path, title: str) -> None:
    """The reward curve (mean +- std over the step's samples) and each step's time stacked by phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
    mean = [r["reward_mean"] for r in records]
    std = [r["reward_std"] for r in records]
    top.plot(steps, mean, marker="o", ms=3, label="reward (mean over samples)")
    top.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    top.set_ylim(0, 1.05)
    top.set_ylabel("reward: share of digit tokens")
    top.set_title(title)
    top.legend(loc="lower right")
    below = [0.0] * len(records)
    for key, label in PHASES:
        values = [r[key] for r in records]
        bottom.bar(steps, values, bottom=below, label=label)
        below = [b + v for b, v in zip(below, values)]
    other = [max(0.0, r["step_s"] - b) for r, b in zip(records, below)]
    bottom.bar(steps, other, bottom=below, label="other")
    bottom.plot(steps, [r["rollout_s"] for r in records], "k.", ms=4, label="rollout (generate call)")
    bottom.set_xlabel("step")
    bottom.set_ylabel("seconds")
    bottom.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(records: list[dict], timing_only: bool = False) -> dict:
    """A run in numbers: the step's phases (medians over every step after the first, which pays
    for warm-up), their shares of a step, the logprob mismatch, the reward over the first and last
    5 steps. ``timing_only``: the phases alone (``records`` may then be several runs' steps)."""
    later = records if timing_only else (records[1:] or records)
    med = lambda key: statistics.median(r[key] for r in later)  # noqa: E731
    share = lambda key: statistics.fmean(r[key] / r["step_s"] for r in later)  # noqa: E731
    timing = {"step_s": med("step_s"), "steps_per_s": 1 / med("step_s"), "wait_s": med("wait_s"),
              "train_s": med("train_s"), "refit_s": med("refit_s"), "rollout_s": med("rollout_s"),
              "refit_share": share("refit_s"), "idle_share": share("idle_s"), "trainer_wait_share": share("wait_s"),
              "tokens_per_s": statistics.fmean(r["tokens"] for r in later) / med("step_s")}
    if timing_only:
        return timing
    mismatch = [r["logprob_mismatch"] for r in records if r["logprob_mismatch"] is not None]
    return {"steps": len(records), "reward_first5": statistics.fmean(r["reward_mean"] for r in records[:5]),
            "reward_last5": statistics.fmean(r["reward_mean"] for r in records[-5:]), **timing,
            "logprob_mismatch_max": max(mismatch) if mismatch else None,
            "logprob_mismatch_mean": statistics.fmean(mismatch) if mismatch else None,
            "tokens_per_step": statistics.fmean(r["tokens"] for r in records)}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=("sync", "async"), default="sync",
                   help="sync: on-policy; async: the next step's rollouts run while the trainer steps")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-seconds", type=float, help="stop after the step that passes this many seconds")
    p.add_argument("--seed", type=int, default=0, help="the model's random init, the prompts, the trainer's RNG")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="gpu: trainer and one engine share one CUDA device (bf16, nemo_gen_ipc refit)")
    p.add_argument("--out", default=".nemo-gen/grpo", help="steps.jsonl and run.png go here")
    task = p.add_argument_group("task")
    task.add_argument("--prompts", type=int, default=8, help="prompts per step")
    task.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    task.add_argument("--max-new-tokens", type=int, default=16, help="tokens per completion")
    model = p.add_argument_group("model and trainer")
    model.add_argument("--model-size", choices=tuple(MODEL_SIZES), default="tiny",
                       help="random-init Llama made locally: tiny (0.4 M params), 100m, 1b (1.13 B)")
    model.add_argument("--model", help="an HF Llama checkpoint directory to start from instead")
    model.add_argument("--work", default=".nemo-gen/grpo-models", help="where --model-size models are made")
    model.add_argument("--lr", type=float, help="AdamW learning rate (default: the model size's)")
    model.add_argument("--clip", type=float, default=0.2, help="the ratio's clip range (eps)")
    model.add_argument("--micro-batch", type=int, default=64, help="completions per forward/backward")
    model.add_argument("--threads", type=int, default=1, help="the CPU trainer's torch threads")
    fleet = p.add_argument_group("fleet and refit")
    fleet.add_argument("--shards", type=int, default=1)
    fleet.add_argument("--refit", choices=("auto", "module", "client"), default="auto",
                       help="module: fleet.refit(model); client: fleet.weight_sync_client() through vLLM's "
                       "trainer engine (nemo_gen_ipc on GPU, nemo_gen_shm on CPU); auto: client on GPU")
    fleet.add_argument("--max-lag", type=int, default=1, help="async: samples more versions behind are dropped")
    fleet.add_argument("--max-staleness-tokens", type=int, default=8,
                       help="refit.max_staleness: a running request with more tokens from older weights is "
                       "cut and resumed on the new ones when a refit lands")
    fleet.add_argument("--engine", choices=("sync", "async"), default="sync",
                       help="vLLM's engine in each shard: LLM (sync) or AsyncLLM (async); refits land in "
                       "flight on either (generation.vllm_cfg.async_engine)")
    fleet.add_argument("--recompute-kv", action="store_true",
                       help="refit.recompute_kv: requests a refit keeps running recompute their KV on the "
                       "new weights (NeMo-RL's recompute_kv_cache_after_weight_updates)")
    fleet.add_argument("--max-model-len", type=int, default=256)
    fleet.add_argument("--gpu-memory-utilization", type=float, default=0.35,
                       help="the engine's share of the GPU (the trainer lives in the rest)")
    fleet.add_argument("--colocated", action="store_true",
                       help="NeMo-RL's colocated layout (GPU, sync): the engines sleep through each train step "
                       "and wake for the refit and the next rollout (generation.colocated.enabled)")
    p.add_argument("-q", "--quiet", action="store_true", help="no line per step")
    return p


def parse_args(argv=None, p: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    p = p or parser()
    args = p.parse_args(argv)
    if args.colocated and (args.device != "gpu" or args.mode != "sync"):
        p.error("--colocated needs --device gpu (vLLM's CPU worker ignores sleep) and --mode sync "
                "(the engines sleep while the trainer steps: no rollout can overlap it)")
    if args.lr is None:
        args.lr = MODEL_SIZES[args.model_size]["lr"]
    return args


def main(argv=None) -> dict:
    import os

    from nemo_gen import GenerationFleet

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing comes from a model hub
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args = parse_args(argv)
    out = Path(args.out)
    model_dir = make_model(args)
    with GenerationFleet.launch(fleet_settings(args, model_dir)) as fleet:
        records = run(fleet, model_dir, args, out)
    plot(records, out / "run.png", title(args))
    result = summary(records)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
