"""Retry delays: capped exponential, jittered downward only, deterministic with a seeded rng."""

from __future__ import annotations

import random

import pytest

from nemo_gen.core.backoff import BackoffPolicy


def test_defaults_match_the_reference_schedule() -> None:
    policy = BackoffPolicy()
    assert policy.retries == 4
    assert policy.nominal_delays() == [1.0, 2.0, 4.0, 8.0]
    assert policy.as_prefect_retry_delays() == [1.0, 2.0, 4.0, 8.0]


def test_delays_are_capped_at_max_s() -> None:
    policy = BackoffPolicy(base_s=1, factor=2, max_s=30, jitter=0, max_attempts=8)
    assert policy.delays() == [1, 2, 4, 8, 16, 30, 30]
    assert policy.delay(10_000) == 30  # huge exponents do not overflow


def test_jitter_stays_within_bounds_and_below_nominal() -> None:
    policy = BackoffPolicy(jitter=0.25, max_attempts=6)
    rng = random.Random(1)
    for _ in range(200):
        for nominal, actual in zip(policy.nominal_delays(), policy.delays(rng), strict=True):
            assert 0.75 * nominal <= actual <= nominal


def test_full_jitter_spans_zero_to_nominal() -> None:
    policy = BackoffPolicy(base_s=10, max_s=10, jitter=1.0, max_attempts=2)
    rng = random.Random(7)
    samples = [policy.delay(1, rng) for _ in range(500)]
    assert all(0 < s <= 10 for s in samples)
    assert min(samples) < 1 and max(samples) > 9


def test_seeded_rng_is_deterministic_and_jitter_varies() -> None:
    policy = BackoffPolicy(max_attempts=5)
    first = policy.delays(random.Random(42))
    assert first == policy.delays(random.Random(42))
    assert first != policy.delays(random.Random(43))
    assert first != policy.nominal_delays()


def test_single_attempt_has_no_delays() -> None:
    policy = BackoffPolicy(max_attempts=1)
    assert policy.delays() == [] and policy.retries == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"base_s": -1}, "base_s"),
        ({"factor": 0.5}, "factor"),
        ({"base_s": 10, "max_s": 5}, "max_s"),
        ({"jitter": 1.5}, "jitter"),
        ({"jitter": -0.1}, "jitter"),
        ({"max_attempts": 0}, "max_attempts"),
    ],
)
def test_validation_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=rf"BackoffPolicy\.{field}"):
        BackoffPolicy(**kwargs)


def test_attempt_is_one_based() -> None:
    with pytest.raises(ValueError, match="1-based"):
        BackoffPolicy().delay(0)


def test_policy_is_frozen() -> None:
    with pytest.raises(AttributeError):
        BackoffPolicy().base_s = 2.0  # type: ignore[misc]
