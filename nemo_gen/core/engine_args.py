"""Translate a resolved NeMo-RL generation config into vLLM engine arguments and process env.

Pure: it only builds dicts. The shard actor passes ``engine_kwargs`` to ``vllm.LLM`` (or
``AsyncEngineArgs``) and ``engine_env`` becomes the actor's ``runtime_env`` so every process
the engine forks (EngineCore, workers) inherits it from birth. It also owns which variables the
fleet sets itself (``FLEET_ENV``, ``CPU_FLEET_ENV``), which ``vllm_cfg.env_vars`` may not name.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Mapping

from nemo_gen.errors import ConfigError

Device = Literal["cpu", "gpu"]

# Refit runs inside every vLLM worker through this mixin (nemo_gen/vllm_ext/worker_ext.py); the
# module named here also registers nemo_gen's weight-transfer backends in the worker.
WORKER_EXTENSION = "nemo_gen.vllm_ext.worker_entry.NemoGenWorkerExtension"

# The nice value the raylet starts a worker process at (Ray's default: 15).
RAY_WORKER_NICENESS = "RAY_worker_niceness"

# vLLM's own ``ipc`` weight-transfer backend hands the update RPC its CUDA IPC handles as
# they are (tuples holding torch classes and dtypes). The engine's msgpack channel between the
# shard actor and its EngineCore refuses those unless vLLM may fall back to pickle: every refit
# fails with "Object of type <class 'torch._C._TensorMeta'> is not serializable" on a CUDA
# engine unless this is set. vLLM's HTTP refit routes need the same switch for the same
# handles. The channel is the engine's own (one host, one user); no other backend needs it.
ALLOW_PICKLE = "VLLM_ALLOW_INSECURE_SERIALIZATION"
PICKLED_HANDLE_BACKENDS = frozenset({"ipc"})

# Read by the raylet once, at its own start (nemo_gen.environment sets it before Ray starts).
REAPING_FLAG = "RAY_process_group_cleanup_enabled"

# Variables the fleet sets itself, each from the setting named here. An env_vars entry would skip
# that setting's checks (the CPU check of use_deep_gemm, the ipc backend's need for pickling) or
# contradict it in the engines alone; the raylet's and the driver's would not even reach the
# process that reads them. On every device:
FLEET_ENV: dict[str, str] = {
    REAPING_FLAG: "health.enabled (the raylet reads it where Ray starts, never in an engine; to keep a "
                  "killed shard's processes, set it to 0 in the environment of the process that starts Ray)",
    ALLOW_PICKLE: "refit.backend (on for vLLM's 'ipc' backend alone, whose CUDA IPC handles need it; "
                  "'nemo_gen_ipc' does without)",
    RAY_WORKER_NICENESS: "fleet.engine_niceness",
    "VLLM_USE_DEEP_GEMM": "generation.vllm_cfg.use_deep_gemm",
    "VLLM_LOG_STATS_INTERVAL": "generation.vllm_cfg.vllm_metrics_logger_interval",
    "RAY_AUTH_MODE": "ray.address (nemo_gen.environment sets it for the driver that attaches to a cluster)",
    "RAY_USAGE_STATS_ENABLED": "the environment of the process that starts Ray (nemo_gen.environment sets "
                               "it to 0 there when unset)",
}
# ... and on a CPU fleet, where each engine's threads, cores and KV cache come from the fleet's shape:
CPU_FLEET_ENV: dict[str, str] = {
    "OMP_NUM_THREADS": "fleet.omp_threads_per_engine",
    "VLLM_CPU_KVCACHE_SPACE": "fleet.cpu_kvcache_space_gb",
    "VLLM_CPU_OMP_THREADS_BIND": "fleet.cpus_per_worker (each CPU shard is pinned to cores of its own)",
}
ENV_VARS_FIELD = "generation.vllm_cfg.env_vars"
# POSIX's portable names: what a shell can export and every process reads back unchanged.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

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
        if device == "cpu":
            # vLLM's CPU FP8 kernels need AMX tiles (Sapphire Rapids or newer) and a bfloat16
            # model, the dtype this project's CPU engines avoid (see "auto" below).
            raise ConfigError(
                "fp8 runs on GPU fleets only: vLLM's CPU FP8 kernels need AMX and bfloat16; "
                "use float32 or bfloat16 on fleet.device=cpu", field="generation.vllm_cfg.precision")
        kwargs["dtype"] = "bfloat16"
        # vLLM's online per-tensor FP8 (its "fp8" on a bf16 checkpoint is a deprecated alias):
        # quantized at load and again at every reload (layerwise), so a refit sends bf16.
        kwargs["quantization"] = "fp8_per_tensor"
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
    if vc.get("max_num_seqs") is not None:
        # AsyncLLM's own default is 128 a step: a larger rollout batch would queue in waves.
        kwargs["max_num_seqs"] = vc["max_num_seqs"]
    if vc.get("max_cudagraph_capture_size") is not None:
        if device == "cpu" or kwargs["enforce_eager"]:
            raise ConfigError(
                "CUDA graphs are captured by GPU engines with enforce_eager off only: leave "
                "max_cudagraph_capture_size unset here", field="generation.vllm_cfg.max_cudagraph_capture_size")
        kwargs["max_cudagraph_capture_size"] = vc["max_cudagraph_capture_size"]
    if vc.get("enable_prefix_caching") is not None:
        kwargs["enable_prefix_caching"] = vc["enable_prefix_caching"]
    if device == "gpu":
        kwargs["gpu_memory_utilization"] = vc.get("gpu_memory_utilization", 0.6)
    if (gen_cfg.get("colocated") or {}).get("enabled"):
        if device == "cpu":
            # vLLM's CPU worker logs "sleep mode is not supported on CPU" and keeps its memory:
            # a trainer counting on it would find none freed.
            raise ConfigError(
                "generation.colocated.enabled=true needs GPU engines: vLLM's CPU worker ignores sleep "
                "(nothing would be freed for a trainer); set it false on fleet.device=cpu",
                field="generation.colocated.enabled")
        # vLLM's CuMem allocator tags weights and KV cache so sleep can offload / drop them.
        kwargs["enable_sleep_mode"] = True
    if vc.get("expert_parallel_size", 1) > 1:
        # vLLM's EP group is the engine's TP ranks (settings allow EP = TP only): MoE layers are
        # sharded by expert instead of by tensor.
        kwargs["enable_expert_parallel"] = True
    world = kwargs["tensor_parallel_size"] * kwargs["pipeline_parallel_size"]
    if world > 1:
        # CPU ranks are forked processes inside the shard's bundle; on GPU vLLM schedules its
        # ranks as Ray workers in the shard's placement group.
        kwargs["distributed_executor_backend"] = "mp" if device == "cpu" else "ray"
    lora = vc.get("lora") or {}
    if lora.get("enabled"):
        # Every adapter the fleet holds fits in one batch: the fleet's bound is the engine's.
        kwargs.update(enable_lora=True, max_lora_rank=lora["max_rank"], max_loras=lora["max_adapters"],
                      max_cpu_loras=lora["max_adapters"])
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
    (``transfer_backend(engine_kwargs)``); vLLM's ``ipc`` gets ALLOW_PICKLE. ``vllm_cfg.env_vars``
    are added as written; an entry ``env_var_problems`` refuses, or one naming a variable computed
    here, is a ConfigError naming the key and the setting that controls it.
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
    user = {str(key): str(value) for key, value in (vc.get("env_vars") or {}).items()}
    # Settings refuse these at load; a NeMo-RL config handed to the API directly is checked here,
    # and so is a variable computed above for a device settings could not know (fleet.device auto).
    problems = env_var_problems(user, device) + [
        (key, f"the fleet sets {key} itself" + _from(key)) for key in user if key in env]
    if problems:
        key, message = problems[0]
        raise ConfigError(message, field=f"{ENV_VARS_FIELD}.{key}")
    env.update(user)
    return env


def env_var_problems(env_vars: Mapping[Any, Any], device: Device | None) -> list[tuple[str, str]]:
    """(key, why) for each entry of ``vllm_cfg.env_vars`` an engine cannot be given: a name that
    is no environment variable's, a value no process environment can hold, or a variable the
    fleet sets itself (``FLEET_ENV``; ``CPU_FLEET_ENV`` too on a CPU fleet, and when ``device``
    is not known yet, None, only ``FLEET_ENV``), named with the setting that controls it."""
    owned = {**FLEET_ENV, **(CPU_FLEET_ENV if device == "cpu" else {})}
    problems = []
    for key, value in env_vars.items():
        key = str(key)
        if not _ENV_NAME.fullmatch(key):
            problems.append((key, f"{key!r} is not an environment variable name (letters, digits and _, "
                                  "not starting with a digit)"))
        elif key in owned:
            problems.append((key, f"the fleet sets {key} itself" + _from(key)))
        elif "\0" in str(value):
            problems.append((key, f"the value of {key} holds a NUL character, which no environment can carry"))
    return problems


def _from(key: str) -> str:
    setting = FLEET_ENV.get(key) or CPU_FLEET_ENV.get(key)
    return f" from {setting}: set that instead of env_vars" if setting else ": drop it from env_vars"


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
