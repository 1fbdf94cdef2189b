"""NeMo-RL recipes (tests/data/nemo_rl: a GRPO base recipe, a recipe inheriting it, a third file
inheriting that one, an eval config and its child) load through OmegaConf: the defaults chain,
interpolations and NeMo-RL's resolvers resolve, policy.generation is picked out, the policy keys
nemo_gen has a field for are mapped, and every other key is listed as not used."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nemo_gen.errors import ConfigError
from nemo_gen.settings import ENV_PREFIX, NemoGenSettings

DATA = Path(__file__).resolve().parents[1] / "data" / "nemo_rl"
BASE = DATA / "grpo_math_1B.yaml"
CHILD = DATA / "recipes" / "llm" / "grpo-qwen2.5-math-1.5b-2n8g-megatron.yaml"
GRANDCHILD = DATA / "recipes" / "llm" / "gb200" / "grpo-qwen2.5-math-1.5b-2n4g-megatron.yaml"
EVAL = DATA / "evals" / "eval.yaml"
EVAL_CHILD = DATA / "evals" / "aime_7b.yaml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in list(os.environ):
        if key.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(key)


def _not_used(settings: NemoGenSettings) -> dict[str, object]:
    return {n.key: n.value for n in settings.not_used}


def test_the_base_recipe_maps_policy_generation():
    s = NemoGenSettings.load(BASE)
    g, v = s.generation, s.generation.vllm_cfg
    # ${policy.max_total_sequence_length} and ${policy.precision} resolved
    assert g.max_new_tokens == 512 and v.max_model_len == 512 and v.precision == "bfloat16"
    assert (g.backend, g.temperature, g.top_p, g.top_k) == ("vllm", 1.0, 1.0, None)
    assert v.gpu_memory_utilization == 0.6 and v.enforce_eager is False and v.async_engine is False
    assert v.enable_vllm_metrics_logger is True and v.vllm_metrics_logger_interval == 0.5
    assert v.use_deep_gemm is False
    # policy.model_name is the model NeMo-RL's vLLM loads; tokenizer.name is the same, so not mapped
    assert g.model_name == "Qwen/Qwen2.5-1.5B" and s.model.path == Path("Qwen/Qwen2.5-1.5B")
    assert s.model.tokenizer is None
    # nemo_gen's own sections keep their defaults
    assert s.fleet == NemoGenSettings.load().fleet


def test_the_base_recipes_other_keys_are_listed_as_not_used():
    s = NemoGenSettings.load(BASE)
    unused = _not_used(s)
    for section in ("grpo", "loss_fn", "checkpointing", "data", "env", "logger", "cluster"):
        assert section in unused
    for key in ("policy.dtensor_cfg", "policy.megatron_cfg", "policy.dynamic_batching", "policy.optimizer",
                "policy.train_global_batch_size", "policy.max_grad_norm"):
        assert key in unused
    # NeMo-RL's colocated layout is nemo_gen's own setting (sleep mode; refused on CPU at launch)
    assert "policy.generation.colocated.enabled" not in unused and s.generation.colocated.enabled is True
    assert unused["policy.generation.vllm_cfg.use_tqdm"] is True
    assert unused["policy.generation.vllm_cfg.num_last_layers_in_bf16"] == 0
    # mapped keys are not listed
    for mapped in ("policy.model_name", "policy.tokenizer", "policy.max_total_sequence_length",
                   "policy.precision", "policy.generation"):
        assert mapped not in unused
    assert all(n.reason for n in s.not_used)


def test_a_recipe_inheriting_the_base_recipe():
    s = NemoGenSettings.load(CHILD)
    g, v = s.generation, s.generation.vllm_cfg
    # the child's policy.max_total_sequence_length reaches the base's interpolations
    assert v.max_model_len == 4096
    # ${max:${mul:4096, 0.75}, 1024}: NeMo-RL's resolvers
    assert g.max_new_tokens == 3072
    assert g.stop_strings == ["</answer>"] and v.tensor_parallel_size == 2 and v.gpu_memory_utilization == 0.7
    assert v.precision == "bfloat16"  # inherited
    assert s.model.path == Path("Qwen/Qwen2.5-Math-1.5B-Instruct")
    unused = _not_used(s)
    # other backends' and transports' keys: listed, never silently dropped
    assert "policy.generation.refit_cfg.nixl" in unused
    assert "policy.generation.mcore_generation_config.buffer_size_gb" in unused
    assert unused["policy.generation.port_range_low"] == 3000
    assert v.expose_http_server is False  # nemo_gen's own field (the fleet's HTTP server)
    assert "policy.generation.vllm_cfg.expose_http_server" not in unused
    assert s.generation.colocated.enabled is False


def test_a_three_file_chain():
    s = NemoGenSettings.load(GRANDCHILD)
    assert s.generation.vllm_cfg.max_model_len == 4096 and s.generation.max_new_tokens == 3072
    assert s.generation.stop_strings == ["</answer>"]


def test_recipe_keys_can_be_overridden_before_interpolation():
    s = NemoGenSettings.load(CHILD, ["policy.max_total_sequence_length=2048", "generation.temperature=0.5"])
    assert s.generation.vllm_cfg.max_model_len == 2048
    assert s.generation.max_new_tokens == 1536  # max(2048 * 0.75, 1024)
    assert s.generation.temperature == 0.5  # nemo_gen's generation is the recipe's policy.generation
    s = NemoGenSettings.load(CHILD, ["generation.vllm_cfg.max_model_len=1000", "model.path=/ckpt/step_4"])
    assert s.generation.vllm_cfg.max_model_len == 1000 and s.model.path == Path("/ckpt/step_4")


def test_nemo_gen_sections_may_sit_beside_a_recipe(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(f"defaults: {CHILD}\nfleet:\n  num_shards: 3\nray:\n  address: auto\n")
    s = NemoGenSettings.load(path)
    assert s.fleet.num_shards == 3 and s.ray.address == "auto"
    assert s.generation.vllm_cfg.max_model_len == 4096


def test_a_misspelt_nemo_gen_section_in_a_recipe_is_refused(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(f"defaults: {BASE}\nfleeet:\n  num_shards: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'fleet'"):
        NemoGenSettings.load(path)


def test_a_recipe_asking_for_a_missing_feature_is_refused(tmp_path):
    path = tmp_path / "http.yaml"
    path.write_text(f"defaults: {BASE}\npolicy:\n  generation:\n    vllm_cfg:\n      tool_parser_plugin: my.parser\n")
    with pytest.raises(ConfigError) as info:
        NemoGenSettings.load(path)
    assert info.value.field == "generation.vllm_cfg.tool_parser_plugin"
    assert "not supported yet" in str(info.value) and str(path) in str(info.value)


def test_unknown_generation_keys_in_a_recipe_are_listed(tmp_path):
    path = tmp_path / "new.yaml"
    path.write_text(f"defaults: {BASE}\npolicy:\n  generation:\n    some_new_nemo_rl_key: 3\n")
    unused = _not_used(NemoGenSettings.load(path))
    assert unused["policy.generation.some_new_nemo_rl_key"] == 3


def test_both_generation_blocks_is_ambiguous(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text(f"defaults: {BASE}\ngeneration:\n  temperature: 0.1\n")
    with pytest.raises(ConfigError, match="policy.generation"):
        NemoGenSettings.load(path)


def test_an_eval_config():
    s = NemoGenSettings.load(EVAL)
    g = s.generation
    assert g.max_new_tokens == 2048  # ${generation.vllm_cfg.max_model_len}
    assert (g.temperature, g.top_k) == (0.0, -1)
    assert s.model.path == Path("Qwen/Qwen2.5-Math-1.5B-Instruct") and s.model.tokenizer is None
    unused = _not_used(s)
    # ${.temperature}: relative interpolation, resolved
    assert unused["generation.val_temperature"] == 0.0 and unused["generation.val_top_k"] == -1
    assert unused["generation.num_prompts_per_step"] == -1
    assert {"eval", "data", "env", "cluster"} <= set(unused)
    assert unused["tokenizer"] == {"chat_template": "default", "chat_template_kwargs": None}


def test_an_eval_config_inheriting_the_default_one():
    s = NemoGenSettings.load(EVAL_CHILD)
    assert s.model.path == Path("Qwen/Qwen2.5-7B-Instruct")
    assert s.generation.vllm_cfg.max_model_len == 4096 and s.generation.max_new_tokens == 4096


def test_a_different_tokenizer_is_mapped(tmp_path):
    path = tmp_path / "tok.yaml"
    path.write_text(f"defaults: {BASE}\npolicy:\n  tokenizer:\n    name: /models/tok\n    chat_template: x\n")
    s = NemoGenSettings.load(path)
    assert s.model.tokenizer == Path("/models/tok")
    assert _not_used(s)["policy.tokenizer"] == {"chat_template": "x"}


def test_an_undefined_resolver_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(f"defaults: {BASE}\npolicy:\n  generation:\n    max_new_tokens: ${{pow:2, 8}}\n")
    with pytest.raises(ConfigError) as info:
        NemoGenSettings.load(path)
    assert "policy.generation.max_new_tokens" in str(info.value) and "pow" in str(info.value)
