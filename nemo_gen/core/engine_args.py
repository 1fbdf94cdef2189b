"""Translate a resolved NeMo-RL generation config into vLLM engine arguments and process env.

Pure: it only builds dicts. The shard actor passes ``engine_kwargs`` to ``vllm.LLM`` (or
``AsyncEngineArgs``) and ``engine_env`` becomes the actor's ``runtime_env`` so every process
the engine forks (EngineCore, workers) inherits it from birth.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

from nemo_gen.errors import ConfigError

Device = Literal["cpu", "gpu"]

# Refit runs inside every vLLM worker through this mixin (nemo_gen/refit/worker_ext.py); the
# module named here also registers nemo_gen's weight-transfer backends in the worker.
WORKER_EXTENSION = "nemo_gen.refit.worker_entry.NemoGenWorkerExtension"

# The nice value the raylet starts a worker process at (Ray's default: 15).
RAY_WORKER_NICENESS = "RAY_worker_niceness"

# vLLM's own ``ipc`` weight-transfer backend hands the update RPC its CUDA IPC handles as
# they are (tuples holding torch classes and dtypes). The engine's msgpack channel between the
# shard actor and its EngineCore refuses those unless vLLM may fall back to pickle: every refit
# failed with "Object of type <class 'torch._C._TensorMeta'> is not serializable" on the H200
# (2026-12-02) until this was set. vLLM's HTTP refit routes need the same switch for the same
# handles. The channel is the engine's own (one host, one user); no other backend needs it.
ALLOW_PICKLE = "VLLM_ALLOW_INSECURE_SERIALIZATION"
PICKLED_HANDLE_BACKENDS = frozenset({"ipc"})

_DTYPES = {"auto", "float32", "bfloat16", "float16", "half", "float"}


def engine_kwargs(
    gen_cfg: Mapping[str, Any],
    *,
    model_dir: str,
    tokenizer_dir: str,
    device: Device,
    seed: int = 0,
    weight_transfer_backend: str | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` / ``AsyncEngineArgs`` from a configured generation dict.

    ``gen_cfg`` must already have been through ``configure_generation_config`` (it decides
    ``load_format`` and ``skip_tokenizer_init``). ``vllm_kwargs`` win over everything derived.
    """
    vc = gen_cfg.get("vllm_cfg", {})
    precision = vc.get("precision", "auto")
    kwargs: dict[str, Any] = {
        "model": model_dir,
        "tokenizer": tokenizer_dir,
        "tensor_parallel_size": vc.get("tensor_parallel_size", 1),
        "pipeline_parallel_size": vc.get("pipeline_parallel_size", 1),
        "kv_cache_dtype": vc.get("kv_cache_dtype", "auto"),
        "load_format": vc.get("load_format", "auto"),
        "skip_tokenizer_init": bool(vc.get("skip_tokenizer_init", False)),
        "logprobs_mode": vc.get("logprobs_mode", "processed_logprobs"),
        "seed": seed,
        # vllm_cfg.enable_vllm_metrics_logger: vLLM's periodic stats lines in the engine's log
        # (their interval is VLLM_LOG_STATS_INTERVAL, set by engine_env).
        "disable_log_stats": not vc.get("enable_vllm_metrics_logger"),
    }
    if precision == "fp8":
        kwargs["dtype"] = "bfloat16"
        kwargs["quantization"] = "fp8"
    elif precision == "auto" and device == "cpu":
        # vLLM downcasts float32 checkpoints to bfloat16 on CPU and then picks its AMX attention
        # kernel, which dies with SIGILL on hosts that advertise AMX without enabling it (seen on
        # this project's CI machines). float32 takes the AVX-512 kernel; bfloat16 stays one
        # explicit setting away.
        kwargs["dtype"] = "float32"
    elif precision in _DTYPES:
        kwargs["dtype"] = precision
    else:
        raise ConfigError(
            f"unknown precision {precision!r}; use one of {sorted(_DTYPES | {'fp8'})}",
            field="generation.vllm_cfg.precision",
        )
    if vc.get("max_model_len") is not None:
        kwargs["max_model_len"] = vc["max_model_len"]
    enforce_eager = vc.get("enforce_eager")
    # CPU: torch.compile of the model costs minutes on a small machine and buys little.
    kwargs["enforce_eager"] = (device == "cpu") if enforce_eager is None else bool(enforce_eager)
    if vc.get("enable_prefix_caching") is not None:
        kwargs["enable_prefix_caching"] = vc["enable_prefix_caching"]
    if device == "gpu":
        kwargs["gpu_memory_utilization"] = vc.get("gpu_memory_utilization", 0.6)
    if vc.get("expert_parallel_size", 1) > 1:
        # vLLM's EP group is the engine's TP ranks (settings allow EP = TP only): MoE layers are
        # sharded by expert instead of by tensor.
        kwargs["enable_expert_parallel"] = True
    world = kwargs["tensor_parallel_size"] * kwargs["pipeline_parallel_size"]
    if world > 1:
        # CPU ranks are forked processes inside the shard's bundle; on GPU vLLM schedules its
        # ranks as Ray workers in the shard's placement group.
        kwargs["distributed_executor_backend"] = "mp" if device == "cpu" else "ray"
    # A user's own extension must subclass nemo_gen's (refit calls its nemo_gen_* methods).
    kwargs["worker_extension_cls"] = vc.get("worker_extension_cls") or WORKER_EXTENSION
    if weight_transfer_backend:
        # vLLM's refit protocol (fleet.weight_sync_client); the worker builds this backend's
        # engine when it loads the model (the extension registers "nemo_gen_shm" before that).
        kwargs["weight_transfer_config"] = {"backend": weight_transfer_backend}
    kwargs.update(gen_cfg.get("vllm_kwargs") or {})
    return kwargs


def engine_env(
    gen_cfg: Mapping[str, Any],
    *,
    device: Device,
    omp_threads: int,
    cpu_kvcache_space_gb: float,
    cpu_cores: list[int] | None = None,
    niceness: int | None = None,
    weight_transfer_backend: str | None = None,
) -> dict[str, str]:
    """Environment for one shard's processes.

    On CPU each rank gets ``omp_threads`` OpenMP threads; with ``cpu_cores`` given, ranks are
    pinned (VLLM_CPU_OMP_THREADS_BIND, ``|`` between ranks) so two engines never share a core.
    ``niceness``: the nice value Ray starts the shard actor at (its engine's processes inherit
    it); None leaves Ray's default for workers (15). ``weight_transfer_backend``: the engine's
    (``transfer_backend(engine_kwargs)``); vLLM's ``ipc`` gets ALLOW_PICKLE, and a
    ``vllm_cfg.env_vars`` entry that turns it off is refused.
    """
    vc = gen_cfg.get("vllm_cfg", {})
    env: dict[str, str] = {}
    if niceness is not None:
        # Read by the raylet from the actor's runtime env when it starts the worker process (Ray's
        # job supervisor sets "0" the same way for itself).
        env[RAY_WORKER_NICENESS] = str(niceness)
    if vc.get("use_deep_gemm") is not None:
        if vc["use_deep_gemm"] and device == "cpu":
            raise ConfigError("DeepGEMM is a CUDA kernel library: use_deep_gemm=true needs a GPU fleet",
                              field="generation.vllm_cfg.use_deep_gemm")
        env["VLLM_USE_DEEP_GEMM"] = "1" if vc["use_deep_gemm"] else "0"
    if vc.get("enable_vllm_metrics_logger") and vc.get("vllm_metrics_logger_interval") is not None:
        env["VLLM_LOG_STATS_INTERVAL"] = str(vc["vllm_metrics_logger_interval"])
    if device == "cpu":
        world = vc.get("tensor_parallel_size", 1) * vc.get("pipeline_parallel_size", 1)
        env["OMP_NUM_THREADS"] = str(omp_threads)
        env["VLLM_CPU_KVCACHE_SPACE"] = _fmt_gb(cpu_kvcache_space_gb)
        if cpu_cores:
            per_rank = max(1, len(cpu_cores) // world)
            ranks = [cpu_cores[r * per_rank:(r + 1) * per_rank] or cpu_cores[-1:] for r in range(world)]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(_core_list(r) for r in ranks)
        else:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if weight_transfer_backend in PICKLED_HANDLE_BACKENDS:
        env[ALLOW_PICKLE] = "1"
    for key, value in (vc.get("env_vars") or {}).items():
        env[str(key)] = str(value)
    if weight_transfer_backend in PICKLED_HANDLE_BACKENDS and not _vllm_flag_on(env[ALLOW_PICKLE]):
        raise ConfigError(
            f"refit.backend {weight_transfer_backend!r} sends CUDA IPC handles that the engine can only take "
            f"with {ALLOW_PICKLE}=1 (got {env[ALLOW_PICKLE]!r}): drop it from env_vars or use refit.backend "
            "'nemo_gen_ipc'",
            field=f"generation.vllm_cfg.env_vars.{ALLOW_PICKLE}",
        )
    return env


def _vllm_flag_on(value: str) -> bool:
    # as vllm.envs reads its 0/1 flags: bool(int(...))
    try:
        return bool(int(value))
    except ValueError:
        return False


def transfer_backend(kwargs: Mapping[str, Any]) -> str | None:
    """The weight-transfer backend an engine built from ``engine_kwargs(...)`` starts with
    (``vllm_kwargs`` may have replaced the one refit.backend gave)."""
    config = kwargs.get("weight_transfer_config")
    if isinstance(config, Mapping):
        return config.get("backend")
    return getattr(config, "backend", None)


def _fmt_gb(value: float) -> str:
    # vLLM reads VLLM_CPU_KVCACHE_SPACE with int(): "0.5" would fail every engine at its start.
    if not float(value).is_integer():
        raise ConfigError(f"must be a whole number of GiB, got {value}", field="fleet.cpu_kvcache_space_gb")
    return str(int(value))


def _core_list(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)
