"""bench.lib.wide_tokenizer: the GPU benchmarks' random models with a real model's vocabulary get
a tokenizer as wide, so every id they sample decodes to text (as a real model's do) while the tiny
tokenizer's own ids, merges and special tokens stay as they were."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from bench.lib.wide_tokenizer import widen

TEXT = "The quick brown fox jumps over the lazy dog."


def test_a_widened_tokenizer_decodes_every_id_and_keeps_the_tiny_ones(tiny_model_dir, tmp_path):
    wide = AutoTokenizer.from_pretrained(str(widen(tiny_model_dir, tmp_path / "wide", 128256)))
    tiny = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert len(wide) == 128256
    assert wide(TEXT)["input_ids"] == tiny(TEXT)["input_ids"]  # the tiny vocabulary and merges stand
    assert wide.eos_token_id == tiny.eos_token_id and wide.bos_token_id == tiny.bos_token_id
    ids = list(range(len(tiny), 128256, 997)) + [128255]
    pieces = [wide.decode([i]) for i in ids]
    assert all(1 <= len(p.strip()) <= 3 for p in pieces), pieces[:20]  # every new id is text
    assert len(set(pieces)) == len(pieces)


def test_a_width_below_the_tiny_vocabulary_or_past_what_it_makes_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="smaller than the tiny tokenizer"):
        widen(tiny_model_dir, tmp_path / "narrow", 100)
    with pytest.raises(ValueError, match="more tokens than this widening makes"):
        widen(tiny_model_dir, tmp_path / "huge", 10**6)
