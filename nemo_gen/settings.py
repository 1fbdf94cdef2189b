"""Every nemo_gen setting and its default — the only place defaults live.

Sources, lowest to highest precedence: field defaults < a YAML file < ``NEMO_GEN_*`` environment
variables (``__`` nests: ``NEMO_GEN_FLEET__NUM_SHARDS=4``) < overrides (the CLI's
``--set fleet.num_shards=4``, or a dict of dotted keys). ``NemoGenSettings.load`` validates once
and turns every problem into one ``ConfigError`` that names the dotted field and the file.

The ``generation`` section is NeMo-RL's ``GenerationConfig``/``VllmConfig`` key for key, so an
existing NeMo-RL ``generation:`` block loads unchanged; ``to_generation_config()`` hands the
plain dict that NeMo-RL's functions (``configure_generation_config``) expect.
"""

from __future__ import annotations

import contextvars
import copy
import os
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from nemo_gen.errors import ConfigError

ENV_PREFIX = "NEMO_GEN_"
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
# generation: NeMo-RL's GenerationConfig + VllmConfig, every declared key


class ColocationResources(_Section):
    gpus_per_node: int | None = Field(None, description="GPUs per node reserved for generation.")
    num_nodes: int | None = Field(None, description="Nodes reserved for generation.")


class ColocationSettings(_Section):
    enabled: bool = Field(
        False,
        description="NeMo-RL: generation shares GPUs with training. A standalone nemo_gen fleet is "
        "not colocated (NeMo-RL's YAML default is true; set it explicitly to keep that).",
    )
    resources: ColocationResources = Field(
        default_factory=ColocationResources, description="Resources for non-colocated generation."
    )


class VllmCfg(_Section):
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel ranks per shard.")
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM pipeline stages per shard.")
    expert_parallel_size: int = Field(1, ge=1, description="vLLM expert parallel size (MoE).")
    gpu_memory_utilization: float = Field(
        0.6, gt=0, le=1, description="Fraction of GPU memory vLLM may take (GPU only)."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + generation in tokens; unset: the model's maximum."
    )
    precision: str = Field(
        "auto",
        description="Model dtype: auto | float32 | bfloat16 | float16 | fp8 (fp8 = bf16 + fp8 "
        "quantization). auto: the checkpoint's dtype on GPU, float32 on CPU.",
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field("auto", description="KV cache dtype.")
    load_format: str | None = Field(
        None,
        description="vLLM load format. Unset: configure_generation_config picks auto (eval) or "
        "dummy (train: weights arrive by refit).",
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
        "configure_generation_config decides (false for eval or when stop_strings are set).",
    )
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        "processed_logprobs", description="Which logprobs vLLM returns."
    )
    cap_max_tokens_to_context: bool | None = Field(
        None, description="NeMo-RL: cap max_tokens to the context left."
    )
    is_mx: bool | None = Field(None, description="NeMo-RL: MX-format weights.")
    enable_return_routed_experts: bool | None = Field(None, description="NeMo-RL: MoE routing output.")
    use_tqdm: bool = Field(False, description="vLLM's own progress bars.")
    enable_prefix_caching: bool | None = Field(None, description="vLLM prefix caching; unset: vLLM's default.")
    enable_vllm_metrics_logger: bool | None = Field(None, description="NeMo-RL: periodic vLLM metrics.")
    vllm_metrics_logger_interval: float | None = Field(None, description="NeMo-RL: metrics interval (s).")
    use_deep_gemm: bool | None = Field(None, description="NeMo-RL: DeepGEMM kernels (GPU).")
    num_first_layers_in_bf16: int | None = Field(None, description="NeMo-RL: fp8 exclusions.")
    num_last_layers_in_bf16: int | None = Field(None, description="NeMo-RL: fp8 exclusions.")
    expose_http_server: bool | None = Field(None, description="NeMo-RL: OpenAI-compatible server per shard.")
    http_refit_api_key_env_var: str | None = Field(None, description="NeMo-RL: HTTP refit API key env var.")
    http_refit_server_port: int | None = Field(None, description="NeMo-RL: HTTP refit port.")
    zmq_refit_server_port: int | None = Field(None, description="NeMo-RL: ZMQ refit port.")
    http_server_serving_chat_kwargs: dict[str, Any] | None = Field(None, description="NeMo-RL: chat server kwargs.")
    tool_parser_plugin: str | None = Field(None, description="NeMo-RL: tool parser plugin.")
    reasoning_parser_plugin: str | None = Field(None, description="NeMo-RL: reasoning parser plugin.")
    video: dict[str, Any] | None = Field(None, description="NeMo-RL: video input config.")
    reset_encoder_cache_after_weight_update: bool = Field(
        False, description="NeMo-RL: reset the encoder cache after each refit."
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="Environment variables set in every engine process."
    )
    worker_extension_cls: str | None = Field(
        None,
        description="Class mixed into vLLM workers (vLLM backend only); must subclass "
        "nemo_gen.refit.worker_ext.NemoGenWorkerExtension, which refit relies on.",
    )


class GenerationSettings(_Section):
    backend: str = Field("vllm", description="Generation backend; nemo_gen implements vllm.")
    model_name: str | None = Field(None, description="NeMo-RL: the policy's model name.")
    max_new_tokens: int = Field(32, ge=1, description="Tokens to generate per request.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int | None = Field(None, description="Top-k sampling; null or -1 disables it.")
    val_temperature: float | None = Field(None, description="NeMo-RL: validation temperature.")
    val_top_p: float | None = Field(None, description="NeMo-RL: validation top_p.")
    val_top_k: int | None = Field(None, description="NeMo-RL: validation top_k.")
    stop_token_ids: list[int] | None = Field(
        None, description="Token ids that end generation; null: the tokenizer's EOS."
    )
    stop_strings: list[str] | None = Field(None, description="Strings that end generation.")
    bad_words: list[str] | None = Field(None, description="Words never generated.")
    ignore_eos: bool | None = Field(None, description="Keep generating past EOS.")
    colocated: ColocationSettings = Field(
        default_factory=ColocationSettings, description="NeMo-RL colocation config."
    )
    port_range_low: int | None = Field(None, description="NeMo-RL: low end of the port range.")
    port_range_high: int | None = Field(None, description="NeMo-RL: high end of the port range.")
    use_async_rollouts: bool | None = Field(None, description="NeMo-RL: async rollouts (sglang).")
    refit_transport: str | None = Field(None, description="NeMo-RL: refit transport name.")
    refit_cfg: dict[str, Any] | None = Field(None, description="NeMo-RL: refit transport config.")
    quant_cfg: dict[str, Any] | None = Field(None, description="NeMo-RL: quantization config.")
    real_quant: bool | None = Field(None, description="NeMo-RL: real quantized generation.")
    real_quant_export_cpu_offload: bool | None = Field(None, description="NeMo-RL: quant export offload.")
    real_quant_ignore: list[str] | None = Field(None, description="NeMo-RL: layers left unquantized.")
    vllm_cfg: VllmCfg = Field(default_factory=VllmCfg, description="vLLM engine settings.")
    vllm_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed verbatim to vllm.LLM / AsyncEngineArgs."
    )

    @model_validator(mode="after")
    def _check_port_range(self) -> "GenerationSettings":
        lo, hi = self.port_range_low, self.port_range_high
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"port_range_low ({lo}) must be below port_range_high ({hi})")
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
        1.0, gt=0, description="KV cache per CPU engine in GiB (VLLM_CPU_KVCACHE_SPACE)."
    )
    engine_start_timeout_s: float = Field(600.0, gt=0, description="Deadline for one engine to load.")
    placement_timeout_s: float = Field(
        30.0, gt=0, description="Deadline for the cluster to place a shard; then a PlacementError."
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline for one generate call on a shard.")
    control_timeout_s: float = Field(
        10.0, gt=0, description="Deadline for a control call on a shard actor (info, assign): a live "
        "actor answers at once, so silence this long means it is gone or wedged.",
    )
    stop_timeout_s: float = Field(
        60.0, gt=0, description="How long a shard gets to stop its engine cleanly before its actor is killed.",
    )
    spares: int = Field(
        0, ge=0, description="Warm spares: extra engines loaded and refit with the fleet but given no "
        "traffic; one takes a dead shard's place at once.",
    )
    shards_per_gpu: int = Field(
        1, ge=1, description="Engines per GPU (GPU only): each shard's bundle takes 1/k of a GPU (Ray "
        "fractional GPUs), so k small engines share one device; k x generation.vllm_cfg."
        "gpu_memory_utilization must then leave GPU_SHARE_HEADROOM of the device free. Engines that "
        "share a GPU start one at a time. k > 1 needs tensor_parallel_size x pipeline_parallel_size = 1.",
    )


class RefitSettings(_Section):
    bucket_bytes: int = Field(
        256 * 2**20, ge=1, description="Bytes read from the source per bucket while staging a refit."
    )
    staging_dir: Path = Field(
        Path("/dev/shm"), description="Directory of the shared-memory staging file (CPU transport)."
    )
    timeout_s: float = Field(600.0, gt=0, description="Deadline for each refit phase on a shard.")
    backend: str = Field(
        "nemo_gen_shm",
        min_length=1,
        description="vLLM weight-transfer backend the engines start with (weight_transfer_config), "
        "used by trainers that drive fleet.weight_sync_client(): 'nemo_gen_shm' (shared memory, any "
        "device), 'nemo_gen_ipc' (CUDA IPC from a trainer on the engines' GPU, handles shared once), "
        "or vLLM's own 'ipc' / 'nccl' (trainer on other GPUs).",
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
        5.0, gt=0, description="Seconds between real-generation probes (one token) of each serving shard."
    )
    probe_timeout_s: float = Field(
        10.0, gt=0, description="A probe not answered within this counts as a failure (a hung engine)."
    )
    warmup_grace_s: float = Field(
        120.0, gt=0, description="While an engine's first generation step (kernel selection, warm-up) "
        "runs, a probe counts it as alive for this long instead of health.probe_timeout_s.",
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
        64, ge=1, description="Prompts per fleet.generate call; progress is reported between batches."
    )
    output: Path | None = Field(
        None, description="JSONL results; unset: `home`/outputs/<flow>-<timestamp>.jsonl."
    )


class _YamlSource(PydanticBaseSettingsSource):
    """Feeds the YAML document ``load`` parsed (held in a context variable for one call)."""

    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return _YAML_DATA.get()


_YAML_DATA: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("_YAML_DATA", default={})


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

    @model_validator(mode="after")
    def _check_gpu_share(self) -> "NemoGenSettings":
        """``fleet.shards_per_gpu`` engines must fit one GPU together."""
        k = self.fleet.shards_per_gpu
        util = self.generation.vllm_cfg.gpu_memory_utilization
        limit = 1.0 - GPU_SHARE_HEADROOM
        if k > 1 and k * util > limit + 1e-9:
            from pydantic_core import InitErrorDetails, PydanticCustomError

            raise ValidationError.from_exception_data(
                type(self).__name__,
                [InitErrorDetails(
                    type=PydanticCustomError(
                        "gpu_share",
                        "{k} engines per GPU x generation.vllm_cfg.gpu_memory_utilization {util} = {total} of "
                        "the device, more than {limit}; lower generation.vllm_cfg.gpu_memory_utilization to "
                        "at most {most} or fleet.shards_per_gpu",
                        {"k": k, "util": util, "total": round(k * util, 4), "limit": round(limit, 4),
                         "most": int(limit / k * 1000) / 1000},
                    ),
                    loc=("fleet", "shards_per_gpu"),
                    input=k,
                )],
            )
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
        return (init_settings, env_settings, _YamlSource(settings_cls))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike | None = None,
        overrides: Sequence[str] | Mapping[str, Any] | None = None,
    ) -> "NemoGenSettings":
        """Read ``path`` (YAML), then ``NEMO_GEN_*`` env vars, then ``overrides``; validate once.

        Raises ``ConfigError`` naming every bad dotted field (and the file it came from).
        """
        yaml_data = _read_yaml(path) if path is not None else {}
        init = _overrides_to_nested(overrides)
        token = _YAML_DATA.set(yaml_data)
        try:
            return cls(**init)
        except ValidationError as exc:
            raise _config_error(exc, path) from None
        finally:
            _YAML_DATA.reset(token)

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


def _read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    import yaml

    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read settings file: {exc.strerror}", field=str(p)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", field=str(p)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"the top level must be a mapping, got {type(data).__name__}", field=str(p))
    _reject_interpolations(data, p)
    return data


def _reject_interpolations(data: Any, path: Path, prefix: str = "") -> None:
    """NeMo-RL YAML may carry OmegaConf ``${...}`` references to keys outside ``generation``;
    nemo_gen has no ``policy`` section to resolve them against, so say which field to fill in."""
    if isinstance(data, dict):
        for key, value in data.items():
            _reject_interpolations(value, path, f"{prefix}{key}.")
    elif isinstance(data, str) and data.startswith("${") and data.endswith("}"):
        raise ConfigError(
            f"{path}: interpolation {data!r} cannot be resolved here; give a literal value",
            field=prefix.rstrip("."),
        )


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


def _overrides_to_nested(overrides: Sequence[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        pairs = list(overrides.items())
    elif isinstance(overrides, (str, bytes)):
        raise ConfigError("overrides must be a list of 'dotted.key=value' strings or a dict", field="overrides")
    else:
        pairs = [parse_override(item) for item in overrides]
    nested: dict[str, Any] = {}
    for key, value in pairs:
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError("set both as a value and as a section", field=key)
            node = child
        _merge(node, parts[-1], copy.deepcopy(value), key)
    return nested


def _merge(node: dict[str, Any], key: str, value: Any, dotted: str) -> None:
    """Set ``node[key]``, merging into a section already there (never mutating the caller's)."""
    existing = node.get(key)
    if isinstance(existing, dict) and isinstance(value, dict):
        for k, v in value.items():
            _merge(existing, k, v, f"{dotted}.{k}")
    elif isinstance(existing, dict) or (key in node and isinstance(value, dict)):
        raise ConfigError("set both as a value and as a section", field=dotted)
    else:
        node[key] = value


def _config_error(exc: ValidationError, path: str | os.PathLike | None) -> ConfigError:
    problems = []
    for err in exc.errors():
        dotted = ".".join(str(part) for part in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown setting"
        problems.append((dotted, f"{msg} (got {err.get('input')!r})" if err["type"] != "extra_forbidden" else msg))
    source = f" (from settings file {path}, NEMO_GEN_* environment or overrides)" if path is not None else ""
    first_field = problems[0][0] if problems else None
    lines = "; ".join(f"{field}: {msg}" for field, msg in problems)
    err = ConfigError(f"invalid settings{source}: {lines}")
    err.field = first_field
    err.fields = [field for field, _ in problems]  # type: ignore[attr-defined]
    return err
