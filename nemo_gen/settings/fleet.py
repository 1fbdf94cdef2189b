"""The ``fleet``, ``refit`` and ``health`` sections and their defaults: the fleet's shape and
engine processes, weight refit, and the health policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from nemo_gen.core.migration import MigrationMode
from nemo_gen.core.modes import RefitMode
from nemo_gen.core.waves import Rollout
from nemo_gen.settings.base import Section, one_of


class MigrationSettings(Section):
    mode: MigrationMode = Field(
        MigrationMode.ON, description="on: the driver checkpoints every running request's tokens (their "
        "logprobs and weight versions), and when a shard is lost (dead, condemned by its probes, drained) "
        "each of its requests goes on on a healthy shard from its prompt plus the tokens it had made, so "
        "the work it did is kept (a loss that kept tokens does not count against fleet.max_reroutes). "
        "off: a lost shard's requests start again from their prompts.",
    )
    checkpoint_s: float = Field(
        0.1, gt=0, description="How often the driver asks each busy shard for its running requests' new "
        "tokens (one small call per busy shard). A loss throws away at most the tokens made since the "
        "last checkpoint, so a shorter period wastes less when a shard dies, at one call per period "
        "(bench migration measures both).",
    )

    @model_validator(mode="after")
    def _cadence_acts(self) -> "MigrationSettings":
        # A cadence given with migration off would be accepted and do nothing.
        if self.mode == MigrationMode.OFF and "checkpoint_s" in self.model_fields_set:
            raise ValueError("fleet.migration.checkpoint_s is set but fleet.migration.mode is off: "
                             "nothing is checkpointed (drop it, or set mode: on)")
        return self


class FleetSettings(Section):
    name: str = Field("default", description="Fleet name (Ray namespace suffix, artifact titles).")
    num_shards: int = Field(2, ge=1, description="Engines serving traffic; each is one Ray actor.")
    mode: Literal["eval", "train"] = Field(
        "eval",
        description="eval: engines load the model's weights (is_eval=True). train: engines start "
        "with dummy weights and serve only after the first refit.",
    )
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="Where engines run; auto: gpu when the Ray cluster has GPUs."
    )
    cpus_per_worker: float = Field(
        1.0, gt=0, description="Ray CPUs reserved per engine rank (one bundle per rank)."
    )
    omp_threads_per_engine: int = Field(
        1, ge=1, description="OMP threads per CPU engine rank, so engines don't oversubscribe cores."
    )
    cpu_kvcache_space_gb: float = Field(
        1.0, gt=0, description="KV cache per CPU engine in whole GiB (VLLM_CPU_KVCACHE_SPACE, which vLLM "
        "reads as an integer).",
    )
    engine_niceness: int = Field(
        0, ge=0, le=19, description="Nice value of each shard's processes (its actor, EngineCore and "
        "workers). Ray starts workers at 15, which makes a serving engine's host side (scheduling, output "
        "processing: the bound of a GPU engine's step at large batches) yield the CPU to everything else "
        "on the node; raise it to let other work on a shared node go first.",
    )
    engine_core_start: Literal["forkserver", "spawn"] = Field(
        "forkserver", description="How a shard starts its vLLM EngineCore process. forkserver: forked from a "
        "server the shard actor starts first thing, which imports vLLM while the actor does, so the "
        "EngineCore starts with vLLM imported, as a bare vllm.LLM's does; on CPU it forks its worker (the "
        "process vLLM's CPU backend runs the model in) too, which spawn would make a third fresh interpreter "
        "importing vLLM. spawn: vLLM's own start inside a "
        "Ray actor, a fresh interpreter that imports vLLM and torch again before it can load "
        "(bench/results/2026-12-03/h200-b.md). An engine with numa_bind is always spawned.",
    )
    engine_start_timeout_s: float = Field(600.0, gt=0, description="Deadline for one engine to load.")
    placement_timeout_s: float = Field(
        30.0, gt=0, description="Deadline for the cluster to place a shard; then a PlacementError."
    )
    request_timeout_s: float | None = Field(
        None, gt=0, description="Default deadline of one request: a generate call's prompts, a stream "
        "between two of its tokens (a call's timeout_s= overrides it). Past it the request fails with "
        "RequestTimeout (HTTP 504) and is aborted on its engine; its shard is not at fault and serves on. "
        "Unset: no deadline, so a healthy shard finishes a generation of any length; a shard that stops "
        "making progress is found by its probes (health.probe_*), not by a request's deadline.",
    )
    max_reroutes: int = Field(
        2, ge=0, description="Times one request is sent again after the shard serving it died; past it "
        "the request fails with ShardDiedError (in a batch: that prompt's result carries the error).",
    )
    migration: MigrationSettings = Field(
        default_factory=MigrationSettings, description="Requests on a lost shard go on elsewhere from their "
        "tokens (nemo_gen.core.migration).",
    )
    busy_retries: int = Field(
        3, ge=0, description="Times one request is offered to another shard after a shard refused it for "
        "now (busy: vLLM's queue full, HTTP 429/503, Ray's pending-call limit), with fleet.busy_backoff_s "
        "between tries; past it the request fails with FleetBusy (HTTP 503 + Retry-After). A busy shard "
        "is never condemned.",
    )
    busy_backoff_s: float = Field(
        0.1, ge=0, description="First wait before a busy request is offered again; doubles per try.",
    )
    max_pending_requests: int | None = Field(
        None, ge=1, description="Requests (prompts; n samples of one prompt count once) the fleet holds "
        "at once, across its shards. A call that would go past it fails at once with FleetBusy "
        "(HTTP 503 + Retry-After) and nothing of it is sent. Unset: no bound.",
    )
    control_timeout_s: float = Field(
        10.0, gt=0, description="Deadline for a control call on a shard actor (info, assign): a live "
        "actor answers at once, so silence this long means it is gone or wedged.",
    )
    stop_timeout_s: float = Field(
        60.0, gt=0, description="How long a shard gets to stop its engine cleanly before its actor is killed.",
    )
    engine_stop_grace_s: float = Field(
        1.0, ge=0, description="In a clean stop, how long the engine's processes get to exit after vLLM "
        "signals them before vLLM kills them (its shutdown timeout; vLLM's own default is 5 s, which its "
        "clean teardown uses up). The processes hold nothing that outlives them, and the fleet checks "
        "they are gone.",
    )
    spares: int = Field(
        0, ge=0, description="Warm spares: extra engines loaded and refit with the fleet but given no "
        "traffic; one takes a dead shard's place at once.",
    )
    session_affinity_slack: int = Field(
        4, ge=0, description="A session's next turn (session_id) goes to the shard that served its last "
        "one, where its prompt's KV is cached, while that shard serves and has at most this many more "
        "requests in flight than the least-loaded shard; otherwise the least-loaded shard, and the session moves.",
    )
    shards_per_gpu: int = Field(
        1, ge=1, description="Engines per GPU (GPU only): each shard's bundle takes 1/k of a GPU (Ray "
        "fractional GPUs), so k small engines share one device; k x generation.vllm_cfg."
        "gpu_memory_utilization must then leave GPU_SHARE_HEADROOM of the device free. Engines that "
        "share a GPU start one at a time. k > 1 needs tensor_parallel_size x pipeline_parallel_size = 1.",
    )

    @field_validator("cpu_kvcache_space_gb")
    @classmethod
    def _whole_gib(cls, value: float) -> float:
        # vLLM's CPU backend reads VLLM_CPU_KVCACHE_SPACE with int(): 0.5 would be accepted here
        # and kill every engine at its start.
        if not float(value).is_integer():
            raise ValueError("must be a whole number of GiB (vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer)")
        return value


class RefitSettings(Section):
    bucket_bytes: int = Field(
        256 * 2**20, ge=1, description="Bytes read from the source per bucket while staging a refit."
    )
    staging_dir: Path = Field(
        Path("/dev/shm"), description="Directory of the shared-memory staging file (CPU transport): "
        "each process's file, 0600 under a random name, lies in nemo_gen-<fleet>-uid<uid>/ (0700) "
        "here; it must hold the whole model, or a refit is refused before a byte is written.",
    )
    digest: bool = Field(
        True, description="A staged refit hashes every tensor on the trainer's side and every shard "
        "hashes the bytes it would load (the wd1 content digest, on the weights' own device): a shard "
        "whose bytes differ loads nothing and is quarantined, naming the tensor, and every result "
        "carries the digest of the weights that made each span (weight_digests). Off: no check, and "
        "results carry no digest; it saves one more read of the weights per side.",
    )
    timeout_s: float = Field(
        600.0, gt=0, description="Deadline for each refit phase on a shard, the load's wait for running "
        "requests (in_flight drain) included: a shard that has not answered by then is quarantined and "
        "replaced, so a frozen shard holds the refit this long and no longer.",
    )
    control_channel: bool = Field(
        True, description="The refit's calls to a shard on the driver's own node go over a Unix socket "
        "the shard actor serves (authenticated, weight_sync only), not a Ray actor call, whose task "
        "submission and reply each way cost more than the copy of a colocated nemo_gen_ipc refit of a "
        "mid-sized model. Shards on other nodes, and any call the line cannot carry, go over Ray.",
    )
    backend: str = Field(
        "nemo_gen_shm",
        min_length=1,
        description="vLLM weight-transfer backend the engines start with (weight_transfer_config), "
        "used by trainers that drive fleet.weight_sync_client(): 'nemo_gen_shm' (shared memory, any "
        "device), 'nemo_gen_ipc' (CUDA IPC from a trainer on the engines' GPU, handles shared once), "
        "or vLLM's own 'ipc' (trainer on the engines' GPU; its engines start with "
        "VLLM_ALLOW_INSECURE_SERIALIZATION=1, which its handles need) / 'nccl' (trainer on other GPUs); any "
        "backend registered in the installed vLLM's weight-transfer factory is accepted.",
    )
    draft: bool = Field(
        False,
        description="Refits carry the speculative drafter's weights (names under 'draft.'): "
        "configure_generation_config(has_refit_draft_weights=True).",
    )
    draft_full: bool = Field(
        False,
        description="Draft refits carry the drafter's full state dict, not a partial set "
        "(NeMo-RL's draft_full_refit_enabled, true for Automodel draft co-training).",
    )
    quantize: Literal["engine", "trainer"] = Field(
        "engine",
        description="Where an FP8 fleet's (generation.vllm_cfg.precision: fp8) weights are quantized on a "
        "refit from a trainer's live tensors: 'engine' (bf16 on the wire, vLLM's online FP8 path quantizes "
        "at load) or 'trainer' (the trainer engines of fleet.weight_sync_client() send the linear layers as "
        "fp8 with one scale per fused layer: half their bytes; the engine loads them through the same "
        "path). Checkpoint refits are read from disk as they are and quantized in the engine. 'trainer' "
        "needs precision fp8.",
    )
    in_flight: RefitMode = Field(
        RefitMode.DRAIN,
        description="What a refit does to requests running on a shard: 'drain' waits for them to finish "
        "(strict on-policy); 'abort' stops them at once and, with refit.resume_aborted, sends each on as "
        "prompt + its tokens so far on the new weights; 'keep' freezes them with their KV cache, swaps the "
        "weights and resumes them (results then span two versions: GenerationResult.weight_versions). "
        "All three work on the sync and the async engine (generation.vllm_cfg.async_engine).",
    )
    resume_aborted: bool = Field(
        True,
        description="With refit.in_flight abort (or a keep request past refit.max_staleness): resubmit a "
        "cut request on the new weights so the caller gets one complete result; false: the caller gets the "
        "partial result with finish_reason 'abort'.",
    )
    max_staleness: int | None = Field(
        None, ge=0,
        description="With refit.in_flight keep: a running request with more than this many tokens from "
        "older weights is cut and resumed on the new ones (its prefix re-computed); unset: no bound. vLLM "
        "preempts the running requests together, so every one of them is re-computed when one is past "
        "the bound.",
    )
    rollout: Rollout = Field(
        Rollout.ALL,
        description="How a refit reaches the shards: 'all' moves every shard at once (each pauses or drains "
        "together, per refit.in_flight); 'waves' moves refit.wave_size shards at a time while the others "
        "serve, so the fleet never stops serving and no request is cut: new requests go to the newest "
        "version serving, a session stays on its version until it ends or passes refit.max_staleness.",
    )
    wave_size: int | None = Field(
        None, ge=1,
        description="With refit.rollout waves: shards moved at a time (unset: 1). Larger waves finish "
        "the roll sooner and leave fewer shards serving meanwhile.",
    )
    min_serving: int | None = Field(
        None, ge=1,
        description="With refit.rollout waves: the fewest shards that serve at any moment of the roll "
        "(unset: fleet.num_shards - refit.wave_size); a wave shrinks, or the roll stops, rather than go under it.",
    )
    recompute_kv: bool = Field(
        False,
        description="With refit.in_flight keep: the running requests' KV cache (and the prefix cache) is "
        "re-computed on the new weights as they resume, instead of kept (NeMo-RL's "
        "recompute_kv_cache_after_weight_updates). Their tokens keep the versions that sampled them.",
    )

    @field_validator("backend")
    @classmethod
    def _registered_backend(cls, value: str) -> str:
        from nemo_gen.config import vllm_choices

        return one_of(value, vllm_choices.weight_transfer_backends(), "a registered weight-transfer backend")


class HealthSettings(Section):
    enabled: bool = Field(
        True,
        description="Fleet health on: the ledger gates serving and the raylet is asked to reap a "
        "dead shard's engine processes (maybe_configure_engine_reaping_env).",
    )
    unhealthy_threshold: int = Field(3, ge=1, description="Failures in a row that condemn a shard.")
    healthy_threshold: int = Field(2, ge=1, description="Probe successes that clear a SUSPECT shard.")
    max_restart_attempts_per_shard: int = Field(5, ge=0, description="Restarts before RETIRED.")
    min_healthy_shards: int = Field(1, ge=1, description="Below this the fleet raises FleetExhausted.")
    probe_interval_s: float = Field(
        5.0, gt=0, description="Seconds between real-generation probes (one token) of each serving shard; "
        "on the same beat the fleet fetches each serving shard's vLLM stats, which /metrics serves."
    )
    probe_timeout_s: float = Field(
        10.0, gt=0, description="A probe not answered within this counts as a failure (a hung engine)."
    )
    warmup_grace_s: float = Field(
        120.0, gt=0, description="While a batch's first step (its prefill; on a fresh engine also kernel "
        "selection) runs, a probe counts the busy engine as alive for this long instead of "
        "health.probe_timeout_s. A hang later in the batch is caught within probe_timeout_s.",
    )
    watch_interval_s: float = Field(
        0.2, gt=0, description="How often a shard actor checks that its engine processes are alive."
    )
    restart_backoff_s: float = Field(
        1.0, ge=0, description="First delay between restart attempts; doubles per attempt."
    )
    restart_backoff_max_s: float = Field(30.0, ge=0, description="Cap on the delay between restart attempts.")
    restart_jitter: float = Field(
        0.5, ge=0, description="Random extra delay, as a fraction of each backoff (restarts spread out)."
    )
    reap_timeout_s: float = Field(
        10.0, gt=0, description="How long a dead shard's engine processes get to exit before nemo_gen "
        "kills them (unless RAY_process_group_cleanup_enabled=0 was set)."
    )
    auto_recover: bool = Field(
        True, description="GenerationFleet restarts dead shards itself (in a background thread) "
        "when used as a library; the heal flow does it under Prefect's retry policy.",
    )

