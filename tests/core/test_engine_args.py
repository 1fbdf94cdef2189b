"""nemo_gen.core.engine_args: generation config -> vllm.LLM kwargs and engine process env."""

from __future__ import annotations

from typing import Any

import pytest

from nemo_gen.core.engine_args import engine_env, engine_kwargs, transfer_backend
from nemo_gen.errors import ConfigError
from nemo_gen.settings import NemoGenSettings


def _cfg(vllm_kwargs: dict[str, Any] | None = None, **vllm_cfg: Any) -> dict[str, Any]:
    """A generation config as settings produce it (plus configure_generation_config's keys)."""
    cfg = NemoGenSettings.load().generation.to_generation_config()
    cfg["vllm_cfg"].update(vllm_cfg)
    if vllm_kwargs is not None:
        cfg["vllm_kwargs"] = vllm_kwargs
    return cfg


def _kw(device: str = "cpu", cfg: dict[str, Any] | None = None, **vllm_cfg: Any) -> dict[str, Any]:
    return engine_kwargs(
        cfg if cfg is not None else _cfg(**vllm_cfg),
        model_dir="/models/m",
        tokenizer_dir="/models/t",
        device=device,  # type: ignore[arg-type]
        seed=7,
    )


def _env(device: str = "cpu", cores=None, omp=1, kv=1.0, cfg=None, **vllm_cfg: Any) -> dict[str, str]:
    return engine_env(
        cfg if cfg is not None else _cfg(**vllm_cfg),
        device=device,  # type: ignore[arg-type]
        omp_threads=omp,
        cpu_kvcache_space_gb=kv,
        cpu_cores=cores,
    )


# --------------------------------------------------------------------------------------------
# engine_kwargs


def test_basic_kwargs():
    kw = _kw("cpu")
    assert kw["model"] == "/models/m"
    assert kw["tokenizer"] == "/models/t"
    assert kw["seed"] == 7
    assert kw["tensor_parallel_size"] == 1 and kw["pipeline_parallel_size"] == 1
    assert kw["kv_cache_dtype"] == "auto"
    assert kw["load_format"] == "auto"  # absent from the config -> vLLM's auto
    assert kw["skip_tokenizer_init"] is False
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["disable_log_stats"] is True


def test_minimal_config_uses_defaults():
    kw = engine_kwargs({}, model_dir="m", tokenizer_dir="t", device="gpu")
    assert kw["tensor_parallel_size"] == 1
    assert kw["dtype"] == "auto"
    assert kw["gpu_memory_utilization"] == 0.6
    assert kw["enforce_eager"] is False
    assert kw["seed"] == 0
    assert "max_model_len" not in kw
    assert "distributed_executor_backend" not in kw


def test_configured_load_format_and_skip_tokenizer_init_pass_through():
    kw = _kw("cpu", load_format="dummy", skip_tokenizer_init=True)
    assert kw["load_format"] == "dummy"
    assert kw["skip_tokenizer_init"] is True


@pytest.mark.parametrize("device, expected", [("cpu", True), ("gpu", False)])
def test_enforce_eager_default_depends_on_device(device, expected):
    assert _kw(device)["enforce_eager"] is expected


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("explicit", [True, False])
def test_explicit_enforce_eager_wins(device, explicit):
    assert _kw(device, enforce_eager=explicit)["enforce_eager"] is explicit


def test_gpu_memory_utilization_only_on_gpu():
    assert "gpu_memory_utilization" not in _kw("cpu", gpu_memory_utilization=0.3)
    assert _kw("gpu", gpu_memory_utilization=0.3)["gpu_memory_utilization"] == 0.3
    assert _kw("gpu")["gpu_memory_utilization"] == 0.6


@pytest.mark.parametrize("device, dtype", [("cpu", "float32"), ("gpu", "auto")])
def test_precision_auto(device, dtype):
    kw = _kw(device, precision="auto")
    assert kw["dtype"] == dtype
    assert "quantization" not in kw


@pytest.mark.parametrize("device", ["cpu", "gpu"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16", "float16", "half", "float"])
def test_explicit_precision_is_the_dtype(device, precision):
    kw = _kw(device, precision=precision)
    assert kw["dtype"] == precision
    assert "quantization" not in kw


def test_fp8_is_bf16_plus_online_per_tensor_fp8_quantization():
    kw = _kw("gpu", precision="fp8")
    assert kw["dtype"] == "bfloat16"
    assert kw["quantization"] == "fp8_per_tensor"  # vLLM's online FP8; "fp8" is its deprecated alias


def test_fp8_on_a_cpu_fleet_is_refused_naming_the_setting():
    with pytest.raises(ConfigError) as info:
        _kw("cpu", precision="fp8")
    assert info.value.field == "generation.vllm_cfg.precision" and "AMX" in str(info.value)


@pytest.mark.parametrize("precision", ["int4", "fp16", "BF16", "", None])
def test_unknown_precision_names_the_field(precision):
    with pytest.raises(ConfigError) as info:
        _kw("gpu", precision=precision)
    assert info.value.field == "generation.vllm_cfg.precision"
    assert "generation.vllm_cfg.precision" in str(info.value)
    assert repr(precision) in str(info.value)
    assert "fp8" in str(info.value)  # lists the accepted values


@pytest.mark.parametrize(
    "tp, pp, device, backend",
    [
        (2, 1, "cpu", "mp"),
        (1, 2, "cpu", "mp"),
        (2, 1, "gpu", "ray"),
        (2, 2, "gpu", "ray"),
        (1, 1, "cpu", None),
        (1, 1, "gpu", None),
    ],
)
def test_distributed_executor_backend(tp, pp, device, backend):
    kw = _kw(device, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert kw["tensor_parallel_size"] == tp and kw["pipeline_parallel_size"] == pp
    assert kw.get("distributed_executor_backend") == backend


def test_max_model_len_only_when_set():
    assert "max_model_len" not in _kw("cpu")
    assert "max_model_len" not in _kw("gpu", max_model_len=None)
    assert _kw("cpu", max_model_len=256)["max_model_len"] == 256


def test_prefix_caching_only_when_set():
    assert "enable_prefix_caching" not in _kw("gpu")
    assert _kw("gpu", enable_prefix_caching=False)["enable_prefix_caching"] is False


def test_expert_parallel_on_any_device():
    assert _kw("gpu", expert_parallel_size=2, tensor_parallel_size=2)["enable_expert_parallel"] is True
    assert _kw("cpu", expert_parallel_size=2, tensor_parallel_size=2)["enable_expert_parallel"] is True
    assert "enable_expert_parallel" not in _kw("gpu", expert_parallel_size=1)


def test_metrics_logger_turns_vllms_stats_logging_on():
    assert _kw("cpu")["disable_log_stats"] is True  # unset: off
    assert _kw("cpu", enable_vllm_metrics_logger=False)["disable_log_stats"] is True
    assert _kw("cpu", enable_vllm_metrics_logger=True)["disable_log_stats"] is False
    env = _env("cpu", enable_vllm_metrics_logger=True, vllm_metrics_logger_interval=0.5)
    assert env["VLLM_LOG_STATS_INTERVAL"] == "0.5"
    assert "VLLM_LOG_STATS_INTERVAL" not in _env("cpu", enable_vllm_metrics_logger=False, vllm_metrics_logger_interval=0.5)
    assert "VLLM_LOG_STATS_INTERVAL" not in _env("cpu", enable_vllm_metrics_logger=True)


def test_deep_gemm_is_vllms_switch_and_needs_a_gpu():
    assert _env("gpu", use_deep_gemm=True)["VLLM_USE_DEEP_GEMM"] == "1"
    assert _env("gpu", use_deep_gemm=False)["VLLM_USE_DEEP_GEMM"] == "0"
    assert _env("cpu", use_deep_gemm=False)["VLLM_USE_DEEP_GEMM"] == "0"
    assert "VLLM_USE_DEEP_GEMM" not in _env("gpu")
    with pytest.raises(ConfigError) as info:
        _env("cpu", use_deep_gemm=True)
    assert info.value.field == "generation.vllm_cfg.use_deep_gemm"


def test_worker_extension_cls():
    from nemo_gen.core.engine_args import WORKER_EXTENSION

    assert _kw("cpu")["worker_extension_cls"] == WORKER_EXTENSION
    assert _kw("cpu", worker_extension_cls="pkg.mod:Ext")["worker_extension_cls"] == "pkg.mod:Ext"


def test_vllm_kwargs_override_everything():
    overrides = {
        "dtype": "float16",
        "enforce_eager": False,
        "gpu_memory_utilization": 0.9,
        "distributed_executor_backend": "uni",
        "max_model_len": 99,
        "model": "/elsewhere",
        "seed": 123,
        "swap_space": 0,
    }
    cfg = _cfg(vllm_kwargs=overrides, tensor_parallel_size=2, max_model_len=256, precision="auto")
    kw = _kw("cpu", cfg=cfg)
    for key, value in overrides.items():
        assert kw[key] == value, key


def test_vllm_kwargs_none_is_empty():
    cfg = _cfg()
    cfg["vllm_kwargs"] = None
    assert _kw("cpu", cfg=cfg)["dtype"] == "float32"


def test_config_is_not_mutated():
    import copy

    cfg = _cfg(vllm_kwargs={"dtype": "float16"}, env_vars={"A": "1"})
    before = copy.deepcopy(cfg)
    _kw("gpu", cfg=cfg)
    _env("cpu", cfg=cfg, cores=[0])
    assert cfg == before


# --------------------------------------------------------------------------------------------
# engine_env


def test_cpu_env_basics():
    env = _env("cpu", omp=3, kv=1.0, cores=[0])
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"


@pytest.mark.parametrize("gb, text", [(1.0, "1"), (1, "1"), (2.0, "2")])
def test_kvcache_space_formatting(gb, text):
    assert _env("cpu", kv=gb)["VLLM_CPU_KVCACHE_SPACE"] == text


@pytest.mark.parametrize("gb", [1.5, 0.25])
def test_a_kvcache_space_vllm_cannot_read_is_refused(gb):
    with pytest.raises(ConfigError) as info:
        _env("cpu", kv=gb)
    assert info.value.field == "fleet.cpu_kvcache_space_gb"


def test_threads_bind_per_rank_for_tp2():
    assert _env("cpu", cores=[0, 1], tensor_parallel_size=2)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert _env("cpu", cores=[4, 5, 6, 7], tensor_parallel_size=2)["VLLM_CPU_OMP_THREADS_BIND"] == "4,5|6,7"
    assert _env("cpu", cores=[2, 3], pipeline_parallel_size=2)["VLLM_CPU_OMP_THREADS_BIND"] == "2|3"


def test_threads_bind_single_rank_takes_all_cores():
    assert _env("cpu", cores=[3, 4])["VLLM_CPU_OMP_THREADS_BIND"] == "3,4"


def test_threads_bind_more_ranks_than_cores_never_empty():
    bind = _env("cpu", cores=[5], tensor_parallel_size=2)["VLLM_CPU_OMP_THREADS_BIND"]
    ranks = bind.split("|")
    assert len(ranks) == 2
    assert all(ranks) and set(ranks) == {"5"}


@pytest.mark.parametrize("cores", [None, []])
def test_no_cores_means_nobind(cores):
    assert _env("cpu", cores=cores)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_env_vars_merged_and_stringified():
    env = _env("cpu", cores=[0], env_vars={"FOO": "bar", "N": 3, "Mixed_Case": "x"})
    assert env["FOO"] == "bar"
    assert env["N"] == "3"
    assert env["Mixed_Case"] == "x"
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


@pytest.mark.parametrize("key, setting", [("OMP_NUM_THREADS", "fleet.omp_threads_per_engine"),
                                          ("VLLM_CPU_KVCACHE_SPACE", "fleet.cpu_kvcache_space_gb"),
                                          ("VLLM_CPU_OMP_THREADS_BIND", "fleet.cpus_per_worker")])
def test_a_cpu_engines_computed_variable_is_refused_naming_its_setting(key, setting):
    # a NeMo-RL config handed to the API, or fleet.device auto that resolved to cpu, never went
    # through the settings' check: engine_env is where the device is known
    with pytest.raises(ConfigError) as err:
        _env("cpu", cores=[0], env_vars={key: "8"})
    assert err.value.field == f"generation.vllm_cfg.env_vars.{key}" and setting in str(err.value)
    assert _env("gpu", env_vars={key: "8"})[key] == "8"  # a GPU engine's are the user's to set


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_a_variable_the_fleet_sets_on_every_device_is_refused_naming_its_setting(device):
    from nemo_gen.core.engine_args import FLEET_ENV

    for key, setting in FLEET_ENV.items():
        with pytest.raises(ConfigError) as err:
            _env(device, cores=[0], env_vars={key: "1"})
        assert err.value.field == f"generation.vllm_cfg.env_vars.{key}" and setting in str(err.value), key


@pytest.mark.parametrize("key", ["", "A=B", "A\0B", "9LIVES"])
def test_an_env_vars_key_that_is_no_variable_name_is_refused_by_engine_env(key):
    with pytest.raises(ConfigError) as err:
        _env("gpu", env_vars={key: "1"})
    assert err.value.field == f"generation.vllm_cfg.env_vars.{key}" and repr(key) in str(err.value)


def test_every_variable_the_fleet_computes_is_one_env_vars_may_not_name():
    """engine_env with every option that adds a variable on, and nemo_gen.environment's: each is in
    FLEET_ENV or CPU_FLEET_ENV, so a new one cannot be overridden by env_vars unnoticed."""
    from nemo_gen.core.engine_args import CPU_FLEET_ENV, FLEET_ENV
    from nemo_gen.environment import SET_HERE

    cfg = _cfg(use_deep_gemm=False, enable_vllm_metrics_logger=True, vllm_metrics_logger_interval=5)
    computed = set()
    for device in ("cpu", "gpu"):
        computed |= set(engine_env(cfg, device=device, omp_threads=1, cpu_kvcache_space_gb=1.0, cpu_cores=[0],
                                   niceness=3, weight_transfer_backend="ipc"))
    assert "VLLM_LOG_STATS_INTERVAL" in computed and "VLLM_ALLOW_INSECURE_SERIALIZATION" in computed
    assert computed | set(SET_HERE) <= set(FLEET_ENV) | set(CPU_FLEET_ENV)


def test_gpu_env_has_no_cpu_vars():
    env = _env("gpu", cores=[0, 1], omp=4, kv=2.0, env_vars={"FOO": "bar"})
    assert env == {"FOO": "bar"}
    assert _env("gpu") == {}


def test_weight_transfer_backend_becomes_vllms_weight_transfer_config():
    kw = engine_kwargs({}, model_dir="m", tokenizer_dir="t", device="cpu", weight_transfer_backend="nemo_gen_shm")
    assert kw["weight_transfer_config"] == {"backend": "nemo_gen_shm"}
    assert "weight_transfer_config" not in engine_kwargs({}, model_dir="m", tokenizer_dir="t", device="cpu")
    # vllm_kwargs still win over everything derived
    kw = engine_kwargs({"vllm_kwargs": {"weight_transfer_config": {"backend": "nccl"}}}, model_dir="m",
                       tokenizer_dir="t", device="gpu", weight_transfer_backend="ipc")
    assert kw["weight_transfer_config"] == {"backend": "nccl"}


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_niceness_is_rays_worker_niceness_when_given(device):
    cfg = _cfg()
    env = engine_env(cfg, device=device, omp_threads=1, cpu_kvcache_space_gb=1.0, niceness=0)
    assert env["RAY_worker_niceness"] == "0"
    assert "RAY_worker_niceness" not in _env(device)  # not given: Ray's own default stands


def test_vllms_ipc_backend_lets_the_engine_take_its_pickled_cuda_handles():
    # Without it every refit through vLLM's ipc failed in the engine's msgpack channel (H200).
    assert _env("gpu").get("VLLM_ALLOW_INSECURE_SERIALIZATION") is None
    for backend in ("nemo_gen_ipc", "nemo_gen_shm", "nccl"):
        env = engine_env(_cfg(), device="gpu", omp_threads=1, cpu_kvcache_space_gb=1.0,
                         weight_transfer_backend=backend)
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in env, backend
    env = engine_env(_cfg(), device="gpu", omp_threads=1, cpu_kvcache_space_gb=1.0, weight_transfer_backend="ipc")
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"


@pytest.mark.parametrize("value", ["0", "", "no", "1"])
@pytest.mark.parametrize("backend", ["ipc", "nemo_gen_ipc", "nemo_gen_shm", None])
def test_an_env_var_that_sets_the_engines_pickling_is_refused_by_name(value, backend):
    # off, it breaks the ipc backend's refits; on, it lets pickle into every engine of any backend
    cfg = _cfg(env_vars={"VLLM_ALLOW_INSECURE_SERIALIZATION": value})
    with pytest.raises(ConfigError) as err:
        engine_env(cfg, device="gpu", omp_threads=1, cpu_kvcache_space_gb=1.0, weight_transfer_backend=backend)
    assert err.value.field == "generation.vllm_cfg.env_vars.VLLM_ALLOW_INSECURE_SERIALIZATION"
    assert "refit.backend" in str(err.value) and "'ipc'" in str(err.value) and "nemo_gen_ipc" in str(err.value)


def test_the_transfer_backend_is_the_one_the_engine_starts_with():
    kw = engine_kwargs({}, model_dir="m", tokenizer_dir="t", device="gpu", weight_transfer_backend="ipc")
    assert transfer_backend(kw) == "ipc"
    kw = engine_kwargs({"vllm_kwargs": {"weight_transfer_config": {"backend": "nccl"}}}, model_dir="m",
                       tokenizer_dir="t", device="gpu", weight_transfer_backend="ipc")
    assert transfer_backend(kw) == "nccl"
    assert transfer_backend(engine_kwargs({}, model_dir="m", tokenizer_dir="t", device="gpu")) is None


def test_a_gpu_fleet_on_vllms_ipc_backend_starts_its_engines_able_to_take_the_handles(make_settings):
    from nemo_gen.core.placement import ClusterResources
    from nemo_gen.fleet.resolve import resolve_generation

    gpu = ClusterResources.from_nodes([{"GPU": 2, "CPU": 8}])
    resolved = resolve_generation(make_settings(fleet__device="gpu", refit__backend="ipc"), gpu)
    assert resolved.shards[0].engine_env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    resolved = resolve_generation(make_settings(fleet__device="gpu", refit__backend="nemo_gen_ipc"), gpu)
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in resolved.shards[0].engine_env
    with pytest.raises(ConfigError) as err:
        resolve_generation(make_settings(**{"fleet__device": "gpu", "refit__backend": "ipc",
                                            "generation__vllm_cfg__env_vars": {"VLLM_ALLOW_INSECURE_SERIALIZATION": "0"}}),
                           gpu)
    assert err.value.field == "generation.vllm_cfg.env_vars.VLLM_ALLOW_INSECURE_SERIALIZATION"


def test_vllms_engine_rpc_carries_ipc_handles_only_with_pickling_allowed(monkeypatch):
    """The premise of ALLOW_PICKLE, on vLLM's own codec (what the shard actor's RPC into its
    EngineCore encodes with): an ipc update's handle arguments hold torch classes and dtypes,
    refused as they were on the H200, and carried with the variable on."""
    import torch
    from vllm import envs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from nemo_gen.core.engine_args import ALLOW_PICKLE

    envs.disable_envs_cache()  # read the variable at each use, as a fresh engine process does
    # the shape of torch.multiprocessing.reductions.reduce_tensor's CUDA args (rebuild_cuda_tensor)
    handle_args = (torch.Tensor, (4, 2), (2, 1), 0, torch.bfloat16, 0, b"handle", 16, 0, True)
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 2]],
              "ipc_handles": [{"GPU-0": handle_args}]}
    monkeypatch.delenv(ALLOW_PICKLE, raising=False)
    with pytest.raises(TypeError, match="not serializable"):
        MsgpackEncoder().encode(("update_weights", (update,)))
    monkeypatch.setenv(ALLOW_PICKLE, "1")
    frames = MsgpackEncoder().encode(("update_weights", (update,)))
    method, (back,) = MsgpackDecoder().decode(frames)
    assert method == "update_weights"
    args = back["ipc_handles"][0]["GPU-0"]
    assert args[0] is torch.Tensor and args[4] is torch.bfloat16 and args[6] == b"handle"


# --------------------------------------------------------------------------------------------
# rollout-sized steps: max_num_seqs and the CUDA-graph capture size


def test_max_num_seqs_defaults_to_a_rollout_batch_for_both_engines():
    # vLLM's AsyncLLM would take 128 sequences a step (its ENGINE_CONTEXT default): the setting's
    # 1024 reaches the engine arguments whether or not the shard runs the async engine.
    assert _kw("gpu")["max_num_seqs"] == 1024
    assert _kw("gpu", async_engine=True)["max_num_seqs"] == 1024
    assert _kw("cpu")["max_num_seqs"] == 1024


def test_max_num_seqs_null_leaves_vllm_its_default():
    assert "max_num_seqs" not in _kw("gpu", max_num_seqs=None)


def test_capture_size_reaches_a_gpu_engine_and_is_left_to_vllm_when_unset():
    assert "max_cudagraph_capture_size" not in _kw("gpu")
    assert _kw("gpu", max_cudagraph_capture_size=1024)["max_cudagraph_capture_size"] == 1024


@pytest.mark.parametrize("device, eager", [("cpu", None), ("gpu", True)])
def test_capture_size_refused_where_no_graph_is_captured(device, eager):
    with pytest.raises(ConfigError, match="CUDA graphs") as err:
        _kw(device, max_cudagraph_capture_size=512, enforce_eager=eager)
    assert err.value.field == "generation.vllm_cfg.max_cudagraph_capture_size"


def test_vllm_kwargs_override_the_rollout_defaults():
    kw = _kw("gpu", cfg=_cfg(vllm_kwargs={"max_num_seqs": 64, "max_cudagraph_capture_size": 128},
                             max_cudagraph_capture_size=1024))
    assert kw["max_num_seqs"] == 64 and kw["max_cudagraph_capture_size"] == 128


def test_settings_carry_both_keys_to_the_engine():
    s = NemoGenSettings.load(overrides={"generation.vllm_cfg.max_num_seqs": 512,
                                        "generation.vllm_cfg.max_cudagraph_capture_size": 512})
    kw = _kw("gpu", cfg=s.generation.to_generation_config())
    assert kw["max_num_seqs"] == 512 and kw["max_cudagraph_capture_size"] == 512
