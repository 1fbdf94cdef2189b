"""Sampling keywords: the generation config's names, merged and checked before any dispatch.

``fleet.generate(prompts, temperature=0)`` speaks NeMo-RL's GenerationConfig vocabulary; this
module merges per-call keywords over the configured defaults and rejects unknown or invalid
ones with an error naming the keyword, so a bad call fails before any shard is touched.
"""

from __future__ import annotations

from typing import Any, Mapping

from nemo_gen.errors import RequestError

SAMPLING_KEYS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "stop_strings",
    "seed",
    "ignore_eos",
)


def resolve_sampling(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults from the generation config, overridden per call. Returns a validated dict."""
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise RequestError(
            f"unknown sampling keyword(s) {unknown}; known: {list(SAMPLING_KEYS)}"
        )
    merged = {key: defaults.get(key) for key in SAMPLING_KEYS}
    merged.update(overrides)
    _check(merged)
    return merged


def _check(s: dict[str, Any]) -> None:
    mnt = s["max_new_tokens"]
    if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1:
        raise RequestError(f"max_new_tokens must be a positive integer, got {mnt!r}")
    temp = s["temperature"]
    if temp is None or not isinstance(temp, (int, float)) or temp < 0:
        raise RequestError(f"temperature must be a number >= 0, got {temp!r}")
    top_p = s["top_p"]
    if top_p is None or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p!r}")
    top_k = s["top_k"]
    if top_k is not None and (not isinstance(top_k, int) or (top_k < 1 and top_k != -1)):
        raise RequestError(f"top_k must be null, -1 or a positive integer, got {top_k!r}")
    for key in ("stop_strings", "stop_token_ids"):
        value = s[key]
        if value is not None and not isinstance(value, (list, tuple)):
            raise RequestError(f"{key} must be a list or null, got {value!r}")
