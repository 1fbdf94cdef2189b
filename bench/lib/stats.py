"""The statistics every benchmark reports the same way: the spread of a sample (median, min,
max: on a shared machine the range matters as much as the middle), medians of runs key by key,
ratios taken within a pair of runs (A then B in one round, so slow drift cancels), and a
verdict against a target."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

PASS, MISS, FAIL = "PASS", "MISS", "FAIL"  # MISS: a target not met (a measurement); FAIL: wrong


def spread(values: Sequence[float]) -> dict[str, float]:
    if not values:
        raise ValueError("spread of no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def medians(runs: Sequence[Mapping[str, float]], keys: Iterable[str] | None = None) -> dict[str, float]:
    """Key by key, the median over ``runs`` (every key of the first run unless ``keys`` is given;
    a key some run lacks is left out)."""
    if not runs:
        return {}
    keys = list(runs[0]) if keys is None else list(keys)
    return {k: statistics.median(r[k] for r in runs) for k in keys if all(k in r for r in runs)}


def paired_ratios(pairs: Iterable[tuple[float, float]]) -> list[float]:
    """``a / b`` within each pair."""
    return [a / b for a, b in pairs]


def verdict(value: float | None, target: float, higher_is_better: bool) -> str:
    """PASS when ``value`` meets ``target``; MISS otherwise, or when there is no value."""
    if value is None:
        return MISS
    ok = value >= target if higher_is_better else value <= target
    return PASS if ok else MISS


def check(ok: bool) -> str:
    """A correctness verdict: PASS or FAIL."""
    return PASS if ok else FAIL


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated between the two
    nearest ranks (numpy's default); NaN for no values. With few samples p99 lies next to the max."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def met(ok: bool) -> str:
    """A performance target's verdict from a comparison already made: PASS or MISS."""
    return PASS if ok else MISS
