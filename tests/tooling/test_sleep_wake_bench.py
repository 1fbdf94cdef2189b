"""bench/sleep_wake_gpu.py's arithmetic (its GPU run is the GPU sitting's): the targets read the
worst cycle's freed share and the medians, and a run with no cycle is an error, not a pass."""

from __future__ import annotations

import pytest

from bench.sleep_wake_gpu import summarize

GIB = 2**30


def cycle(awake: float, asleep: float, sleep_s: float = 1.0, equal: bool = True) -> dict:
    return {"awake_bytes": awake * GIB, "asleep_bytes": asleep * GIB, "sleep_s": sleep_s,
            "wake_weights_s": 2.0, "wake_kv_cache_s": 0.5, "tokens_equal": equal}


def test_the_worst_cycle_sets_the_freed_share_and_the_medians_the_times():
    s = summarize(100.0, [cycle(60, 1.2), cycle(60, 9.0, sleep_s=3.0), cycle(60, 1.0, sleep_s=2.0)])
    assert s["freed_fraction"] == pytest.approx(1 - 9 / 60)  # below 0.9: the cycle that kept 9 GiB
    assert s["sleep_s"] == 2.0 and s["wake_s"] == 2.5 and s["cycle_s"] == 4.5
    assert s["wake_over_launch"] == pytest.approx(0.045) and s["tokens_equal"]


def test_one_cycle_with_other_tokens_fails_the_tokens_check():
    assert not summarize(100.0, [cycle(60, 1), cycle(60, 1, equal=False)])["tokens_equal"]


def test_no_cycle_is_an_error():
    with pytest.raises(ValueError, match="no sleep/wake cycle"):
        summarize(100.0, [])
