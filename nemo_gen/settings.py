"""Every nemo_gen setting and its default — the only place defaults live.

Sources, lowest to highest precedence: field defaults < a YAML file < ``NEMO_GEN_*`` environment
variables (``__`` nests: ``NEMO_GEN_FLEET__NUM_SHARDS=4``) < overrides (the CLI's
``--set fleet.num_shards=4``, or a dict of dotted keys). ``NemoGenSettings.load`` validates once
and turns every problem into one ``ConfigError`` that names the dotted field and the file.

The YAML file is read as NeMo-RL reads its recipes (``nemo_gen.config.loader``: OmegaConf,
``defaults:`` inheritance, interpolations, NeMo-RL's resolvers). The ``generation`` section holds
the keys of NeMo-RL's ``GenerationConfig``/``VllmConfig`` that nemo_gen acts on; NeMo-RL's others
are accepted only with values that ask for nothing missing, and listed in ``settings.not_used``.
Enumerated values are checked against what exists: the installed vLLM's dtypes, KV cache dtypes,
load formats, engine arguments and weight-transfer backends (``nemo_gen.config.vllm_choices``), and the
generation backends ``resolve_generation_class`` knows. ``to_generation_config()`` hands the
plain dict that NeMo-RL's functions (``configure_generation_config``) expect.
"""

from __future__ import annotations

import contextvars
import logging
import os
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from nemo_gen.errors import ConfigError

ENV_PREFIX = "NEMO_GEN_"

log = logging.getLogger(__name__)
# fleet.shards_per_gpu > 1: the engines' gpu_memory_utilization shares may add up to at most
# 1 - this, leaving room for each engine process's CUDA context and allocator (outside its share).
GPU_SHARE_HEADROOM = 0.05


class _Section(BaseModel):
    """A settings section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# --------------------------------------------------------------------------------------------
# model


class ModelSettings(_Section):
    path: Path | None = Field(
        None,
        description="HF model directory (config.json + safetensors + tokenizer). Unset: the tiny "
        "random-weight Llama made locally under `home`/tiny-model on first use.",
    )
    tokenizer: Path | None = Field(
        None, description="Tokenizer directory, when it is not the model directory."
    )
    name: str | None = Field(
        None, description="Name reported in results and artifacts; defaults to the directory name."
    )


# --------------------------------------------------------------------------------------------
# generation: NeMo-RL's GenerationConfig + VllmConfig, the keys nemo_gen acts on. NeMo-RL's
# other keys (colocation, HTTP server, its refit transports, ...) are nemo_gen.config.loader's
# NEMO_RL_KEYS: read, shown as not used, or refused when they ask for something missing.


def _one_of(value: str, choices: Sequence[str] | None, what: str, hint: str = "") -> str:
    """``value`` if it is one of ``choices`` (None: vLLM is not installed here, nothing to
    check against), else a ValueError listing them."""
    if choices is not None and value not in choices:
        from nemo_gen.config.loader import suggest

        raise ValueError(f"{value!r} is not {what}{suggest(value, choices)} (known: {', '.join(choices)}){hint}")
    return value


class LoraCfg(_Section):
    enabled: bool = Field(
        False, description="Engines start with LoRA (vLLM's enable_lora): fleet.refit_adapter loads adapters, "
        "generate(..., adapter=name) selects one (docs/lora.md).",
    )
    max_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = Field(
        16, description="The largest adapter rank the engines take (vLLM's max_lora_rank; one of its ranks).",
    )
    max_adapters: int = Field(
        4, ge=1, description="Adapters held by every engine at once, all servable in one batch (vLLM's max_loras "
        "and max_cpu_loras). A refit past it evicts the least recently used adapter with no request in flight.",
    )


class VllmCfg(_Section):
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel ranks per shard.")
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM pipeline stages per shard.")
    expert_parallel_size: int = Field(
        1, ge=1, description="vLLM expert parallel size (MoE): 1, or tensor_parallel_size (vLLM's EP "
        "spans one engine's TP ranks; nemo_gen shards are separate engines, with no data parallelism).",
    )
    gpu_memory_utilization: float = Field(
        0.6, gt=0, le=1, description="Fraction of GPU memory vLLM may take (GPU only; on CPU the KV "
        "cache is fleet.cpu_kvcache_space_gb).",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + generation in tokens; unset: the model's maximum."
    )
    precision: str = Field(
        "auto",
        description="Model dtype: one of the installed vLLM's dtypes (auto, half, float16, bfloat16, "
        "float, float32) or fp8 (bfloat16 weights + vLLM's fp8 quantization). auto: the checkpoint's "
        "dtype on GPU, float32 on CPU.",
    )
    kv_cache_dtype: str = Field(
        "auto", description="KV cache dtype: one of the installed vLLM's CacheDType values (auto, fp8, "
        "fp8_e4m3, fp8_e5m2, ...).",
    )
    load_format: str | None = Field(
        None,
        description="vLLM load format (one of the installed vLLM's LoadFormats). Unset: "
        "configure_generation_config picks auto (eval) or dummy (train: weights arrive by refit).",
    )
    enforce_eager: bool | None = Field(
        None,
        description="Disable CUDA graphs / torch.compile. Unset: true on CPU (compiling costs minutes "
        "on a small CPU machine), false on GPU.",
    )
    async_engine: bool = Field(
        False, description="Run vLLM's AsyncLLM in each shard (concurrent per-request serving)."
    )
    skip_tokenizer_init: bool | None = Field(
        None,
        description="Engines skip loading the tokenizer (prompts go as token ids). Unset: "
        "configure_generation_config decides (false for eval, or when stop_strings or bad_words are "
        "set: the engine needs its tokenizer for them).",
    )
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        "processed_logprobs", description="Which logprobs vLLM returns (after or before sampling's processing)."
    )
    enable_prefix_caching: bool | None = Field(
        None, description="vLLM prefix caching; unset: vLLM's default."
    )
    enable_vllm_metrics_logger: bool | None = Field(
        None, description="vLLM logs its engine stats (throughput, KV cache use, queue) every "
        "vllm_metrics_logger_interval seconds, in each engine's log (Ray's log files; -v shows them), and "
        "the server's /metrics serves them (as the fleet fetched them last, every health.probe_interval_s). "
        "Unset or false: stats logging off.",
    )
    vllm_metrics_logger_interval: float | None = Field(
        None, gt=0, description="Seconds between vLLM's stats lines (VLLM_LOG_STATS_INTERVAL in the "
        "engine processes) when enable_vllm_metrics_logger is true; unset: vLLM's 10 s.",
    )
    use_deep_gemm: bool | None = Field(
        None, description="vLLM's DeepGEMM fp8 kernels (VLLM_USE_DEEP_GEMM in the engine processes; "
        "GPU only). Unset: vLLM's default.",
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="Environment variables set in every engine process, names kept "
        "as written (from a file, NEMO_GEN_* variables or --set). A name must be letters, digits and _, "
        "not starting with a digit; a number is taken as its text. A variable the fleet sets itself "
        "(OMP_NUM_THREADS and the VLLM_CPU_* of a CPU fleet, VLLM_ALLOW_INSECURE_SERIALIZATION, "
        "RAY_process_group_cleanup_enabled, ...: nemo_gen.core.engine_args.FLEET_ENV) is refused, naming "
        "the setting that controls it.",
    )
    expose_http_server: bool = Field(
        False, description="The fleet serves itself over the OpenAI-compatible HTTP server (nemo_gen.server) "
        "at server.host:server.port while it runs (fleet.http_url); the engines then load their tokenizer. "
        "`nemo-gen serve` starts the same server by itself.",
    )
    lora: LoraCfg = Field(default_factory=LoraCfg, description="LoRA adapters (nemo_gen.fleet.adapters).")
    worker_extension_cls: str | None = Field(
        None,
        description="Class mixed into vLLM workers (vLLM backend only); must subclass "
        "nemo_gen.vllm_ext.worker_ext.NemoGenWorkerExtension, which refit relies on.",
    )

    @field_validator("precision")
    @classmethod
    def _known_precision(cls, value: str) -> str:
        from nemo_gen.config import vllm_choices

        return _one_of(value, vllm_choices.precisions(), "a precision vLLM knows")

    @field_validator("kv_cache_dtype")
    @classmethod
    def _known_kv_cache_dtype(cls, value: str) -> str:
        from nemo_gen.config import vllm_choices

        return _one_of(value, vllm_choices.kv_cache_dtypes(), "a KV cache dtype of the installed vLLM")

    @field_validator("load_format")
    @classmethod
    def _known_load_format(cls, value: str | None) -> str | None:
        from nemo_gen.config import vllm_choices

        if value is None:
            return value
        return _one_of(value, vllm_choices.load_formats(), "a load format of the installed vLLM",
                       "; a plugin's format goes verbatim in generation.vllm_kwargs.load_format")

    @field_validator("expert_parallel_size")
    @classmethod
    def _expert_parallel_within_an_engine(cls, ep: int, info: ValidationInfo) -> int:
        tp = info.data.get("tensor_parallel_size", 1)
        if ep not in (1, tp):
            raise ValueError(
                f"expert_parallel_size {ep} needs vLLM data parallelism (EP = DP x TP), which nemo_gen "
                f"shards do not use (each is one engine); use 1 or tensor_parallel_size ({tp})"
            )
        return ep

    @field_validator("env_vars", mode="before")
    @classmethod
    def _numbers_as_text(cls, value: Any) -> Any:
        # `--set ...env_vars.CUDA_LAUNCH_BLOCKING=1` and YAML's `KEY: 1` parse as numbers; an
        # environment holds their text. Booleans stay refused: True would read "True", not "1".
        if isinstance(value, Mapping):
            return {k: str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                    for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _env_var_names(self) -> "VllmCfg":
        """Names an environment can hold, none the fleet sets itself (on any device; a CPU fleet's
        own are checked where the device is known)."""
        from nemo_gen.core.engine_args import env_var_problems

        problems = env_var_problems(self.env_vars, device=None)
        if problems:
            raise _invalid_keys(type(self).__name__, ("env_vars",), problems, self.env_vars)
        return self


class GenerationSettings(_Section):
    backend: str = Field(
        "vllm", description="Generation backend, resolved by resolve_generation_class; nemo_gen implements vllm."
    )
    model_name: str | None = Field(
        None, description="NeMo-RL's model to load (a local HF model directory): used when model.path "
        "is unset, and as the name in results. A recipe's policy.model_name lands here.",
    )
    max_new_tokens: int = Field(32, ge=1, description="Tokens to generate per request.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    n: int = Field(
        1, ge=1, description="Samples per prompt (a GRPO group): one engine request, the prompt prefilled "
        "once, every sample from one shard; results carry them all in GenerationResult.samples (JSONL: "
        "'samples' when n > 1). n > 1 needs temperature > 0. nemo_gen's key (NeMo-RL sets the group size "
        "in its GRPO config).",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int | None = Field(None, description="Top-k sampling: a positive integer; null or -1 disables it.")
    stop_token_ids: list[int] | None = Field(
        None, description="Token ids that end generation; null: the tokenizer's EOS."
    )
    stop_strings: list[str] | None = Field(None, description="Strings that end generation.")
    bad_words: list[str] | None = Field(
        None, description="Words never generated (vLLM's SamplingParams.bad_words; the engine loads "
        "its tokenizer to apply them).",
    )
    ignore_eos: bool | None = Field(None, description="Keep generating past EOS.")
    vllm_cfg: VllmCfg = Field(default_factory=VllmCfg, description="vLLM engine settings.")
    vllm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed verbatim to vllm.LLM / AsyncEngineArgs (keys are "
        "checked against the installed vLLM's EngineArgs); they win over everything derived.",
    )

    @field_validator("backend")
    @classmethod
    def _backend_resolves(cls, value: str) -> str:
        from nemo_gen.core.generation_config import check_backend

        return check_backend({"backend": value})  # ConfigError (a ValueError) naming the choices

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError("top_k must be null, -1 (off) or a positive integer")
        return value

    @field_validator("stop_strings", "bad_words")
    @classmethod
    def _no_empty_strings(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s for s in value):
            raise ValueError("entries must be non-empty strings")
        return value

    @field_validator("vllm_kwargs")
    @classmethod
    def _known_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        from nemo_gen.config import vllm_choices
        from nemo_gen.config.loader import suggest

        known = vllm_choices.engine_arg_names()
        unknown = [k for k in value if known is not None and k not in known]
        if unknown:
            raise ValueError("; ".join(f"{k!r} is not an argument of the installed vLLM's EngineArgs"
                                       f"{suggest(k, known)}" for k in unknown))
        return value

    @model_validator(mode="after")
    def _tokenizer_for_bad_words(self) -> "GenerationSettings":
        used = [k for k in ("stop_strings", "bad_words") if getattr(self, k)]
        if used and self.vllm_cfg.skip_tokenizer_init:
            raise ValueError(f"{' and '.join(used)} need the engine's tokenizer (vLLM drops them without "
                             "one); vllm_cfg.skip_tokenizer_init must not be true")
        return self

    def to_generation_config(self) -> dict[str, Any]:
        """The NeMo-RL ``GenerationConfig`` dict. Keys left unset are absent, not None, where
        NeMo-RL distinguishes the two (``skip_tokenizer_init``, ``load_format``)."""
        cfg = self.model_dump(mode="json")
        # configure_generation_config treats an absent key as "decide for me"; None would read
        # as a decision.
        for key in ("skip_tokenizer_init", "load_format", "worker_extension_cls"):
            if cfg["vllm_cfg"].get(key) is None:
                cfg["vllm_cfg"].pop(key, None)
        if self.bad_words and "skip_tokenizer_init" not in cfg["vllm_cfg"]:
            # vLLM tokenizes bad_words in the engine; without a tokenizer it drops them.
            cfg["vllm_cfg"]["skip_tokenizer_init"] = False
        return cfg


# --------------------------------------------------------------------------------------------
# fleet, health, ray, prefect, run


class FleetSettings(_Section):
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
        "EngineCore starts with vLLM imported, as a bare vllm.LLM's does. spawn: vLLM's own start inside a "
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


class RefitSettings(_Section):
    bucket_bytes: int = Field(
        256 * 2**20, ge=1, description="Bytes read from the source per bucket while staging a refit."
    )
    staging_dir: Path = Field(
        Path("/dev/shm"), description="Directory of the shared-memory staging file (CPU transport): "
        "each process's file, 0600 under a random name, lies in nemo_gen-<fleet>-uid<uid>/ (0700) "
        "here; it must hold the whole model, or a refit is refused before a byte is written.",
    )
    timeout_s: float = Field(600.0, gt=0, description="Deadline for each refit phase on a shard.")
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
    in_flight: Literal["drain", "abort", "keep"] = Field(
        "drain",
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

        return _one_of(value, vllm_choices.weight_transfer_backends(), "a registered weight-transfer backend")


class HealthSettings(_Section):
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


class RaySettings(_Section):
    address: str | None = Field(
        None,
        description="Ray cluster to attach to ('auto', 'host:port'); unset: a private local cluster "
        "started by nemo_gen and stopped with the fleet.",
    )
    namespace: str = Field("nemo_gen", description="Ray namespace of the fleet's actors.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local cluster; unset: all cores.")
    num_gpus: int | None = Field(
        None, ge=0, description="GPUs of the local cluster; unset: detected. Logical GPUs can be "
        "declared for placement tests."
    )
    log_to_driver: bool = Field(True, description="Echo engine and worker output in the driver's terminal.")
    include_dashboard: bool = Field(False, description="Start Ray's dashboard (local cluster only).")
    dashboard_host: str = Field("127.0.0.1", description="Dashboard bind address.")
    object_store_memory_gb: float | None = Field(None, gt=0, description="Object store size (local).")


class PrefectSettings(_Section):
    api_url: str | None = Field(
        None,
        description="Prefect API to report to; unset: PREFECT_API_URL, else a local server that "
        "nemo-gen starts on 127.0.0.1 and stops afterwards.",
    )
    host: str = Field("127.0.0.1", description="Bind address of the managed local server.")
    port: int | None = Field(None, ge=1, le=65535, description="Port of the managed server; unset: a free one.")
    server_start_timeout_s: float = Field(120.0, gt=0, description="Deadline for the managed server.")
    work_pool: str = Field("nemo-gen", description="Process work pool the deployments run on.")
    crash_reruns: int = Field(
        2, ge=0, description="How many times `nemo-gen deploy`'s automation re-runs a Crashed flow run "
        "(a killed flow-run process) of a nemo-gen deployment.",
    )
    allowed_paths: list[Path] = Field(
        default_factory=list,
        description="Directories deployment parameters (checkpoints, prompt and output files) may "
        "point into; empty: the current directory and `home`.",
    )


class RunSettings(_Section):
    prompts: list[str] = Field(
        default_factory=lambda: [
            "The quick brown fox",
            "Once upon a time",
            "In a distant galaxy",
            "The meaning of life is",
            "Reinforcement learning is",
            "A fleet of engines",
            "The weather today",
            "Hello, my name is",
        ],
        description="Built-in prompts for `nemo-gen run` when no input file is given.",
    )
    input: Path | None = Field(
        None, description="JSONL of prompts: {'prompt': str} or {'prompt_token_ids': [int]} per line."
    )
    batch_size: int = Field(
        64, ge=1, description="Prompts in flight at once. AsyncLLM shards (vllm_cfg.async_engine): one "
        "request per line, a new one sent as each finishes; the sync engine: prompts per fleet.generate call."
    )
    output: Path | None = Field(
        None, description="JSONL results, one line per input line in input order once complete; while "
        "the run goes, each line is appended as it finishes (the sync engine: each batch's), so a killed run "
        "keeps them (run.resume). Unset: `home`/outputs/<flow>-<timestamp>.jsonl.",
    )
    resume: bool = Field(
        False, description="Keep the lines already in `output` that generated without error and "
        "generate only the others (a killed or interrupted run continues where it stopped). Refused when "
        "`output`'s fingerprint (<output>.fingerprint.json: model, sampling settings, weight version, "
        "input) differs from this run's, naming the field.",
    )
    overwrite: bool = Field(
        False, description="Replace an `output` that already holds rows. Unset (and no run.resume): such "
        "an output is refused before anything starts, so an earlier run's rows are never lost by mistake.",
    )


class ServerSettings(_Section):
    """`nemo-gen serve` (and `generation.vllm_cfg.expose_http_server`): the OpenAI-compatible HTTP
    server in front of the fleet (``nemo_gen.server``)."""

    host: str = Field(
        "127.0.0.1", description="Address the HTTP server binds (127.0.0.1: this machine only). Any other "
        "(0.0.0.0, a name, an outside address) without server.api_key is warned about at start, and refused "
        "with server.allow_refit.",
    )
    port: int = Field(8000, ge=0, le=65535, description="Port of the HTTP server; 0: a free one, chosen at start.")
    api_key: SecretStr | None = Field(
        None, description="When set, every request but /health and /metrics needs `Authorization: Bearer "
        "<api_key>` (a missing or wrong key gets 401); unset: no key needed. Shown masked.",
    )
    allow_refit: bool = Field(
        False, description="Serve POST /nemo_gen/refit (a checkpoint directory on this machine, loaded into "
        "the fleet as fleet.refit does; guarded by api_key). Off: the route does not exist. On a host other "
        "than a loopback address it needs server.api_key.",
    )
    max_in_flight: int = Field(
        512, ge=1, description="Samples the server has in flight at once (a request of k prompts with n "
        "samples each counts k x n); a request that would go past it is answered 503 with Retry-After at "
        "once, before any of its work is done, and one larger than it alone is answered 400. /health and "
        "/metrics are never held back by it.",
    )
    retry_after_s: int = Field(
        1, ge=0, description="Seconds the Retry-After header of a 503 for load (server.max_in_flight, "
        "FleetBusy) tells a client to wait.",
    )
    max_body_bytes: int = Field(
        16 * 2**20, ge=1024, description="Largest request body the server reads; a larger one is answered "
        "413 before it is read whole.",
    )
    max_prompt_chars: int = Field(
        2**20, ge=1, description="Longest prompt, in characters (a chat: all its messages' content), the "
        "server tokenizes; a longer one is answered 400 naming the field, before any tokenizing.",
    )

    tool_call_parser: str | None = Field(
        None, description="vLLM's tool-call parser (its ToolParserManager name: hermes, llama3_json, "
        "pythonic...) that reads tool calls out of the model's text for tool_choice auto, and constrains "
        "required / named ones; unset: a request with tool_choice other than none is answered 400.",
    )
    tool_strict_level: Literal["auto", "function", "parameter"] = Field(
        "auto", description="vLLM's --tool-strict-level: the least a request with tools is constrained to. auto: "
        "tool_choice required / a named function force the call's envelope, and a tool's arguments follow its "
        "schema when the tool says strict: true; function: every request with tools gets the envelope; "
        "parameter: every tool's arguments follow its schema, as if each were strict.",
    )
    tool_call_whitespace: int | None = Field(
        4, ge=0, description="Longest run of whitespace characters the grammar of a constrained tool call "
        "(tool_choice required / named, server.tool_strict_level) lets the model write between JSON tokens "
        "(xgrammar's max_whitespace_cnt); null: unbounded, as vLLM leaves it. Bounded, a model that favours "
        "whitespace (a random one) still closes its call within max_tokens.",
    )
    reasoning_parser: str | None = Field(
        None, description="vLLM's reasoning parser (its ReasoningParserManager name: deepseek_r1, qwen3...) "
        "that splits the model's reasoning out of a chat answer into message.reasoning; unset: none is split.",
    )

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_call_parser(cls, value: str | None) -> str | None:
        from nemo_gen.config import vllm_choices

        return value if value is None else _one_of(value, vllm_choices.tool_parsers(), "a tool-call parser vLLM registers")

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        from nemo_gen.config import vllm_choices

        return value if value is None else _one_of(value, vllm_choices.reasoning_parsers(),
                                                   "a reasoning parser vLLM registers")

    @model_validator(mode="after")
    def _refit_open_to_the_network(self) -> "ServerSettings":
        why = exposure_problem(self.host, self.allow_refit, self.api_key)
        if why:
            raise _invalid(type(self).__name__, ("allow_refit",), True, "allow_refit", "{why}", {"why": why})
        return self


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only: ``localhost`` or a
    loopback address. Any other name (it may resolve anywhere), address, or "" (every interface) is not."""
    import ipaddress

    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_problem(host: str, allow_refit: bool, api_key: SecretStr | None) -> str | None:
    """Why the server may not start this way (None: it may): ``/nemo_gen/refit``, which loads a
    directory of this machine into the fleet, open without a key beyond this machine. An empty
    key is no key (the server then asks for none)."""
    if allow_refit and not api_key and not is_loopback(host):
        return (f"server.allow_refit would let anyone who reaches server.host {host!r} (not a loopback "
                "address) load a checkpoint directory of this machine into the fleet, and server.api_key is "
                "unset: set server.api_key, bind server.host to 127.0.0.1, or turn server.allow_refit off")
    return None


class _YamlSource(PydanticBaseSettingsSource):
    """Feeds the YAML document ``load`` parsed (held in a context variable for one call)."""

    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return _YAML_DATA.get()


_YAML_DATA: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("_YAML_DATA", default={})
# What ``load`` set aside as not used, for the settings object it builds.
_NOT_USED: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("_NOT_USED", default=[])


def _invalid(title: str, loc: tuple[str, ...], value: Any, kind: str, template: str,
             context: dict[str, Any]) -> ValidationError:
    """A cross-field check's failure as pydantic reports a field's, so the loader names the field."""
    from pydantic_core import InitErrorDetails, PydanticCustomError

    return ValidationError.from_exception_data(
        title, [InitErrorDetails(type=PydanticCustomError(kind, template, context), loc=loc, input=value)])


def _invalid_keys(title: str, at: tuple[str, ...], problems: Sequence[tuple[str, str]],
                  values: Mapping[str, Any]) -> ValidationError:
    """One error per bad key of a dict field, each at ``at`` + the key, so the loader names it."""
    from pydantic_core import InitErrorDetails, PydanticCustomError

    return ValidationError.from_exception_data(title, [
        InitErrorDetails(type=PydanticCustomError("env_var", "{why}", {"why": why}), loc=(*at, key),
                         input=values.get(key)) for key, why in problems])


class _EnvKeepingCase(PydanticBaseSettingsSource):
    """The ``NEMO_GEN_*`` environment as pydantic-settings reads it, but with the keys of
    ``generation.vllm_cfg.env_vars`` as written: the reader lowercases every variable's name
    before splitting it at ``__`` (the sections' names need that), and an environment variable's
    name is case-sensitive."""

    KEPT = (("generation", "vllm_cfg", "env_vars"),)

    def __init__(self, settings_cls: type[BaseSettings], inner: PydanticBaseSettingsSource):
        super().__init__(settings_cls)
        self.inner = inner

    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        data = self.inner()
        for path in self.KEPT:
            prefix = (ENV_PREFIX + "__".join(path) + "__").lower()
            written: dict[str, str] = {}
            for name in os.environ:
                if name.lower().startswith(prefix):
                    key = name[len(prefix):]
                    other = written.setdefault(key.lower(), key)
                    if other != key:
                        raise ConfigError(f"{name[:len(prefix)]}{other} and {name} set one key: the environment "
                                          "is read without regard to case", field=".".join((*path, key)))
            target: Any = data
            for part in path[:-1]:
                target = target.get(part) if isinstance(target, dict) else None
            if isinstance(target, dict) and isinstance(target.get(path[-1]), dict):
                target[path[-1]] = {written.get(k, k): v for k, v in target[path[-1]].items()}
        return data


class NemoGenSettings(BaseSettings):
    """Root of all settings. Build it with ``NemoGenSettings.load(...)``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        nested_model_default_partial_update=True,
    )

    home: Path = Field(
        Path(".nemo-gen"),
        description="Working directory for the tiny model, the managed Prefect server and outputs.",
    )
    model: ModelSettings = Field(default_factory=ModelSettings, description="The model to serve.")
    generation: GenerationSettings = Field(
        default_factory=GenerationSettings, description="NeMo-RL generation config."
    )
    fleet: FleetSettings = Field(default_factory=FleetSettings, description="Fleet shape.")
    health: HealthSettings = Field(default_factory=HealthSettings, description="Fleet health policy.")
    refit: RefitSettings = Field(default_factory=RefitSettings, description="Weight refit.")
    ray: RaySettings = Field(default_factory=RaySettings, description="Ray cluster.")
    prefect: PrefectSettings = Field(default_factory=PrefectSettings, description="Prefect API.")
    run: RunSettings = Field(default_factory=RunSettings, description="`nemo-gen run` inputs/outputs.")
    server: ServerSettings = Field(default_factory=ServerSettings, description="The OpenAI-compatible HTTP server.")

    _not_used: list[Any] = PrivateAttr(default_factory=list)

    def model_post_init(self, context: Any) -> None:
        self._not_used = list(_NOT_USED.get())

    @model_validator(mode="after")
    def _model_from_generation_model_name(self) -> "NemoGenSettings":
        """NeMo-RL loads ``generation.model_name``; so does nemo_gen when ``model.path`` is unset."""
        if self.model.path is None and self.generation.model_name:
            self.model.path = Path(self.generation.model_name)
        return self

    @model_validator(mode="after")
    def _check_recompute_kv(self) -> "NemoGenSettings":
        """Only ``keep`` leaves requests running on KV from older weights: elsewhere
        ``refit.recompute_kv`` could not act."""
        if self.refit.recompute_kv and self.refit.in_flight != "keep":
            raise _invalid(type(self).__name__, ("refit", "recompute_kv"), True, "recompute_kv",
                           "refit.recompute_kv re-computes the KV of requests a refit kept running, but "
                           "refit.in_flight is {mode}, which keeps none; set refit.in_flight=keep",
                           {"mode": self.refit.in_flight})
        return self

    @model_validator(mode="after")
    def _check_gpu_share(self) -> "NemoGenSettings":
        """``fleet.shards_per_gpu`` engines must fit one GPU together."""
        k = self.fleet.shards_per_gpu
        util = self.generation.vllm_cfg.gpu_memory_utilization
        limit = 1.0 - GPU_SHARE_HEADROOM
        if k > 1 and k * util > limit + 1e-9:
            raise _invalid(type(self).__name__, ("fleet", "shards_per_gpu"), k, "gpu_share",
                           "{k} engines per GPU x generation.vllm_cfg.gpu_memory_utilization {util} = {total} of "
                           "the device, more than {limit}; lower generation.vllm_cfg.gpu_memory_utilization to "
                           "at most {most} or fleet.shards_per_gpu",
                           {"k": k, "util": util, "total": round(k * util, 4), "limit": round(limit, 4),
                            "most": int(limit / k * 1000) / 1000})
        return self

    @model_validator(mode="after")
    def _cpu_env_vars(self) -> "NemoGenSettings":
        """On a CPU fleet each engine's threads, cores and KV cache are the fleet's to set too."""
        from nemo_gen.core.engine_args import CPU_FLEET_ENV, env_var_problems

        if self.fleet.device == "cpu":
            env_vars = self.generation.vllm_cfg.env_vars
            problems = [p for p in env_var_problems(env_vars, "cpu") if p[0] in CPU_FLEET_ENV]
            if problems:
                raise _invalid_keys(type(self).__name__, ("generation", "vllm_cfg", "env_vars"), problems, env_vars)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest first: overrides (passed as init kwargs) > environment > YAML > defaults.
        return (init_settings, _EnvKeepingCase(settings_cls, env_settings), _YamlSource(settings_cls))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike | None = None,
        overrides: Sequence[str] | Mapping[str, Any] | None = None,
    ) -> "NemoGenSettings":
        """Read ``path`` (YAML through OmegaConf: ``defaults:`` inheritance, ``${...}``
        interpolations; a NeMo-RL recipe is mapped, see ``nemo_gen.config.loader``), then
        ``NEMO_GEN_*`` env vars, then ``overrides``; validate once.

        Raises ``ConfigError`` naming every bad dotted field (and the file it came from). Keys
        read but not used by nemo_gen are in ``settings.not_used``.
        """
        from nemo_gen.config import loader as config_loader

        known = {"": cls.model_fields, "generation": GenerationSettings.model_fields,
                 "generation.vllm_cfg": VllmCfg.model_fields}
        prepared = config_loader.prepare(path, _override_pairs(overrides), known)
        tokens = (_YAML_DATA.set(prepared.file_data), _NOT_USED.set(list(prepared.not_used)))
        try:
            settings = cls(**prepared.override_data)
        except ValidationError as exc:
            raise _config_error(exc, path) from None
        finally:
            _YAML_DATA.reset(tokens[0])
            _NOT_USED.reset(tokens[1])
        if prepared.not_used:
            log.info("%d settings keys are not used by nemo_gen (`nemo-gen config` lists them): %s",
                     len(prepared.not_used), ", ".join(n.key for n in prepared.not_used))
        return settings

    @property
    def not_used(self) -> list[Any]:
        """Keys the sources set that nemo_gen read and does not use (``config_loader.NotUsed``:
        key, value, reason): a NeMo-RL recipe's trainer sections, NeMo-RL generation keys whose
        value asks for nothing nemo_gen lacks."""
        return list(self._not_used)

    # -- derived values (computed here so every caller agrees) --------------------------------

    def model_dir(self) -> Path:
        """The model directory the engines load (the tiny model when ``model.path`` is unset)."""
        return Path(self.model.path) if self.model.path else self.home / "tiny-model"

    def tokenizer_dir(self) -> Path:
        return Path(self.model.tokenizer) if self.model.tokenizer else self.model_dir()

    def model_name(self) -> str:
        return self.model.name or self.generation.model_name or self.model_dir().name

    def is_eval(self) -> bool:
        return self.fleet.mode == "eval"


def parse_override(item: str) -> tuple[str, Any]:
    """``'fleet.num_shards=4'`` -> ``('fleet.num_shards', 4)``; the value is parsed as YAML."""
    import yaml

    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like dotted.key=value", field="--set")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _override_pairs(overrides: Sequence[str] | Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [(str(k), v) for k, v in overrides.items()]
    if isinstance(overrides, (str, bytes)):
        raise ConfigError("overrides must be a list of 'dotted.key=value' strings or a dict", field="overrides")
    return [parse_override(item) for item in overrides]


def _fields_at(loc: Sequence[Any]) -> list[str]:
    """The field names of the settings model that holds ``loc``'s last part."""
    model: Any = NemoGenSettings
    for part in loc[:-1]:
        info = getattr(model, "model_fields", {}).get(str(part))
        ann = info.annotation if info is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(getattr(model, "model_fields", {}))


def _config_error(exc: ValidationError, path: str | os.PathLike | None) -> ConfigError:
    from nemo_gen.config.loader import NEMO_RL_KEYS, suggest

    problems = []
    for err in exc.errors():
        dotted = ".".join(str(part) for part in err["loc"])
        if err["type"] == "extra_forbidden":
            foreign = NEMO_RL_KEYS.get(dotted)
            if foreign is not None:
                msg = f"a NeMo-RL key that nemo_gen does not use here: {foreign.reason}"
            else:
                msg = "unknown setting" + suggest(str(err["loc"][-1]), _fields_at(err["loc"]))
        else:
            msg = f"{err['msg'].removeprefix('Value error, ')} (got {err.get('input')!r})"
        problems.append((dotted, msg))
    source = f" (from settings file {path}, NEMO_GEN_* environment or overrides)" if path is not None else ""
    first_field = problems[0][0] if problems else None
    lines = "; ".join(f"{field}: {msg}" for field, msg in problems)
    err = ConfigError(f"invalid settings{source}: {lines}")
    err.field = first_field
    err.fields = [field for field, _ in problems]  # type: ignore[attr-defined]
    return err


# --------------------------------------------------------------------------------------------
# the settings' own documentation (``nemo-gen config --describe``)


def _type_name(ann: Any) -> str:
    import types
    import typing

    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if ann is Any:
        return "any"
    if isinstance(ann, type):
        return "path" if issubclass(ann, os.PathLike) else ann.__name__
    return str(ann)


def describe_settings(prefix: str = "") -> list[dict[str, Any]]:
    """Every setting under ``prefix`` (a dotted key or section; empty: all): ``key``, ``type``,
    ``default``, ``description`` — then NeMo-RL's keys nemo_gen reads but does not use, with the
    values it accepts (``type`` "not used"). Raises ConfigError for an unknown prefix."""
    import json

    from nemo_gen.config.loader import NEMO_RL_KEYS, suggest

    rows: list[dict[str, Any]] = []

    def walk(model: type[BaseModel], at: str) -> None:
        for name, info in model.model_fields.items():
            key = f"{at}{name}"
            ann = info.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                rows.append({"key": key, "type": "section", "default": None, "description": info.description})
                walk(ann, f"{key}.")
                continue
            default = info.get_default(call_default_factory=True)
            rows.append({"key": key, "type": _type_name(ann),
                         "default": json.loads(json.dumps(default, default=str)),
                         "description": info.description})

    walk(NemoGenSettings, "")
    for key, spec in NEMO_RL_KEYS.items():
        rows.append({"key": key, "type": "not used", "default": None,
                     "description": f"NeMo-RL key, not used by nemo_gen: {spec.reason}. Accepted: {spec.accepted}."})
    if not prefix:
        return rows
    prefix = prefix.strip(".")
    chosen = [r for r in rows if r["key"] == prefix or r["key"].startswith(prefix + ".")]
    if not chosen:
        raise ConfigError(f"no such setting{suggest(prefix, [r['key'] for r in rows])}", field=prefix)
    return chosen
