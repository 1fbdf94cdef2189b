"""Sampling keywords: the generation config's names, merged and checked before any dispatch.

``fleet.generate(prompts, temperature=0)`` speaks NeMo-RL's GenerationConfig vocabulary; this
module merges per-call keywords over the configured defaults and rejects unknown or invalid
ones with an error naming the keyword, so a bad call fails before any shard is touched.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from nemo_gen.errors import RequestError

SAMPLING_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "stop_strings",
    "bad_words",
    "seed",
    "ignore_eos",
    "n",  # samples per prompt (a GRPO group): one engine request, the prompt prefilled once
    # Decoding constrained to a grammar: vLLM's StructuredOutputsParams as a dict ({"json": schema},
    # {"regex": ...}, {"choice": [...]}, {"grammar": ...}); how the HTTP server forces a tool call.
    "structured_outputs",
    # Alternatives per token beside the sampled one's logprob (0: that one only, what RL needs), and
    # the prompt's logprobs (None: not computed): what the HTTP server's logprobs fields ask for.
    "logprobs",
    "prompt_logprobs",
)
# vLLM StructuredOutputsParams fields the structured_outputs keyword carries: exactly one of
# STRUCTURED, and any of STRUCTURED_OPTIONS (also what nemo_gen.chat.constrain reads off a request).
STRUCTURED = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
STRUCTURED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


def resolve_sampling(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults from the generation config, overridden per call. Returns a validated dict."""
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise RequestError(
            f"unknown sampling keyword(s) {unknown}; known: {list(SAMPLING_KEYS)}"
        )
    merged = {key: defaults.get(key) for key in SAMPLING_KEYS}
    if overrides.get("ignore_eos") and "stop_token_ids" not in overrides:
        # The configured stop ids are the tokenizer's EOS (configure_generation_config's rule 2),
        # and vLLM stops on stop_token_ids whatever ignore_eos says: ignoring EOS means dropping
        # them, unless the call names its own.
        merged["stop_token_ids"] = None
    merged.update(overrides)
    _check(merged)
    if (merged["stop_strings"] or merged["bad_words"]) and (defaults.get("vllm_cfg") or {}).get("skip_tokenizer_init"):
        # vLLM applies both through the engine's tokenizer and silently drops them without one.
        used = [k for k in ("stop_strings", "bad_words") if merged[k]]
        raise RequestError(
            f"{' and '.join(used)} need the engine's tokenizer, but this fleet's engines started without "
            "one (generation.vllm_cfg.skip_tokenizer_init); set them in the generation config, or "
            "skip_tokenizer_init: false, so the engines load it"
        )
    return merged


def _number(value: Any) -> bool:
    """A real, finite number (bool is an int subclass, but temperature=True is a typo)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(s: dict[str, Any]) -> None:
    mnt = s["max_new_tokens"]
    if not _int(mnt) or mnt < 1:
        raise RequestError(f"max_new_tokens must be a positive integer, got {mnt!r}")
    temp = s["temperature"]
    if not _number(temp) or temp < 0:
        raise RequestError(f"temperature must be a number >= 0, got {temp!r}")
    top_p = s["top_p"]
    if not _number(top_p) or not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p!r}")
    top_k = s["top_k"]
    if top_k is not None and (not _int(top_k) or (top_k < 1 and top_k != -1)):
        raise RequestError(f"top_k must be null, -1 or a positive integer, got {top_k!r}")
    stops = s["stop_strings"]
    if stops is not None and (not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) and x for x in stops)):
        raise RequestError(f"stop_strings must be a list of non-empty strings or null, got {stops!r}")
    bad = s["bad_words"]
    if bad is not None and (not isinstance(bad, (list, tuple)) or not all(isinstance(x, str) and x for x in bad)):
        raise RequestError(f"bad_words must be a list of non-empty strings or null, got {bad!r}")
    ids = s["stop_token_ids"]
    if ids is not None and (not isinstance(ids, (list, tuple)) or not all(_int(x) and x >= 0 for x in ids)):
        raise RequestError(f"stop_token_ids must be a list of token ids or null, got {ids!r}")
    seed = s["seed"]
    if seed is not None and not _int(seed):
        raise RequestError(f"seed must be an integer or null, got {seed!r}")
    n = s["n"]
    if n is not None and (not _int(n) or n < 1):
        raise RequestError(f"n must be a positive integer (samples per prompt), got {n!r}")
    if n is not None and n > 1 and temp == 0:
        raise RequestError(f"n={n} samples need temperature > 0: greedy decoding gives one answer (vLLM refuses it)")
    for key in ("logprobs", "prompt_logprobs"):
        if s[key] is not None and (not _int(s[key]) or s[key] < 0):
            raise RequestError(f"{key} must be null or an integer >= 0, got {s[key]!r}")
    so = s["structured_outputs"]
    if so is not None and (not isinstance(so, dict) or sum(so.get(k) is not None for k in STRUCTURED) != 1
                           or set(so) - set(STRUCTURED) - set(STRUCTURED_OPTIONS)):
        raise RequestError(f"structured_outputs must be null or a dict with exactly one of {list(STRUCTURED)} "
                           f"(and options {list(STRUCTURED_OPTIONS)}), got {so!r}")
    if s["ignore_eos"] is not None and not isinstance(s["ignore_eos"], bool):
        raise RequestError(f"ignore_eos must be true, false or null, got {s['ignore_eos']!r}")
