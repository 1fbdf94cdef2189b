"""A tokenizer as wide as a real model's vocabulary, for the GPU benchmarks' random models.

The GPU host has no internet, so its models are random Llamas with the tiny model's byte-level
BPE tokenizer (512 tokens). A model with Llama-3's 128,256 output rows samples ids that tokenizer
does not know: they decode to nothing, so whatever decodes text (vLLM's detokenizer, the router)
has no work, unlike with a real model. ``widen`` writes the tiny tokenizer with its vocabulary
grown to ``vocab`` tokens: the tiny one's tokens keep their ids (and its merges, so text encodes
as before), and each new id is a token of two or three printable characters (a word-start marker
among them), so every sampled id decodes to text, as a real vocabulary's do.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

# Printable characters of the byte-level alphabet ("Ġ" is the byte-level form of a space).
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" + "Ġ"
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def widen(tiny: Path, out: Path, vocab: int) -> Path:
    """The tiny model's tokenizer files from ``tiny`` into ``out``, its vocabulary grown to
    ``vocab`` tokens (ids past the tiny one's: new two- and three-character tokens)."""
    doc = json.loads((tiny / "tokenizer.json").read_text())
    table: dict[str, int] = doc["model"]["vocab"]
    if vocab < len(table):
        raise ValueError(f"vocab {vocab} is smaller than the tiny tokenizer's {len(table)} tokens")
    if doc["model"]["type"] != "BPE" or (doc.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError("the tiny tokenizer is not a byte-level BPE one: nothing here knows how to widen it")
    words = ("".join(p) for n in (2, 3) for p in itertools.product(ALPHABET, repeat=n))
    fresh = (w for w in words if w not in table)
    for i, word in zip(range(len(table), vocab), fresh):
        table[word] = i
    if len(table) != vocab:
        raise ValueError(f"vocab {vocab} is more tokens than this widening makes ({len(table)})")
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
    (out / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    return out
