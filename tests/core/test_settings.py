"""nemo_gen.settings: defaults, YAML < env < overrides, one ConfigError naming the dotted field
(with a suggestion for a misspelt key), enumerated values checked against what exists, every
NeMo-RL key either acted on, listed as not used, or refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel

from nemo_gen.errors import ConfigError, DataError
from nemo_gen.settings import (
    ENV_PREFIX,
    FleetSettings,
    GenerationSettings,
    NemoGenSettings,
    VllmCfg,
    parse_override,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No NEMO_GEN_* variable from the calling shell leaks into these tests."""
    for key in list(os.environ):
        if key.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(key)


def _write(tmp_path: Path, text: str, name: str = "settings.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _raises_config_error(**load_kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        NemoGenSettings.load(**load_kwargs)
    return info.value


# --------------------------------------------------------------------------------------------
# defaults


def test_defaults():
    s = NemoGenSettings.load()
    assert s.home == Path(".nemo-gen")
    assert s.model.path is None and s.model.tokenizer is None and s.model.name is None
    assert s.fleet.name == "default"
    assert s.fleet.num_shards == 2
    assert s.fleet.mode == "eval"
    assert s.fleet.device == "auto"
    assert s.fleet.cpu_kvcache_space_gb == 1.0
    assert s.fleet.omp_threads_per_engine == 1
    assert s.health.enabled is True
    assert s.health.unhealthy_threshold == 3
    assert s.health.min_healthy_shards == 1
    assert s.ray.address is None
    assert s.ray.namespace == "nemo_gen"
    assert s.prefect.api_url is None
    assert s.run.input is None and s.run.output is None
    assert s.run.batch_size == 64
    assert len(s.run.prompts) == 8 and all(isinstance(p, str) and p for p in s.run.prompts)
    g = s.generation
    assert g.backend == "vllm"
    assert g.max_new_tokens == 32
    assert g.temperature == 1.0 and g.top_p == 1.0 and g.top_k is None
    assert g.stop_token_ids is None and g.stop_strings is None and g.bad_words is None
    assert g.vllm_kwargs == {}
    v = g.vllm_cfg
    assert (v.tensor_parallel_size, v.pipeline_parallel_size, v.expert_parallel_size) == (1, 1, 1)
    assert v.gpu_memory_utilization == 0.6  # NeMo-RL's YAML default
    assert v.max_model_len is None
    assert v.precision == "auto"
    assert v.kv_cache_dtype == "auto"
    assert v.enforce_eager is None
    assert v.async_engine is False
    assert v.env_vars == {}
    assert s.run.resume is False
    assert s.not_used == []


def test_default_factories_are_not_shared():
    a, b = NemoGenSettings.load(), NemoGenSettings.load()
    a.generation.vllm_cfg.env_vars["X"] = "1"
    a.run.prompts.append("extra")
    assert b.generation.vllm_cfg.env_vars == {}
    assert "extra" not in b.run.prompts


# --------------------------------------------------------------------------------------------
# precedence: defaults < YAML < env < overrides


def test_yaml_overrides_defaults(tmp_path):
    path = _write(tmp_path, """
        fleet:
          num_shards: 7
          name: from-yaml
        generation:
          vllm_cfg:
            tensor_parallel_size: 2
    """)
    s = NemoGenSettings.load(path)
    assert s.fleet.num_shards == 7
    assert s.fleet.name == "from-yaml"
    assert s.fleet.mode == "eval"  # untouched keys keep their defaults
    assert s.generation.vllm_cfg.tensor_parallel_size == 2
    assert s.generation.vllm_cfg.pipeline_parallel_size == 1


def test_env_overrides_yaml_and_nests_with_double_underscore(tmp_path, monkeypatch):
    path = _write(tmp_path, """
        fleet:
          num_shards: 7
          name: from-yaml
        generation:
          vllm_cfg:
            tensor_parallel_size: 2
    """)
    monkeypatch.setenv("NEMO_GEN_FLEET__NUM_SHARDS", "4")
    monkeypatch.setenv("NEMO_GEN_GENERATION__VLLM_CFG__GPU_MEMORY_UTILIZATION", "0.3")
    monkeypatch.setenv("NEMO_GEN_HOME", str(tmp_path / "home"))
    s = NemoGenSettings.load(path)
    assert s.fleet.num_shards == 4  # env beats YAML
    assert s.fleet.name == "from-yaml"  # a sibling from YAML survives the env's partial update
    assert s.generation.vllm_cfg.gpu_memory_utilization == 0.3
    assert s.generation.vllm_cfg.tensor_parallel_size == 2
    assert s.home == tmp_path / "home"


def test_overrides_beat_env_and_yaml(tmp_path, monkeypatch):
    path = _write(tmp_path, "fleet:\n  num_shards: 7\n  name: from-yaml\n")
    monkeypatch.setenv("NEMO_GEN_FLEET__NUM_SHARDS", "4")
    s = NemoGenSettings.load(path, ["fleet.num_shards=9"])
    assert s.fleet.num_shards == 9
    assert s.fleet.name == "from-yaml"


def test_list_overrides_are_parsed_as_yaml():
    s = NemoGenSettings.load(
        overrides=[
            "fleet.num_shards=3",
            "fleet.cpus_per_worker=0.5",
            "health.enabled=false",
            "generation.top_k=null",
            "generation.stop_strings=[foo, '</s>']",
            "generation.stop_token_ids=[1, 2]",
            "generation.vllm_cfg.env_vars={A: '1'}",
            "fleet.name=with=equals",  # only the first '=' separates key and value
            "ray.address=",  # empty value: the empty string
        ]
    )
    assert s.fleet.num_shards == 3
    assert s.fleet.cpus_per_worker == 0.5
    assert s.health.enabled is False
    assert s.generation.top_k is None
    assert s.generation.stop_strings == ["foo", "</s>"]
    assert s.generation.stop_token_ids == [1, 2]
    assert s.generation.vllm_cfg.env_vars == {"A": "1"}
    assert s.fleet.name == "with=equals"
    assert s.ray.address == ""


def test_later_list_override_wins():
    s = NemoGenSettings.load(overrides=["fleet.num_shards=3", "fleet.num_shards=5"])
    assert s.fleet.num_shards == 5


def test_dict_overrides_with_dotted_keys(monkeypatch):
    monkeypatch.setenv("NEMO_GEN_FLEET__NUM_SHARDS", "4")
    s = NemoGenSettings.load(
        overrides={"fleet.num_shards": 3, "generation.vllm_cfg.max_model_len": 256, "home": "/tmp/x"}
    )
    assert s.fleet.num_shards == 3
    assert s.generation.vllm_cfg.max_model_len == 256
    assert s.home == Path("/tmp/x")


def test_dict_override_values_are_not_yaml_parsed():
    s = NemoGenSettings.load(overrides={"fleet.name": "3"})
    assert s.fleet.name == "3"


def test_parse_override():
    assert parse_override("fleet.num_shards=4") == ("fleet.num_shards", 4)
    assert parse_override(" fleet.name = x") == ("fleet.name", "x")
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a.b=") == ("a.b", "")
    assert parse_override("a.b=true") == ("a.b", True)


@pytest.mark.parametrize("bad", ["noequals", "=3", " =3"])
def test_malformed_override_names_set(bad):
    err = _raises_config_error(overrides=[bad])
    assert err.field == "--set"
    assert repr(bad) in str(err)


def test_overrides_as_a_single_string_rejected():
    err = _raises_config_error(overrides="fleet.num_shards=3")
    assert err.field == "overrides"


def test_override_value_then_section_conflict():
    err = _raises_config_error(overrides=["fleet=5", "fleet.num_shards=3"])
    assert err.field == "fleet.num_shards"


# --------------------------------------------------------------------------------------------
# unknown keys and wrong types name the dotted field


@pytest.mark.parametrize(
    "dotted",
    [
        "bogus",
        "model.bogus",
        "generation.bogus",
        "generation.vllm_cfg.bogus",
        "fleet.bogus",
        "health.bogus",
        "ray.bogus",
        "prefect.bogus",
        "run.bogus",
    ],
)
def test_unknown_override_names_the_field(dotted):
    err = _raises_config_error(overrides=[f"{dotted}=1"])
    assert err.field == dotted
    assert dotted in str(err)
    assert "unknown setting" in str(err)
    assert isinstance(err, DataError)


@pytest.mark.parametrize(
    "dotted",
    ["bogus", "fleet.bogus", "generation.vllm_cfg.bogus", "refit.bogus"],
)
def test_unknown_yaml_key_names_field_and_file(tmp_path, dotted):
    doc: dict = {}
    node = doc
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = 1
    path = tmp_path / "settings.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    err = _raises_config_error(path=path)
    assert err.field == dotted
    assert dotted in str(err)
    assert str(path) in str(err)


def test_unknown_env_key_names_the_field(monkeypatch):
    monkeypatch.setenv("NEMO_GEN_FLEET__BOGUS", "1")
    err = _raises_config_error()
    assert err.field == "fleet.bogus"


def test_every_problem_is_listed():
    err = _raises_config_error(overrides=["fleet.bogus=1", "fleet.num_shards=abc"])
    assert set(err.fields) == {"fleet.bogus", "fleet.num_shards"}
    assert "fleet.bogus" in str(err) and "fleet.num_shards" in str(err)


@pytest.mark.parametrize(
    "override, dotted",
    [
        ("fleet.num_shards=abc", "fleet.num_shards"),
        ("fleet.mode=bogus", "fleet.mode"),
        ("fleet.device=tpu", "fleet.device"),
        ("health.enabled=[1]", "health.enabled"),
        ("generation.temperature=hot", "generation.temperature"),
        ("generation.stop_strings=abc", "generation.stop_strings"),
        ("generation.vllm_cfg.kv_cache_dtype=int4", "generation.vllm_cfg.kv_cache_dtype"),
        ("generation.vllm_cfg.gpu_memory_utilization=1.5", "generation.vllm_cfg.gpu_memory_utilization"),
        ("generation.vllm_cfg.env_vars=[1]", "generation.vllm_cfg.env_vars"),
        ("generation.top_k=0", "generation.top_k"),
        ("prefect.port=70000", "prefect.port"),
        ("fleet=5", "fleet"),
    ],
)
def test_wrong_type_names_the_field(override, dotted):
    err = _raises_config_error(overrides=[override])
    assert err.field == dotted
    assert str(err).startswith("invalid settings: ")
    assert f"{dotted}:" in str(err)


def test_wrong_type_in_list_element_names_the_index():
    err = _raises_config_error(overrides=["generation.stop_token_ids=[1, a]"])
    assert err.field == "generation.stop_token_ids.1"


def test_wrong_type_from_file_names_the_file(tmp_path):
    path = _write(tmp_path, "fleet:\n  num_shards: many\n")
    err = _raises_config_error(path=path)
    assert err.field == "fleet.num_shards"
    assert str(path) in str(err)
    assert "'many'" in str(err)


@pytest.mark.parametrize(
    "dotted", ["generation.vllm_cfg.tensor_parallel_size", "generation.vllm_cfg.pipeline_parallel_size",
               "fleet.num_shards", "generation.max_new_tokens"]
)
def test_zero_sizes_rejected(dotted):
    err = _raises_config_error(overrides=[f"{dotted}=0"])
    assert err.field == dotted
    assert dotted in str(err)


def test_assignment_is_validated():
    s = NemoGenSettings.load()
    with pytest.raises(ValueError):
        s.fleet.num_shards = 0
    with pytest.raises(ValueError):
        s.generation.vllm_cfg.tensor_parallel_size = "x"


# --------------------------------------------------------------------------------------------
# a NeMo-RL generation block (grpo_math_1B.yaml's, interpolations replaced by literals): the keys
# nemo_gen acts on keep their values; NeMo-RL's others are listed as not used, with the reason

NEMO_RL_BLOCK = """
generation:
  backend: "vllm"
  model_name: "Qwen/Qwen2.5-1.5B"
  max_new_tokens: 512
  temperature: 1.0
  top_p: 1.0
  top_k: null
  stop_token_ids: null
  stop_strings: null
  port_range_low: 3000
  port_range_high: 4999
  refit_transport: null
  real_quant_export_cpu_offload: true
  vllm_cfg:
    async_engine: false
    precision: "bfloat16"
    kv_cache_dtype: "auto"
    logprobs_mode: "processed_logprobs"
    tensor_parallel_size: 1
    pipeline_parallel_size: 1
    expert_parallel_size: 1
    gpu_memory_utilization: 0.6
    max_model_len: 512
    enforce_eager: False
    use_tqdm: true
    use_deep_gemm: False
    num_last_layers_in_bf16: 0
    num_first_layers_in_bf16: 0
    enable_vllm_metrics_logger: true
    vllm_metrics_logger_interval: 0.5
    reset_encoder_cache_after_weight_update: false
    http_refit_server_port: null
  vllm_kwargs: {}
  colocated:
    enabled: true
    resources:
      gpus_per_node: null
      num_nodes: null
"""

NOT_USED_IN_BLOCK = {
    "generation.port_range_low", "generation.port_range_high", "generation.refit_transport",
    "generation.real_quant_export_cpu_offload", "generation.vllm_cfg.use_tqdm",
    "generation.vllm_cfg.num_last_layers_in_bf16", "generation.vllm_cfg.num_first_layers_in_bf16",
    "generation.vllm_cfg.reset_encoder_cache_after_weight_update", "generation.vllm_cfg.http_refit_server_port",
    "generation.colocated.resources.gpus_per_node", "generation.colocated.resources.num_nodes",
}


def test_nemo_rl_generation_block_loads(tmp_path):
    import yaml

    path = tmp_path / "grpo.yaml"
    path.write_text(NEMO_RL_BLOCK)
    given = yaml.safe_load(NEMO_RL_BLOCK)["generation"]
    settings = NemoGenSettings.load(path)
    cfg = settings.generation.to_generation_config()
    assert {n.key for n in settings.not_used} == NOT_USED_IN_BLOCK
    assert all(n.reason for n in settings.not_used)
    # colocated.enabled is nemo_gen's own setting (engines with sleep mode); resources is not used
    assert settings.generation.colocated.enabled is True

    def check(expected: dict, actual: dict, where: str) -> None:
        for key, value in expected.items():
            if f"{where}{key}" in NOT_USED_IN_BLOCK or f"{where}{key}" == "generation.colocated.resources":
                assert key not in actual, f"{where}{key} is not used, yet in the generation config"
                continue
            assert key in actual, f"{where}{key} missing"
            if isinstance(value, dict) and value:
                check(value, actual[key], f"{where}{key}.")
            else:
                assert actual[key] == value and type(actual[key]) is type(value), f"{where}{key}"

    check(given, cfg, "generation.")
    assert cfg["vllm_cfg"]["enable_vllm_metrics_logger"] is True  # acts: vLLM's stats logging on
    assert cfg["vllm_cfg"]["vllm_metrics_logger_interval"] == 0.5
    # NeMo-RL's model_name is the model to load: model.path takes it when unset.
    assert settings.model.path == Path("Qwen/Qwen2.5-1.5B")
    # NeMo-RL decides these when absent.
    assert "skip_tokenizer_init" not in cfg["vllm_cfg"]
    assert "load_format" not in cfg["vllm_cfg"]
    json.dumps(cfg)  # a plain, serialisable dict


def test_every_nemo_rl_key_is_a_field_or_accounted_for():
    """NeMo-RL's GenerationConfig / VllmConfig / VllmSpecificArgs keys: each is one nemo_gen acts
    on (a field), or one the loader knows it does not use (NEMO_RL_KEYS) — never unknown."""
    from nemo_gen.config.loader import NEMO_RL_ALIASES, NEMO_RL_KEYS
    from nemo_gen.generation.interfaces import GenerationConfig, VllmConfig, VllmSpecificArgs

    internal = {"_pad_token_id", "_mtp_weights_from_refit", "_debug_payload_metrics", "_draft_weights_from_refit",
                "_draft_full_refit"}
    for scope, typed, model in (("generation", VllmConfig, GenerationSettings),
                                ("generation", GenerationConfig, GenerationSettings),
                                ("generation.vllm_cfg", VllmSpecificArgs, VllmCfg)):
        for key in set(typed.__annotations__) - internal:
            dotted = f"{scope}.{key}"
            assert [key in model.model_fields, dotted in NEMO_RL_KEYS, dotted in NEMO_RL_ALIASES].count(True) == 1, dotted
    # and every table key names a place nemo_gen's schema does not hold
    for dotted in NEMO_RL_KEYS:
        scope, key = dotted.rsplit(".", 1)
        model = VllmCfg if scope == "generation.vllm_cfg" else GenerationSettings
        assert key not in model.model_fields, dotted


@pytest.mark.parametrize(
    "override, reason",
    [
        ("generation.vllm_cfg.tool_parser_plugin=my.parser", "not supported yet"),
        ("generation.vllm_cfg.http_refit_server_port=8000", "not supported yet"),
        ("generation.vllm_cfg.is_mx=true", "not supported"),
        ("generation.vllm_cfg.enable_return_routed_experts=true", "not supported"),
        ("generation.vllm_cfg.num_first_layers_in_bf16=2", "not supported"),
        ("generation.vllm_cfg.num_last_layers_in_bf16=1", "not supported"),
        ("generation.vllm_cfg.cap_max_tokens_to_context=false", "not supported"),
        ("generation.vllm_cfg.video={num_frames: 8}", "not supported"),
        ("generation.refit_transport=nixl", "refit.backend"),
        ("generation.quant_cfg={algo: fp8}", "not supported"),
        ("generation.real_quant=true", "not supported"),
    ],
)
def test_a_nemo_rl_key_asking_for_a_missing_feature_is_refused_by_name(override, reason):
    dotted = override.split("=", 1)[0]
    err = _raises_config_error(overrides=[override])
    assert err.field == dotted
    assert f"{dotted}=" in str(err) and "is not supported by nemo_gen" in str(err) and reason in str(err)


def test_nemo_rl_worker_extension_key_is_nemo_gens_field():
    ext = "my.ext.Worker"
    s = NemoGenSettings.load(overrides={"generation.worker_extension_cls_fqn": ext})
    assert s.generation.vllm_cfg.worker_extension_cls == ext and s.not_used == []


def test_a_refused_key_in_a_file_names_the_file(tmp_path):
    path = _write(tmp_path, "generation:\n  vllm_cfg:\n    is_mx: true\n")
    err = _raises_config_error(path=path)
    assert err.field == "generation.vllm_cfg.is_mx" and str(path) in str(err)
    assert "is_mx=true" in str(err)


@pytest.mark.parametrize(
    "override",
    ["generation.vllm_cfg.is_mx=false", "generation.vllm_cfg.cap_max_tokens_to_context=true",
     "generation.vllm_cfg.use_tqdm=true", "generation.colocated.resources.num_nodes=2",
     "generation.val_temperature=0.7"],
)
def test_a_nemo_rl_key_that_asks_for_nothing_missing_is_listed_not_dropped(override):
    dotted, _, raw = override.partition("=")
    s = NemoGenSettings.load(overrides=[override])
    (entry,) = s.not_used
    assert entry.key == dotted and entry.reason
    assert str(entry.value).lower() == raw.lower()


def test_a_nemo_rl_key_from_the_environment_is_named_as_such(monkeypatch):
    monkeypatch.setenv("NEMO_GEN_GENERATION__VLLM_CFG__IS_MX", "true")
    err = _raises_config_error()
    assert err.field == "generation.vllm_cfg.is_mx"
    assert "NeMo-RL key that nemo_gen does not use" in str(err)


# --------------------------------------------------------------------------------------------
# enumerated values are checked against what exists


def test_kv_cache_dtype_is_any_of_the_installed_vllms():
    from nemo_gen.config import vllm_choices

    assert {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"} <= set(vllm_choices.kv_cache_dtypes())
    for dtype in vllm_choices.kv_cache_dtypes():
        assert NemoGenSettings.load(overrides=[f"generation.vllm_cfg.kv_cache_dtype={dtype}"]).generation.vllm_cfg.kv_cache_dtype == dtype
    err = _raises_config_error(overrides=["generation.vllm_cfg.kv_cache_dtype=fp9"])
    assert err.field == "generation.vllm_cfg.kv_cache_dtype" and "fp8_e5m2" in str(err)


@pytest.mark.parametrize("good", ["auto", "float32", "bfloat16", "float16", "half", "float", "fp8"])
def test_precision_vllm_knows(good):
    assert NemoGenSettings.load(overrides=[f"generation.vllm_cfg.precision={good}"]).generation.vllm_cfg.precision == good


def test_unknown_precision_is_refused_with_a_suggestion():
    err = _raises_config_error(overrides=["generation.vllm_cfg.precision=fp9"])
    assert err.field == "generation.vllm_cfg.precision"
    assert "did you mean 'fp8'" in str(err) and "bfloat16" in str(err)


def test_cpu_kv_cache_space_is_whole_gib():
    """vLLM's CPU backend reads VLLM_CPU_KVCACHE_SPACE with int(): a fraction would be accepted and
    then kill every engine at its start, so it is refused here, naming the field."""
    assert NemoGenSettings.load(overrides=["fleet.cpu_kvcache_space_gb=2"]).fleet.cpu_kvcache_space_gb == 2
    err = _raises_config_error(overrides=["fleet.cpu_kvcache_space_gb=0.5"])
    assert err.field == "fleet.cpu_kvcache_space_gb" and "whole number of GiB" in str(err) and "0.5" in str(err)


def test_engine_niceness_is_a_nice_value_a_worker_can_take():
    """0..19: Ray's worker (not root, on many clusters) cannot lower its own niceness below 0."""
    assert NemoGenSettings.load().fleet.engine_niceness == 0
    assert NemoGenSettings.load(overrides=["fleet.engine_niceness=10"]).fleet.engine_niceness == 10
    for bad in ("-5", "20"):
        err = _raises_config_error(overrides=[f"fleet.engine_niceness={bad}"])
        assert err.field == "fleet.engine_niceness", err


def test_engine_core_start_is_forkserver_or_spawn_and_reaches_every_shard(make_settings):
    from nemo_gen.fleet.resolve import resolve_generation

    assert NemoGenSettings.load().fleet.engine_core_start == "forkserver"
    resolved = resolve_generation(make_settings(fleet__engine_core_start="spawn", fleet__spares=1), cluster=None)
    assert [s.engine_core_start for s in resolve_generation(make_settings(), cluster=None).shards] == ["forkserver"] * 2
    assert [s.engine_core_start for s in (*resolved.shards, *resolved.spares)] == ["spawn"] * 3
    err = _raises_config_error(overrides=["fleet.engine_core_start=fork"])
    assert err.field == "fleet.engine_core_start" and "fork" in str(err), err


def test_refit_control_channel_reaches_the_driver():
    from nemo_gen.fleet import driver

    assert NemoGenSettings.load().refit.control_channel is True
    assert driver.shard_driver(NemoGenSettings.load()).channels is True
    assert driver.shard_driver(NemoGenSettings.load(overrides=["refit.control_channel=false"])).channels is False
    err = _raises_config_error(overrides=["refit.control_channel=sometimes"])
    assert err.field == "refit.control_channel", err


def test_refit_backend_must_be_registered():
    for backend in ("nemo_gen_shm", "nemo_gen_ipc", "ipc", "nccl"):
        assert NemoGenSettings.load(overrides=[f"refit.backend={backend}"]).refit.backend == backend
    err = _raises_config_error(overrides=["refit.backend=bogus"])
    assert err.field == "refit.backend" and "nemo_gen_shm" in str(err) and "nccl" in str(err)


@pytest.mark.parametrize("backend, says", [("bogus", "Unknown generation backend"),
                                           ("sglang", "does not implement"), ("megatron", "does not implement")])
def test_generation_backend_must_resolve(backend, says):
    err = _raises_config_error(overrides=[f"generation.backend={backend}"])
    assert err.field == "generation.backend" and says in str(err) and "'vllm'" in str(err)


@pytest.mark.parametrize("top_k, ok", [(None, True), (-1, True), (1, True), (50, True), (0, False),
                                       (-5, False), (-2, False)])
def test_top_k(top_k, ok):
    override = {"generation.top_k": top_k}
    if ok:
        assert NemoGenSettings.load(overrides=override).generation.top_k == top_k
    else:
        assert _raises_config_error(overrides=override).field == "generation.top_k"


def test_load_format_is_one_vllm_has():
    assert NemoGenSettings.load(overrides=["generation.vllm_cfg.load_format=safetensors"]).generation.vllm_cfg.load_format == "safetensors"
    err = _raises_config_error(overrides=["generation.vllm_cfg.load_format=bogus"])
    assert err.field == "generation.vllm_cfg.load_format" and "vllm_kwargs.load_format" in str(err)


def test_vllm_kwargs_must_be_engine_arguments():
    s = NemoGenSettings.load(overrides=["generation.vllm_kwargs={max_num_seqs: 8, speculative_config: {method: ngram}}"])
    assert s.generation.vllm_kwargs["max_num_seqs"] == 8
    err = _raises_config_error(overrides=["generation.vllm_kwargs={enfoce_eager: true}"])
    assert err.field == "generation.vllm_kwargs" and "did you mean 'enforce_eager'" in str(err)


def test_expert_parallel_size_fits_one_engine():
    ok = NemoGenSettings.load(overrides=["generation.vllm_cfg.tensor_parallel_size=2",
                                         "generation.vllm_cfg.expert_parallel_size=2"])
    assert ok.generation.vllm_cfg.expert_parallel_size == 2
    err = _raises_config_error(overrides=["generation.vllm_cfg.expert_parallel_size=4"])
    assert err.field == "generation.vllm_cfg.expert_parallel_size" and "data parallelism" in str(err)


def test_bad_words_need_the_engines_tokenizer():
    cfg = NemoGenSettings.load(overrides=["generation.bad_words=[foo]"]).generation.to_generation_config()
    assert cfg["bad_words"] == ["foo"] and cfg["vllm_cfg"]["skip_tokenizer_init"] is False
    err = _raises_config_error(overrides=["generation.bad_words=[foo]", "generation.vllm_cfg.skip_tokenizer_init=true"])
    assert err.field == "generation" and "bad_words" in str(err)
    assert _raises_config_error(overrides=["generation.bad_words=['']"]).field == "generation.bad_words"


def test_a_misspelt_key_gets_a_suggestion(tmp_path):
    err = _raises_config_error(overrides=["fleet.num_shard=3"])
    assert err.field == "fleet.num_shard" and "did you mean 'num_shards'" in str(err)
    err = _raises_config_error(overrides=["generation.vllm_cfg.tensor_paralel_size=2"])
    assert "did you mean 'tensor_parallel_size'" in str(err)
    path = _write(tmp_path, "flet:\n  num_shards: 3\n")
    err = _raises_config_error(path=path)
    assert err.field == "flet" and "did you mean 'fleet'" in str(err)


# --------------------------------------------------------------------------------------------
# OmegaConf: interpolations and defaults in nemo_gen's own files


def test_interpolations_resolve_and_see_overrides(tmp_path):
    path = _write(tmp_path, """
        generation:
          max_new_tokens: ${generation.vllm_cfg.max_model_len}
          vllm_cfg:
            max_model_len: 128
    """)
    assert NemoGenSettings.load(path).generation.max_new_tokens == 128
    s = NemoGenSettings.load(path, ["generation.vllm_cfg.max_model_len=64"])
    assert s.generation.max_new_tokens == 64 and s.generation.vllm_cfg.max_model_len == 64


def test_an_override_may_interpolate(tmp_path):
    path = _write(tmp_path, "generation:\n  vllm_cfg:\n    max_model_len: 96\n")
    s = NemoGenSettings.load(path, ["generation.max_new_tokens=${generation.vllm_cfg.max_model_len}"])
    assert s.generation.max_new_tokens == 96


def test_an_unresolvable_interpolation_names_the_key_and_file(tmp_path):
    path = _write(tmp_path, "generation:\n  max_new_tokens: ${policy.max_total_sequence_length}\n")
    err = _raises_config_error(path=path)
    assert err.field == "generation.max_new_tokens"
    assert "policy.max_total_sequence_length" in str(err) and str(path) in str(err)


def test_defaults_inheritance_in_a_nemo_gen_file(tmp_path):
    _write(tmp_path, "fleet:\n  num_shards: 3\n  name: base\ngeneration:\n  temperature: 0.5\n", "base.yaml")
    (tmp_path / "sub").mkdir()
    child = _write(tmp_path, "defaults: ../base.yaml\nfleet:\n  name: child\n", "sub/child.yaml")
    s = NemoGenSettings.load(child)
    assert (s.fleet.num_shards, s.fleet.name, s.generation.temperature) == (3, "child", 0.5)


def test_override_marker_replaces_an_inherited_section(tmp_path):
    _write(tmp_path, "generation:\n  vllm_kwargs:\n    max_num_seqs: 8\n    seed: 1\n", "base.yaml")
    child = _write(tmp_path, "defaults: base.yaml\ngeneration:\n  vllm_kwargs:\n    _override_: true\n    seed: 2\n",
                   "child.yaml")
    assert NemoGenSettings.load(child).generation.vllm_kwargs == {"seed": 2}


def test_a_missing_or_looping_defaults_entry_names_the_file(tmp_path):
    child = _write(tmp_path, "defaults: nope.yaml\n", "child.yaml")
    err = _raises_config_error(path=child)
    assert str(child) in err.field and "nope.yaml" in str(err)
    _write(tmp_path, "defaults: b.yaml\n", "a.yaml")
    _write(tmp_path, "defaults: a.yaml\n", "b.yaml")
    err = _raises_config_error(path=tmp_path / "a.yaml")
    assert "loops" in str(err)


def test_generation_config_is_a_fresh_dict():
    g = NemoGenSettings.load().generation
    cfg = g.to_generation_config()
    cfg["vllm_cfg"]["env_vars"]["X"] = "1"
    cfg["max_new_tokens"] = 999
    assert g.vllm_cfg.env_vars == {} and g.max_new_tokens == 32


def test_every_generation_key_round_trips():
    cfg = NemoGenSettings.load().generation.to_generation_config()
    omitted = {"skip_tokenizer_init", "load_format", "worker_extension_cls"}
    assert set(cfg) == set(GenerationSettings.model_fields)
    assert set(cfg["vllm_cfg"]) == set(VllmCfg.model_fields) - omitted


def test_generation_config_unset_keys_absent_explicit_kept():
    unset = NemoGenSettings.load().generation.to_generation_config()["vllm_cfg"]
    assert "skip_tokenizer_init" not in unset
    assert "load_format" not in unset
    explicit = NemoGenSettings.load(
        overrides=[
            "generation.vllm_cfg.skip_tokenizer_init=false",
            "generation.vllm_cfg.load_format=dummy",
        ]
    ).generation.to_generation_config()["vllm_cfg"]
    assert explicit["skip_tokenizer_init"] is False  # False is a decision, not "unset"
    assert explicit["load_format"] == "dummy"
    explicit_true = NemoGenSettings.load(
        overrides=["generation.vllm_cfg.skip_tokenizer_init=true"]
    ).generation.to_generation_config()["vllm_cfg"]
    assert explicit_true["skip_tokenizer_init"] is True


# --------------------------------------------------------------------------------------------
# the settings file itself


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nope.yaml"
    err = _raises_config_error(path=path)
    assert err.field == str(path)
    assert str(path) in str(err)


def test_unreadable_file_names_the_file(tmp_path):
    # A directory cannot be read as a file, even by root.
    err = _raises_config_error(path=tmp_path)
    assert err.field == str(tmp_path)
    assert "cannot read" in str(err)


def test_invalid_yaml_names_the_file(tmp_path):
    path = _write(tmp_path, "fleet: [1, 2\n")
    err = _raises_config_error(path=path)
    assert err.field == str(path)
    assert "not valid YAML" in str(err)


@pytest.mark.parametrize("body, kind", [("- 1\n- 2\n", "list"), ("hello\n", "str"), ("3\n", "int")])
def test_non_mapping_top_level_names_the_file(tmp_path, body, kind):
    path = _write(tmp_path, body)
    err = _raises_config_error(path=path)
    assert err.field == str(path)
    assert "mapping" in str(err) and kind in str(err)


def test_empty_file_means_defaults(tmp_path):
    path = _write(tmp_path, "# nothing here\n")
    assert NemoGenSettings.load(path) == NemoGenSettings.load()


def test_path_may_be_a_string(tmp_path):
    path = _write(tmp_path, "fleet:\n  num_shards: 5\n")
    assert NemoGenSettings.load(str(path)).fleet.num_shards == 5


def test_yaml_state_does_not_leak_between_loads(tmp_path):
    path = _write(tmp_path, "fleet:\n  num_shards: 5\n")
    assert NemoGenSettings.load(path).fleet.num_shards == 5
    assert NemoGenSettings.load().fleet.num_shards == 2
    with pytest.raises(ConfigError):
        NemoGenSettings.load(path, ["fleet.bogus=1"])
    assert NemoGenSettings.load().fleet.num_shards == 2


# --------------------------------------------------------------------------------------------
# documentation and side effects


def _walk(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _walk(ann, f"{prefix}{name}.")


def test_every_field_has_a_description():
    fields = dict(_walk(NemoGenSettings))
    # The walk reaches every section, including the nested ones.
    for dotted in ("home", "fleet.num_shards", "generation.vllm_cfg.precision",
                   "generation.vllm_cfg.kv_cache_dtype", "health.enabled", "ray.address",
                   "prefect.port", "run.batch_size", "model.path"):
        assert dotted in fields
    missing = [dotted for dotted, field in fields.items() if not (field.description or "").strip()]
    assert missing == []


def test_importing_settings_changes_no_environment_variable():
    code = textwrap.dedent("""
        import json, os, sys
        before = dict(os.environ)
        import nemo_gen.settings
        nemo_gen.settings.NemoGenSettings.load(overrides=["fleet.num_shards=3"])
        after = dict(os.environ)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        print(json.dumps(changed))
    """)
    # A minimal environment: variables this (already importing) process may have set with
    # setdefault would otherwise be inherited by the child and hide the change.
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "LANG") if k in os.environ}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# --------------------------------------------------------------------------------------------
# derived helpers


def test_model_dir_defaults_to_the_tiny_model_under_home(tmp_path):
    s = NemoGenSettings.load(overrides={"home": str(tmp_path)})
    assert s.model_dir() == tmp_path / "tiny-model"
    assert s.tokenizer_dir() == tmp_path / "tiny-model"
    assert s.model_name() == "tiny-model"


def test_model_dir_tokenizer_and_name_when_set(tmp_path):
    s = NemoGenSettings.load(
        overrides={"model.path": str(tmp_path / "m"), "model.tokenizer": str(tmp_path / "t")}
    )
    assert s.model_dir() == tmp_path / "m"
    assert s.tokenizer_dir() == tmp_path / "t"
    assert s.model_name() == "m"
    s = NemoGenSettings.load(overrides={"model.path": str(tmp_path / "m"), "generation.model_name": "g"})
    assert s.model_name() == "g"
    s = NemoGenSettings.load(overrides={"model.name": "n", "generation.model_name": "g"})
    assert s.model_name() == "n"


def test_is_eval():
    assert NemoGenSettings.load().is_eval() is True
    assert NemoGenSettings.load(overrides=["fleet.mode=train"]).is_eval() is False


def test_sections_reject_unknown_keys_directly():
    with pytest.raises(ValueError):
        FleetSettings(bogus=1)


# --------------------------------------------------------------------------------------------
# known bugs (strict xfail: they start failing, as a reminder, once the source is fixed)


def test_env_vars_keys_from_environment_keep_their_case(monkeypatch):
    monkeypatch.setenv("NEMO_GEN_GENERATION__VLLM_CFG__ENV_VARS__CUDA_LAUNCH_BLOCKING", "1")
    s = NemoGenSettings.load()
    assert s.generation.vllm_cfg.env_vars == {"CUDA_LAUNCH_BLOCKING": "1"}


# --------------------------------------------------------------------------------------------
# trust boundaries (issue 31): the exposed server, env_vars


def test_an_exposed_server_with_refit_and_no_key_is_refused_naming_both_fields():
    # the review's probe A, line 1: this loaded silently, bad env_vars keys and all
    err = _raises_config_error(overrides=["server.host=0.0.0.0", "server.allow_refit=true",
                                          'generation.vllm_cfg.env_vars={"": "x", "A=B": "c"}'])
    assert {"server.allow_refit", "generation.vllm_cfg.env_vars.", "generation.vllm_cfg.env_vars.A=B"} <= set(err.fields)
    assert "server.api_key" in str(err) and "'0.0.0.0'" in str(err)
    for host in ("0.0.0.0", "", "10.1.2.3", "gpu-node-7", "::"):
        err = _raises_config_error(overrides={"server.host": host, "server.allow_refit": True})
        assert err.field == "server.allow_refit" and "server.api_key" in str(err), host
    # an empty key asks for none (the server's Gate): it is no key
    assert _raises_config_error(overrides={"server.host": "0.0.0.0", "server.allow_refit": True,
                                           "server.api_key": ""}).field == "server.allow_refit"


@pytest.mark.parametrize("overrides", [
    {"server.host": "0.0.0.0", "server.allow_refit": True, "server.api_key": "k"},  # a key guards it
    {"server.host": "0.0.0.0", "server.allow_refit": False},  # no refit route (start warns)
    {"server.host": "127.0.0.1", "server.allow_refit": True},
    {"server.host": "127.0.0.2", "server.allow_refit": True},
    {"server.host": "localhost", "server.allow_refit": True},
    {"server.host": "::1", "server.allow_refit": True},
])
def test_a_server_that_is_loopback_keyed_or_refit_free_loads(overrides):
    s = NemoGenSettings.load(overrides=overrides)
    assert s.server.host == overrides["server.host"]


def test_the_exposure_check_holds_for_a_later_assignment():
    s = NemoGenSettings.load(overrides={"server.allow_refit": True})
    with pytest.raises(ValueError, match="server.api_key"):
        s.server.host = "0.0.0.0"


@pytest.mark.parametrize("key", ["", "A=B", "A\0B", "1ABC", "A B", "A-B", "A.B", "Ä"])
def test_an_env_vars_key_that_is_no_variable_name_is_refused_naming_it(key):
    err = _raises_config_error(overrides={"generation.vllm_cfg.env_vars": {key: "1", "GOOD_ONE": "2"}})
    assert err.fields == [f"generation.vllm_cfg.env_vars.{key}"]
    assert repr(key) in str(err)


def test_an_env_vars_value_with_a_nul_is_refused_naming_its_key():
    err = _raises_config_error(overrides={"generation.vllm_cfg.env_vars": {"X": "a\0b"}})
    assert err.field == "generation.vllm_cfg.env_vars.X" and "NUL" in str(err)


def test_env_vars_keys_keep_their_case_from_every_source(tmp_path, monkeypatch):
    path = _write(tmp_path, """
        generation:
          vllm_cfg:
            env_vars: {FromFile_Var: "a"}
        """)
    monkeypatch.setenv("NEMO_GEN_GENERATION__VLLM_CFG__ENV_VARS__FromEnv_Var", "b")
    monkeypatch.setenv("NEMO_GEN_GENERATION__VLLM_CFG__ENV_VARS__lower_case", "c")
    s = NemoGenSettings.load(path, overrides=["generation.vllm_cfg.env_vars.FromSet_Var=d"])
    assert s.generation.vllm_cfg.env_vars == {"FromFile_Var": "a", "FromEnv_Var": "b", "lower_case": "c",
                                              "FromSet_Var": "d"}
    # the whole dict as JSON in one variable keeps its keys too
    monkeypatch.delenv("NEMO_GEN_GENERATION__VLLM_CFG__ENV_VARS__FromEnv_Var")
    monkeypatch.delenv("NEMO_GEN_GENERATION__VLLM_CFG__ENV_VARS__lower_case")
    monkeypatch.setenv("NEMO_GEN_GENERATION__VLLM_CFG__ENV_VARS", '{"Json_Var": "e"}')
    assert NemoGenSettings.load().generation.vllm_cfg.env_vars == {"Json_Var": "e"}


def test_two_environment_variables_for_one_env_vars_key_are_refused(monkeypatch):
    monkeypatch.setenv("NEMO_GEN_GENERATION__VLLM_CFG__ENV_VARS__My_Var", "1")
    monkeypatch.setenv("NEMO_GEN_GENERATION__VLLM_CFG__ENV_VARS__MY_VAR", "2")
    err = _raises_config_error()
    assert err.field.startswith("generation.vllm_cfg.env_vars.") and "My_Var" in str(err) and "MY_VAR" in str(err)


def test_env_vars_numbers_are_their_text_and_booleans_are_refused():
    s = NemoGenSettings.load(overrides=["generation.vllm_cfg.env_vars.CUDA_LAUNCH_BLOCKING=1",
                                        "generation.vllm_cfg.env_vars.RATIO=0.5"])
    assert s.generation.vllm_cfg.env_vars == {"CUDA_LAUNCH_BLOCKING": "1", "RATIO": "0.5"}
    err = _raises_config_error(overrides=["generation.vllm_cfg.env_vars.FLAG=true"])
    assert err.field == "generation.vllm_cfg.env_vars.FLAG"


def test_a_variable_the_fleet_sets_itself_is_refused_naming_its_setting():
    from nemo_gen.core.engine_args import CPU_FLEET_ENV, FLEET_ENV

    for key, setting in {**FLEET_ENV, **CPU_FLEET_ENV}.items():
        err = _raises_config_error(overrides={"fleet.device": "cpu", "generation.vllm_cfg.env_vars": {key: "1"}})
        assert err.field == f"generation.vllm_cfg.env_vars.{key}", key
        assert setting in str(err), key
    assert "refit.backend" in str(_raises_config_error(
        overrides={"generation.vllm_cfg.env_vars": {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}}))
    assert "health.enabled" in str(_raises_config_error(
        overrides={"generation.vllm_cfg.env_vars": {"RAY_process_group_cleanup_enabled": "0"}}))
    assert "fleet.omp_threads_per_engine" in str(_raises_config_error(
        overrides={"fleet.device": "cpu", "generation.vllm_cfg.env_vars": {"OMP_NUM_THREADS": "8"}}))


def test_a_cpu_fleets_own_variables_are_free_on_a_gpu_fleet():
    s = NemoGenSettings.load(overrides={"fleet.device": "gpu", "generation.vllm_cfg.env_vars": {"OMP_NUM_THREADS": "8"}})
    assert s.generation.vllm_cfg.env_vars == {"OMP_NUM_THREADS": "8"}


def test_dict_overrides_do_not_mutate_the_callers_dict():
    inner = {"num_shards": 3}
    s = NemoGenSettings.load(overrides={"fleet": inner, "fleet.name": "x"})
    assert (s.fleet.num_shards, s.fleet.name) == (3, "x")
    assert inner == {"num_shards": 3}


def test_the_backends_settings_accept_are_the_ones_that_resolve():
    from nemo_gen.core.generation_config import IMPLEMENTED_BACKENDS, NEMO_RL_ONLY_BACKENDS
    from nemo_gen.generation import resolve_generation_class

    for backend in IMPLEMENTED_BACKENDS:
        assert NemoGenSettings.load(overrides={"generation.backend": backend}).generation.backend == backend
        assert resolve_generation_class({"backend": backend}) is not None
    for backend in NEMO_RL_ONLY_BACKENDS:
        with pytest.raises(ConfigError):
            resolve_generation_class({"backend": backend})
        assert _raises_config_error(overrides={"generation.backend": backend}).field == "generation.backend"


def test_the_engine_stop_grace_reaches_the_driver():
    from nemo_gen.fleet import driver

    s = NemoGenSettings.load(overrides={"fleet.engine_stop_grace_s": 0.25})
    assert driver.driver_timeouts(s).engine_grace_s == 0.25
    assert driver.driver_timeouts(NemoGenSettings.load()).engine_grace_s == 1.0
    with pytest.raises(ConfigError, match="engine_stop_grace_s"):
        NemoGenSettings.load(overrides={"fleet.engine_stop_grace_s": -1})
