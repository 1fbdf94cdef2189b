"""nemo_gen.tiny_model: a local, deterministic, idempotent tiny Llama (no vLLM here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nemo_gen.errors import ConfigError
from nemo_gen.tiny_model import (
    MARKER_NAME,
    MODEL_FILES,
    TinyModelExistsError,
    is_tiny_model,
    make_tiny_model,
    read_tiny_model_params,
    tiny_model_param_bytes,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _mtimes(path):
    return {p.name: p.stat().st_mtime_ns for p in path.iterdir()}


def test_files_and_config(model_dir):
    for name in (*MODEL_FILES, MARKER_NAME):
        assert (model_dir / name).stat().st_size > 0, name
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["torch_dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is False
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 64
    assert (cfg["vocab_size"], cfg["num_hidden_layers"]) == (512, 2)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 3)
    assert is_tiny_model(model_dir, seed=0)
    assert read_tiny_model_params(model_dir)["hidden_size"] == 128
    # no temporary build directories left beside it
    assert [p.name for p in model_dir.parent.iterdir()] == ["model"]


def test_weights_shapes_and_size(model_dir):
    from safetensors.torch import load_file

    sd = load_file(str(model_dir / "model.safetensors"))
    assert sd["model.embed_tokens.weight"].shape == (512, 128)
    assert sd["lm_head.weight"].shape == (512, 128)
    assert sd["model.layers.1.mlp.down_proj.weight"].shape == (128, 256)
    assert all(t.dtype.is_floating_point and t.dtype.itemsize == 4 for t in sd.values())
    assert sum(t.numel() * 4 for t in sd.values()) == tiny_model_param_bytes()


def test_tokenizer_round_trip(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tok) == 512
    assert (tok.unk_token, tok.bos_token, tok.eos_token, tok.pad_token) == ("<unk>", "<s>", "</s>", "<pad>")
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    text = "The engine wakes before the city does. Ünïcödé, 3.14 & {x: y}!"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert len(ids) < len(text.encode())  # BPE merges actually apply
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert max(ids) < 512


def test_idempotent_no_rewrite(model_dir):
    before = _mtimes(model_dir)
    assert make_tiny_model(model_dir) == model_dir
    assert _mtimes(model_dir) == before


def test_deterministic_for_seed(tmp_path, model_dir):
    other = make_tiny_model(tmp_path / "again")
    assert (other / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()


def test_mismatch_raises_then_overwrite(tmp_path):
    path = make_tiny_model(tmp_path / "m", num_layers=1)
    with pytest.raises(TinyModelExistsError, match="num_layers: existing 1 != requested 2"):
        make_tiny_model(path)
    with pytest.raises(TinyModelExistsError, match="seed"):
        make_tiny_model(path, num_layers=1, seed=7)
    make_tiny_model(path, num_layers=1, seed=7, overwrite=True)
    assert read_tiny_model_params(path)["seed"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_incomplete_or_foreign_dir_raises(tmp_path):
    path = make_tiny_model(tmp_path / "m", num_layers=1)
    (path / "model.safetensors").unlink()
    with pytest.raises(TinyModelExistsError, match="incomplete"):
        make_tiny_model(path, num_layers=1)
    make_tiny_model(path, num_layers=1, overwrite=True)
    assert is_tiny_model(path)

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(TinyModelExistsError, match="overwrite=True"):
        make_tiny_model(foreign, num_layers=1)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_empty_existing_dir_is_filled(tmp_path):
    assert make_tiny_model(tmp_path, num_layers=1) == tmp_path
    assert is_tiny_model(tmp_path)


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.torch

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        make_tiny_model(tmp_path / "m", num_layers=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"hidden_size": 32, "num_heads": 2}, "hidden_size"),  # head_dim 16: CPU kernel rejects it
        ({"hidden_size": 130, "num_heads": 2}, "hidden_size"),  # head_dim 65
        ({"hidden_size": 128, "num_heads": 3}, "num_heads"),  # not divisible
        ({"vocab_size": 100}, "vocab_size"),
        ({"num_layers": 0}, "num_layers"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_params_name_the_field(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        make_tiny_model(tmp_path / "bad", **kwargs)
    assert isinstance(info.value, ConfigError) and info.value.field == field
    assert not (tmp_path / "bad").exists()


def test_import_is_lazy():
    code = (
        "import sys, nemo_gen.tiny_model; "
        "print([m for m in ('torch', 'transformers', 'tokenizers', 'safetensors') if m in sys.modules])"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"
