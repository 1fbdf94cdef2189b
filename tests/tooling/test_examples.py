"""The example configs (examples/*.yaml) load, use no key nemo_gen ignores, and resolve into the
launch plans they describe; every settings file the README names exists. (tests/e2e/
test_interrupt_resume.py runs examples/eval.yaml for real.)"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from nemo_gen.settings import ENV_PREFIX, NemoGenSettings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in list(os.environ):
        if key.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(key)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from nemo_gen.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("examples") / "tiny")


def _plan(name: str, tiny: Path, device: str | None = None):
    from nemo_gen.fleet.resolve import resolve_generation

    overrides = {"model.path": str(tiny)}
    if device:
        overrides["fleet.device"] = device
    settings = NemoGenSettings.load(EXAMPLES / name, overrides)
    return settings, resolve_generation(settings, cluster=None)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_loads_and_uses_every_key(path):
    settings = NemoGenSettings.load(path)
    assert settings.not_used == []


def test_the_eval_example(tiny):
    settings, plan = _plan("eval.yaml", tiny, device="cpu")
    assert settings.is_eval() and settings.fleet.num_shards == 2
    assert settings.generation.temperature == 0.0 and settings.generation.stop_strings == ["\n\n"]
    assert settings.generation.vllm_cfg.max_model_len == 64 + 448  # ${add:...}
    kw = plan.shards[0].engine_kwargs
    assert kw["load_format"] == "auto" and kw["skip_tokenizer_init"] is False  # stop strings need it
    assert kw["max_model_len"] == 512 and kw["dtype"] == "float32"
    assert len(plan.shards) == 2


def test_the_train_example(tiny):
    settings, plan = _plan("train.yaml", tiny, device="cpu")
    assert not settings.is_eval() and settings.fleet.spares == 1
    kw = plan.shards[0].engine_kwargs
    assert kw["load_format"] == "dummy"  # weights arrive by refit
    assert kw["weight_transfer_config"] == {"backend": "nemo_gen_shm"}
    assert len(plan.shards) == 2 and len(plan.spares) == 1


def test_the_gpu_example_inherits_the_eval_one(tiny):
    settings, plan = _plan("gpu.yaml", tiny)
    eval_settings = NemoGenSettings.load(EXAMPLES / "eval.yaml")
    assert settings.fleet.device == "gpu" and settings.fleet.num_shards == 4
    assert settings.generation.stop_strings == eval_settings.generation.stop_strings  # inherited
    assert settings.generation.vllm_cfg.max_model_len == eval_settings.generation.vllm_cfg.max_model_len
    kw = plan.shards[0].engine_kwargs
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "ray"
    assert kw["gpu_memory_utilization"] == 0.85 and kw["dtype"] == "bfloat16" and kw["enforce_eager"] is False
    assert kw["weight_transfer_config"] == {"backend": "nemo_gen_ipc"} and kw["enable_prefix_caching"] is True
    assert plan.shards[0].async_engine is True
    assert [len(s.bundles) for s in plan.shards] == [2, 2, 2, 2]


def test_every_settings_file_the_readme_names_exists():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"--config (\S+\.yaml)", readme)) | set(re.findall(r"load\(\"(\S+\.yaml)\"", readme))
    named |= set(re.findall(r"\((examples/\S+\.yaml)\)", readme))
    ours = {p for p in named if p.startswith("examples/")}
    assert ours >= {"examples/eval.yaml", "examples/train.yaml", "examples/gpu.yaml"}
    assert sorted(p for p in ours if not (ROOT / p).is_file()) == []
    assert named - ours <= {"path/to/grpo_math_1B.yaml"}  # a user's NeMo-RL recipe, not ours
