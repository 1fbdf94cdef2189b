"""Fixtures the GPU tier's modules share: two tiny models (weights A and B) and a module's
``PROMPTS`` as token ids. Each module keeps its own fleet and reference engine (their settings
differ: shards per GPU, sleep mode, refit backend)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny model A and tiny model B (same shape, other weights)."""
    from nemo_gen.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("gpu-models")
    return make_tiny_model(root / "a"), make_tiny_model(root / "b", seed=1)


@pytest.fixture(scope="module")
def prompt_ids(request, models):
    """The requesting module's ``PROMPTS``, tokenized by model A's tokenizer (BOS first)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models[0]))
    return [list(tok(p, add_special_tokens=True)["input_ids"]) for p in request.module.PROMPTS]
