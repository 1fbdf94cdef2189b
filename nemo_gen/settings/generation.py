"""The ``model`` and ``generation`` sections and their defaults: ``ModelSettings``, and NeMo-RL's
``GenerationConfig``/``VllmConfig`` keys that nemo_gen acts on (``GenerationSettings``, ``VllmCfg``,
``LoraCfg``). ``GenerationSettings.to_generation_config()`` hands the plain dict NeMo-RL's functions expect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import Field, ValidationInfo, field_validator, model_validator

from nemo_gen.settings.base import Section, invalid_keys, one_of


# --------------------------------------------------------------------------------------------
# model


class ModelSettings(Section):
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
# other keys (colocation resources, HTTP server, its refit transports, ...) are nemo_gen.config.loader's
# NEMO_RL_KEYS: read, shown as not used, or refused when they ask for something missing.


class LoraCfg(Section):
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


class ColocatedCfg(Section):
    enabled: bool = Field(
        False, description="NeMo-RL's colocated layout: the engines start with vLLM's sleep mode "
        "(enable_sleep_mode) so a trainer on the same GPUs gets their memory back between rollouts "
        "(fleet.sleep / fleet.wake, VllmGeneration.finish_generation / prepare_for_generation; "
        "docs/rl.md). GPU fleets only: vLLM's CPU worker ignores sleep, so a CPU fleet refuses it.",
    )


class VllmCfg(Section):
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
    max_num_seqs: int | None = Field(
        1024, ge=1, description="Sequences one engine step may carry (vLLM's max_num_seqs). A rollout batch "
        "runs in as few steps as it fits in: vLLM's own default is 1024 for its sync LLM on an 80 GB GPU "
        "but 128 for AsyncLLM (async_engine: true), which would run a batch of 512 as four queued waves. "
        "1024 for both; null: vLLM's default for the engine and GPU.",
    )
    max_cudagraph_capture_size: int | None = Field(
        None, ge=1, description="The largest step, in sequences, vLLM captures a CUDA graph for (vLLM's "
        "max_cudagraph_capture_size; GPU engines with enforce_eager off). A decode step of more sequences "
        "runs without a graph, its kernels launched one by one. Unset: vLLM's, min(2 x max_num_seqs, 512) "
        "on H100/H200; raise it to the rollout batch to cover one of 1024 (more graphs: longer launch, "
        "more GPU memory).",
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
        "The server is composed with the fleet where the process is: `nemo-gen serve` (which starts it "
        "anyway), the pipeline's launch task, NeMo-RL's VllmGeneration; a library caller of "
        "GenerationFleet.launch composes it with nemo_gen.server.serve(fleet).",
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

        return one_of(value, vllm_choices.precisions(), "a precision vLLM knows")

    @field_validator("kv_cache_dtype")
    @classmethod
    def _known_kv_cache_dtype(cls, value: str) -> str:
        from nemo_gen.config import vllm_choices

        return one_of(value, vllm_choices.kv_cache_dtypes(), "a KV cache dtype of the installed vLLM")

    @field_validator("load_format")
    @classmethod
    def _known_load_format(cls, value: str | None) -> str | None:
        from nemo_gen.config import vllm_choices

        if value is None:
            return value
        return one_of(value, vllm_choices.load_formats(), "a load format of the installed vLLM",
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
            raise invalid_keys(type(self).__name__, ("env_vars",), problems, self.env_vars)
        return self


class GenerationSettings(Section):
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
    colocated: ColocatedCfg = Field(
        default_factory=ColocatedCfg, description="Sharing the GPUs with a trainer (NeMo-RL's ColocationConfig; "
        "its resources key is NeMo-RL's cluster for separate engines, read but not used).",
    )
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

