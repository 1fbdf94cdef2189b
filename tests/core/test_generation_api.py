"""Unit tests for the generation API: nemo_gen.generation and its interfaces/constants.

Pure and fast: no Ray, no vLLM, no engine. torch is used only for the padding checks; the
tokenizer is a stand-in because configure_generation_config reads only pad/eos ids.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import textwrap
import types
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import nemo_gen.generation as gen
from nemo_gen.errors import ConfigError
from nemo_gen.generation import constants
from nemo_gen.generation.interfaces import (
    CollectiveSenderSpec,
    GenerationInterface,
    GenerationSamplingParams,
    should_use_async_rollouts,
    verify_right_padding,
)

REPO = Path(__file__).resolve().parents[2]
FLAG = "RAY_process_group_cleanup_enabled"
TOKENIZER = types.SimpleNamespace(pad_token_id=0, eos_token_id=2)


def _vllm_config(**overrides: Any) -> dict[str, Any]:
    """A complete training-time vLLM generation config, as the YAML defaults give it."""
    config: dict[str, Any] = {
        "backend": "vllm",
        "max_new_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "val_temperature": 1.0,
        "val_top_p": 1.0,
        "val_top_k": None,
        "stop_token_ids": None,
        "stop_strings": None,
        "model_name": "tiny",
        "colocated": {"enabled": True, "resources": {"gpus_per_node": None, "num_nodes": None}},
        "refit_transport": None,
        "vllm_kwargs": {},
        "vllm_cfg": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "expert_parallel_size": 1,
            "gpu_memory_utilization": 0.6,
            "max_model_len": 64,
            "async_engine": False,
            "kv_cache_dtype": "auto",
        },
    }
    config.update(overrides)
    return config


def _configure(config: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """configure_generation_config, failing the test on any unexpected warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return gen.configure_generation_config(config, TOKENIZER, **kwargs)


# --------------------------------------------------------------------------------------
# configure_generation_config, rule by rule
# --------------------------------------------------------------------------------------


def test_configure_returns_the_same_dict_and_sets_pad_token_without_warning():
    config = _vllm_config()
    assert _configure(config) is config
    assert config["_pad_token_id"] == 0


def test_preexisting_pad_token_id_warns_and_is_overridden():
    config = _vllm_config(_pad_token_id=99)
    with pytest.warns(UserWarning, match="_pad_token_id"):
        gen.configure_generation_config(config, TOKENIZER)
    assert config["_pad_token_id"] == 0


@pytest.mark.parametrize(("given", "expected"), [(None, [2]), ([], []), ([7, 8], [7, 8])])
def test_stop_token_ids_filled_only_when_none(given, expected):
    config = _configure(_vllm_config(stop_token_ids=given))
    assert config["stop_token_ids"] == expected


@pytest.mark.parametrize(("is_eval", "expected"), [(False, "dummy"), (True, "auto")])
@pytest.mark.parametrize("backend", ["vllm", "dynamo"])
def test_load_format_first_pass_overrides_user_value(backend, is_eval, expected):
    config = _vllm_config(backend=backend)
    config["vllm_cfg"]["load_format"] = "pt"
    _configure(config, is_eval=is_eval)
    assert config["vllm_cfg"]["load_format"] == expected


@pytest.mark.parametrize("missing", ["absent", "none"])
def test_load_format_creates_vllm_cfg_when_missing(missing):
    config = _vllm_config()
    if missing == "absent":
        del config["vllm_cfg"]
    else:
        config["vllm_cfg"] = None
    _configure(config)
    assert config["vllm_cfg"] == {"load_format": "dummy", "skip_tokenizer_init": True}


def test_non_vllm_backend_gets_only_the_tokenizer_rules():
    config = {"backend": "sglang", "stop_token_ids": None, "stop_strings": ["</s>"]}
    _configure(config, has_refit_draft_weights=True, trains_mtp=True)
    assert config == {
        "backend": "sglang",
        "stop_token_ids": [2],
        "stop_strings": ["</s>"],
        "_pad_token_id": 0,
    }


def test_dynamo_gets_load_format_but_not_the_vllm_only_rules():
    config = _vllm_config(backend="dynamo", refit_transport="vllm_s3_sparse")
    _configure(config)
    assert config["vllm_cfg"]["load_format"] == "dummy"
    assert "skip_tokenizer_init" not in config["vllm_cfg"]
    assert "_mtp_weights_from_refit" not in config


def test_missing_backend_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"generation\.backend") as info:
        gen.configure_generation_config({"stop_token_ids": None}, TOKENIZER)
    assert info.value.field == "generation.backend"


# ---- rule 4: real_quant --------------------------------------------------------------

OFFLOAD_NOT_BOOL = "generation.real_quant_export_cpu_offload must be a boolean"
OFFLOAD_NEEDS_IPC = (
    "generation.real_quant_export_cpu_offload=false requires colocated CUDA-IPC refit "
    "with no explicit refit_transport"
)


@pytest.mark.parametrize("offload", [None, "false", 0])
def test_real_quant_offload_must_be_bool(offload):
    config = _vllm_config(real_quant=True, real_quant_export_cpu_offload=offload)
    with pytest.raises(ValueError) as info:
        gen.configure_generation_config(config, TOKENIZER)
    assert str(info.value) == OFFLOAD_NOT_BOOL
    assert info.value.field == "generation.real_quant_export_cpu_offload"


@pytest.mark.parametrize(
    "overrides",
    [
        {"colocated": {"enabled": False, "resources": {}}},
        {"refit_transport": "nixl"},
        {"colocated": None},
    ],
    ids=["not-colocated", "explicit-transport", "no-colocated-key"],
)
def test_real_quant_without_offload_requires_colocated_ipc(overrides):
    config = _vllm_config(real_quant=True, real_quant_export_cpu_offload=False, **overrides)
    with pytest.raises(ValueError) as info:
        gen.configure_generation_config(config, TOKENIZER)
    assert str(info.value) == OFFLOAD_NEEDS_IPC


@pytest.mark.parametrize(
    "overrides",
    [
        {"real_quant": True, "real_quant_export_cpu_offload": False},
        {"real_quant": True, "real_quant_export_cpu_offload": True, "refit_transport": "nixl"},
        {"real_quant": False, "real_quant_export_cpu_offload": "not checked"},
    ],
    ids=["colocated-ipc", "offload-on", "real-quant-off"],
)
def test_real_quant_accepted(overrides):
    config = _vllm_config(**overrides)
    assert _configure(config) is config
    # the real_quant keys are left as given, and the rules after rule 4 still ran
    assert {key: config[key] for key in overrides} == overrides
    assert config["_draft_full_refit"] is False and config["vllm_cfg"]["skip_tokenizer_init"] is True


# ---- rule 5: sparse transports -------------------------------------------------------


@pytest.mark.parametrize("transport", ["vllm_s3_sparse", "vllm_zmq_sparse"])
def test_sparse_transport_overrides_dummy_load_format(transport):
    config = _configure(_vllm_config(refit_transport=transport))
    assert config["vllm_cfg"]["load_format"] == "auto"


@pytest.mark.parametrize("transport", [None, "nixl", "nccl_reshard", "pkg.mod:Engine"])
def test_other_transports_keep_dummy(transport):
    config = _configure(_vllm_config(refit_transport=transport))
    assert config["vllm_cfg"]["load_format"] == "dummy"


# ---- rule 6: speculative decoding ----------------------------------------------------


def _speculative(method: str) -> dict[str, Any]:
    return {"speculative_config": {"method": method, "num_speculative_tokens": 2}}


@pytest.mark.parametrize("method", ["eagle3", "eagle", "draft_model", "ngram"])
def test_speculative_without_draft_refit_warns_and_loads_from_disk(method):
    config = _vllm_config(vllm_kwargs=_speculative(method))
    with pytest.warns(
        UserWarning, match="Speculative decoding is enabled without draft refit sync"
    ):
        gen.configure_generation_config(config, TOKENIZER)
    assert config["vllm_cfg"]["load_format"] == "auto"


@pytest.mark.parametrize("method", ["mtp", "deepseek_mtp"])
def test_speculative_mtp_keeps_dummy(method):
    config = _configure(_vllm_config(vllm_kwargs=_speculative(method)))
    assert config["vllm_cfg"]["load_format"] == "dummy"


def test_speculative_rule_does_not_fire_with_draft_refit():
    config = _configure(
        _vllm_config(vllm_kwargs=_speculative("eagle3")), has_refit_draft_weights=True
    )
    assert config["vllm_cfg"]["load_format"] == "dummy"


def test_speculative_rule_does_not_fire_in_eval():
    config = _configure(_vllm_config(vllm_kwargs=_speculative("eagle3")), is_eval=True)
    assert config["vllm_cfg"]["load_format"] == "auto"


@pytest.mark.parametrize("vllm_kwargs", [{}, None, {"speculative_config": {}}])
def test_no_speculative_config_keeps_dummy(vllm_kwargs):
    config = _configure(_vllm_config(vllm_kwargs=vllm_kwargs))
    assert config["vllm_cfg"]["load_format"] == "dummy"


# ---- rule 7: drafter weight sources --------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, (False, False, False)),
        ({"trains_mtp": True}, (True, False, False)),
        ({"has_refit_draft_weights": True}, (False, True, False)),
        ({"has_refit_draft_weights": True, "draft_full_refit": True}, (False, True, True)),
        # Documented choice: a full-stream flag without a drafter stream is stored as False.
        ({"draft_full_refit": True}, (False, False, False)),
    ],
)
def test_draft_and_mtp_source_flags(kwargs, expected):
    config = _configure(_vllm_config(), **kwargs)
    got = (
        config["_mtp_weights_from_refit"],
        config["_draft_weights_from_refit"],
        config["_draft_full_refit"],
    )
    assert got == expected


# ---- rule 8: skip_tokenizer_init -----------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "is_eval", "expected"),
    [
        ({}, False, True),
        ({}, True, False),
        ({"stop_strings": ["</answer>"]}, False, False),
        ({"stop_strings": []}, False, False),  # "set" means not None, as in NeMo-RL
        ({"expose": True}, False, False),
    ],
)
def test_skip_tokenizer_init_when_absent(overrides, is_eval, expected):
    config = _vllm_config(**{k: v for k, v in overrides.items() if k != "expose"})
    if overrides.get("expose"):
        config["vllm_cfg"]["expose_http_server"] = True
    _configure(config, is_eval=is_eval)
    assert config["vllm_cfg"]["skip_tokenizer_init"] is expected


@pytest.mark.parametrize("explicit", [True, False])
def test_skip_tokenizer_init_explicit_value_is_kept(explicit):
    config = _vllm_config(stop_strings=["x"])
    config["vllm_cfg"]["skip_tokenizer_init"] = explicit
    _configure(config, is_eval=True)
    assert config["vllm_cfg"]["skip_tokenizer_init"] is explicit


# ---- worker extension off vLLM -------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key"),
    [
        (None, "worker_extension_cls_fqn"),
        ("vllm_cfg", "worker_extension_cls"),
        ("vllm_cfg", "worker_extension_cls_fqn"),
        ("vllm_kwargs", "worker_extension_cls"),
    ],
)
@pytest.mark.parametrize("backend", ["sglang", "dynamo", "megatron"])
def test_worker_extension_refused_off_vllm_without_mutating(backend, section, key):
    config = _vllm_config(backend=backend)
    (config if section is None else config[section])[key] = "pkg.ext:Extension"
    dotted = f"generation.{section}.{key}" if section else f"generation.{key}"
    with pytest.raises(ValueError, match=dotted.replace(".", r"\.")) as info:
        gen.configure_generation_config(config, TOKENIZER)
    assert info.value.field == dotted
    assert "_pad_token_id" not in config and config["stop_token_ids"] is None


def test_worker_extension_allowed_on_vllm():
    config = _vllm_config(worker_extension_cls_fqn="pkg.ext:Extension")
    config["vllm_kwargs"]["worker_extension_cls"] = "pkg.ext:Extension"
    assert _configure(config) is config
    # kept as given, and configured to the end like any vLLM config
    assert config["worker_extension_cls_fqn"] == config["vllm_kwargs"]["worker_extension_cls"] == "pkg.ext:Extension"
    assert config["_pad_token_id"] == TOKENIZER.pad_token_id
    assert config["vllm_cfg"]["load_format"] == "dummy" and config["_draft_full_refit"] is False


# --------------------------------------------------------------------------------------
# maybe_configure_engine_reaping_env and import-time behaviour
# --------------------------------------------------------------------------------------


def test_reaping_env_disabled_does_nothing(monkeypatch):
    monkeypatch.delenv(FLAG, raising=False)
    gen.maybe_configure_engine_reaping_env(False)
    assert FLAG not in os.environ


def test_reaping_env_enabled_sets_default(monkeypatch, caplog):
    monkeypatch.delenv(FLAG, raising=False)
    with caplog.at_level(logging.INFO, logger="nemo_gen.generation"):
        gen.maybe_configure_engine_reaping_env(True)
    assert os.environ[FLAG] == "1"
    assert not caplog.records


@pytest.mark.parametrize("explicit", ["0", "false"])
def test_reaping_env_explicit_off_is_honoured_and_reported(monkeypatch, caplog, explicit):
    monkeypatch.setenv(FLAG, explicit)
    with caplog.at_level(logging.WARNING, logger="nemo_gen.generation"):
        gen.maybe_configure_engine_reaping_env(True)
    assert os.environ[FLAG] == explicit
    assert any(FLAG in r.getMessage() and "honoured" in r.getMessage() for r in caplog.records)


def test_reaping_env_explicit_on_is_kept_quietly(monkeypatch, caplog):
    monkeypatch.setenv(FLAG, "true")
    with caplog.at_level(logging.INFO, logger="nemo_gen.generation"):
        gen.maybe_configure_engine_reaping_env(True)
    assert os.environ[FLAG] == "true"
    assert not caplog.records


def _import_time_env_writes(source: str) -> list[str]:
    """Code run at import (not inside a function body) that names the flag or os.environ.

    Docstrings and comments are not code; decorators, default values and class bodies
    are, because they run when the module is imported.
    """
    found: list[str] = []
    tree = ast.parse(source)
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(getattr(node, "decorator_list", []))
            pending.extend(node.args.defaults)
            pending.extend(d for d in node.args.kw_defaults if d is not None)
            continue
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef)) and body and ast.get_docstring(node):
            pending.extend(n for n in ast.iter_child_nodes(node) if n is not body[0])
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and FLAG in node.value:
            found.append(f"line {node.lineno}: string naming {FLAG}")
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "putenv"):
            found.append(f"line {node.lineno}: os.{node.attr} at import")
        pending.extend(ast.iter_child_nodes(node))
    return found


def test_import_time_checker_catches_a_module_level_write():
    bad = f'"""Doc mentioning {FLAG}."""\nimport os\nos.environ.setdefault("{FLAG}", "1")\n'
    good = textwrap.dedent(
        f'''
        """Doc mentioning {FLAG}."""
        import os
        # a comment about {FLAG}
        class C:
            """Docstring about {FLAG}."""
        def f():
            os.environ.setdefault("{FLAG}", "1")
        '''
    )
    assert _import_time_env_writes(bad)
    assert _import_time_env_writes(good) == []


@pytest.mark.parametrize(
    "relpath",
    [
        "nemo_gen/__init__.py",
        "nemo_gen/generation/__init__.py",
        "nemo_gen/generation/interfaces.py",
        "nemo_gen/generation/config_shapes.py",
        "nemo_gen/generation/batch_shapes.py",
        "nemo_gen/generation/constants.py",
    ],
)
def test_no_module_sets_the_reaping_flag_at_import(relpath):
    assert _import_time_env_writes((REPO / relpath).read_text()) == []


def test_import_changes_no_env_and_imports_nothing_heavy():
    probe = textwrap.dedent(
        """
        import json, os, sys
        before = dict(os.environ)
        import nemo_gen, nemo_gen.generation, nemo_gen.generation.interfaces
        heavy = ["torch", "transformers", "vllm", "ray", "prefect", "nemo_gen.generation.vllm"]
        loaded = sorted(
            h for h in heavy if any(m == h or m.startswith(h + ".") for m in sys.modules)
        )
        print(json.dumps({"env_changed": dict(os.environ) != before, "loaded": loaded}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != FLAG}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"env_changed": False, "loaded": []}


def test_tokenizer_type_is_transformers_base_class():
    from transformers import PreTrainedTokenizerBase

    assert gen.TokenizerType is PreTrainedTokenizerBase
    assert "TokenizerType" in dir(gen)
    with pytest.raises(AttributeError):
        gen.NoSuchName  # noqa: B018


# --------------------------------------------------------------------------------------
# resolve_generation_class
# --------------------------------------------------------------------------------------


def test_vllm_registry_entry():
    assert gen._BACKEND_CLASSES["vllm"] == "nemo_gen.generation.vllm:VllmGeneration"
    assert sorted(gen._BACKEND_CLASSES) == ["vllm"]


STANDIN_SOURCE = textwrap.dedent(
    """
    from nemo_gen.generation.interfaces import GenerationInterface

    class StandIn(GenerationInterface):
        def init_collective(self, ip, port, world_size, *, train_world_size):
            return []
        def generate(self, data, greedy=False):
            return {}
        def prepare_for_generation(self, *args, **kwargs):
            return True
        def finish_generation(self, *args, **kwargs):
            return True
        def shutdown(self):
            return True

    NotABackend = dict
    """
)


@pytest.fixture
def standin_module(tmp_path, monkeypatch):
    """A fresh, not-yet-imported module holding a GenerationInterface stand-in."""
    name = f"standin_backend_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(STANDIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_resolve_imports_the_backend_lazily(standin_module, monkeypatch):
    monkeypatch.setitem(gen._BACKEND_CLASSES, "vllm", f"{standin_module}:StandIn")
    assert standin_module not in sys.modules
    cls = gen.resolve_generation_class(types.MappingProxyType({"backend": "vllm"}))
    assert standin_module in sys.modules
    assert cls is sys.modules[standin_module].StandIn
    assert issubclass(cls, GenerationInterface)


def test_a_new_backend_is_one_registry_line(standin_module, monkeypatch):
    monkeypatch.setitem(gen._BACKEND_CLASSES, "mine", f"{standin_module}:StandIn")
    assert gen.resolve_generation_class({"backend": "mine"}).__name__ == "StandIn"
    with pytest.raises(ValueError, match=r"known backends: \['mine', 'vllm'\]"):
        gen.resolve_generation_class({"backend": "other"})


def test_registered_non_interface_class_is_an_import_error(standin_module, monkeypatch):
    monkeypatch.setitem(gen._BACKEND_CLASSES, "vllm", f"{standin_module}:NotABackend")
    with pytest.raises(ImportError, match="has no GenerationInterface subclass named NotABackend"):
        gen.resolve_generation_class({"backend": "vllm"})


@pytest.mark.parametrize("backend", ["vLLM", "tensorrt", "", None, ["vllm"]])
def test_unknown_backend(backend):
    with pytest.raises(ValueError) as info:
        gen.resolve_generation_class({"backend": backend})
    assert str(info.value) == f"Unknown generation backend: {backend!r}; known backends: ['vllm']"
    assert isinstance(info.value, ConfigError) and info.value.field == "generation.backend"


@pytest.mark.parametrize("backend", ["sglang", "megatron", "trtllm", "dynamo"])
def test_nemo_rl_only_backend(backend):
    with pytest.raises(ValueError) as info:
        gen.resolve_generation_class({"backend": backend})
    message = str(info.value)
    assert f"{backend!r} is a NeMo-RL backend that nemo_gen does not implement" in message
    assert message.endswith("known backends: ['vllm']")


def test_missing_backend_key():
    with pytest.raises(ValueError, match=r"generation\.backend is missing"):
        gen.resolve_generation_class({"max_new_tokens": 8})


# --------------------------------------------------------------------------------------
# draft_full_refit_enabled
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy_cfg", "expected"),
    [
        ({"automodel_cfg": {"enabled": True}}, True),
        ({"automodel_cfg": {"enabled": 1}}, True),
        ({"automodel_cfg": {"enabled": False}}, False),
        ({"automodel_cfg": {"enabled": None}}, False),
        ({"automodel_cfg": {}}, False),
        ({"automodel_cfg": None}, False),
        ({"megatron_cfg": {"enabled": True}}, False),
        ({}, False),
        (None, False),
    ],
)
def test_draft_full_refit_enabled(policy_cfg, expected):
    assert gen.draft_full_refit_enabled(policy_cfg) is expected


# --------------------------------------------------------------------------------------
# interfaces: padding, sampling, async rollouts, the ABC
# --------------------------------------------------------------------------------------

PADDED = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9], [5, 0, 0, 0, 0]])


def test_right_padding_accepts_both_spec_shapes():
    lengths = torch.tensor([3, 5, 1])
    assert verify_right_padding({"input_ids": PADDED, "input_lengths": lengths}, 0) == (True, None)
    output = {"output_ids": PADDED, "unpadded_sequence_lengths": lengths, "logprobs": None}
    assert verify_right_padding(output, 0) == (True, None)


def test_right_padding_uses_the_given_pad_value():
    data = {"input_ids": torch.where(PADDED == 0, 42, PADDED), "input_lengths": [3, 5, 1]}
    assert verify_right_padding(data, 42) == (True, None)
    ok, message = verify_right_padding(data, 0, raise_error=False)
    assert not ok and message.startswith(
        "Non-padding values found after specified length at index 0"
    )


def test_right_padding_reports_stray_tokens():
    data = {"input_ids": PADDED, "input_lengths": torch.tensor([3, 3, 1])}
    expected = "Non-padding values found after specified length at index 1: positions [3, 4]"
    assert verify_right_padding(data, 0, raise_error=False) == (False, expected)
    with pytest.raises(ValueError, match=r"index 1: positions \[3, 4\]"):
        verify_right_padding(data, 0)


def test_right_padding_reports_the_first_bad_row_in_order():
    data = {"input_ids": PADDED, "input_lengths": torch.tensor([2, 6, 1])}
    _, message = verify_right_padding(data, 0, raise_error=False)
    assert message == "Non-padding values found after specified length at index 0: positions [2]"
    data["input_lengths"] = torch.tensor([3, 6, 1])
    _, message = verify_right_padding(data, 0, raise_error=False)
    assert message == "Length 6 at index 1 exceeds tensor sequence dimension 5"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"input_ids": PADDED}, "Could not find the required pairs of fields"),
        ({"input_ids": PADDED[0], "input_lengths": [3]}, "Expected 2D tensor"),
        (
            {"input_ids": PADDED, "input_lengths": [3, 5]},
            "Mismatch between tensor batch size (3) and lengths tensor size (2)",
        ),
        ({"input_ids": PADDED, "input_lengths": [3, -1, 1]}, "Length -1 at index 1 is negative"),
    ],
)
def test_right_padding_shape_errors(data, fragment):
    ok, message = verify_right_padding(data, 0, raise_error=False)
    assert not ok and fragment in message
    with pytest.raises(ValueError) as info:
        verify_right_padding(data, 0)
    assert fragment in str(info.value)


def test_right_padding_refuses_a_missing_pad_value():
    with pytest.raises(ValueError, match="pad_token_id"):
        verify_right_padding(
            {"input_ids": PADDED, "input_lengths": [3, 5, 1]}, None, raise_error=False
        )


def test_sampling_params_from_generation_config():
    params = GenerationSamplingParams.from_generation_config(
        _vllm_config(temperature=0.7, top_k=20)
    )
    assert params == GenerationSamplingParams(temperature=0.7, top_p=1.0, top_k=20)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (None, False),
        ({"backend": "dynamo"}, True),
        ({"backend": "sglang"}, False),
        ({"backend": "sglang", "use_async_rollouts": True}, True),
        ({"backend": "vllm", "vllm_cfg": {"async_engine": False}}, False),
        ({"backend": "vllm", "vllm_cfg": {"async_engine": True}}, True),
        ({"backend": "vllm"}, False),
        ({"backend": "trtllm", "trtllm_cfg": {"async_engine": True}}, True),
        ({"backend": "megatron", "mcore_generation_config": {}}, True),
        ({"backend": "something"}, False),
    ],
)
def test_should_use_async_rollouts(config, expected):
    assert should_use_async_rollouts(config) is expected


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"backend": "trtllm", "trtllm_cfg": {"async_engine": False}}, "trtllm_cfg.async_engine"),
        (
            {"backend": "megatron", "mcore_generation_config": {"async_engine": True}},
            "mcore_generation_config.async_engine",
        ),
    ],
)
def test_should_use_async_rollouts_refuses_removed_sync_engines(config, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        should_use_async_rollouts(config)


class _Complete(GenerationInterface):
    def init_collective(self, ip, port, world_size, *, train_world_size):
        return []

    def generate(self, data, greedy=False):
        return {"output_ids": data["input_ids"]}

    def prepare_for_generation(self, *args, **kwargs):
        return True

    def finish_generation(self, *args, **kwargs):
        return True

    def shutdown(self):
        return True


def test_interface_abstract_methods():
    assert GenerationInterface.__abstractmethods__ == {
        "init_collective",
        "generate",
        "prepare_for_generation",
        "finish_generation",
        "shutdown",
    }
    with pytest.raises(TypeError):
        GenerationInterface()  # type: ignore[abstract]

    class MissingShutdown(GenerationInterface):
        init_collective = _Complete.init_collective
        generate = _Complete.generate
        prepare_for_generation = _Complete.prepare_for_generation
        finish_generation = _Complete.finish_generation

    with pytest.raises(TypeError, match="shutdown"):
        MissingShutdown()  # type: ignore[abstract]


def test_interface_optional_hook_defaults():
    backend = _Complete()
    assert backend.requires_kv_scale_sync is False
    assert backend.get_collective_sender_spec() == CollectiveSenderSpec("nemo", None, None)
    assert backend.get_inference_world_size() is None
    assert backend.invalidate_kv_cache() is False
    assert backend.blocks_training() is False
    assert backend.wake_carries_weight_updates() is False
    assert backend.clear_logger_metrics() is None
    assert backend.get_logger_metrics() == {}


@pytest.mark.parametrize(
    ("hook", "args"),
    [
        ("prepare_refit_info", ({},)),
        ("update_weights_via_ipc_zmq", ()),
        ("update_weights_from_collective", ()),
        ("prepare_nccl_reshard_refit_info", ({},)),
        ("nccl_reshard_refit", ()),
    ],
)
def test_interface_refit_hooks_refuse_by_default(hook, args):
    with pytest.raises(NotImplementedError, match=rf"_Complete does not implement {hook}\(\)"):
        getattr(_Complete(), hook)(*args)


def test_interface_fleet_health_refuses_by_default():
    with pytest.raises(NotImplementedError) as info:
        _Complete().attach_fleet_health(monitor=object(), selector=object())
    assert str(info.value) == (
        "async_rl.generation_fleet_health.enabled=true is not supported for the _Complete "
        "generation backend"
    )


def test_backend_constants():
    assert (
        constants.VLLM_BACKEND,
        constants.SGLANG_BACKEND,
        constants.MEGATRON_BACKEND,
        constants.DYNAMO_BACKEND,
        constants.TRTLLM_BACKEND,
    ) == ("vllm", "sglang", "megatron", "dynamo", "trtllm")
    assert constants.VLLM_BACKEND not in constants.NEMO_RL_ONLY_BACKENDS
