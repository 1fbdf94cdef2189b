"""Retry delays: capped exponential backoff with jitter, the one schedule every retry uses.

The defaults are NeMo-RL's rollout re-dispatch schedule (1 s, doubling, capped at 30 s, 5
attempts). ``max_attempts`` counts every attempt including the first, so a policy yields
``max_attempts - 1`` delays — exactly Prefect's ``retries`` and ``retry_delay_seconds``.

Jitter is downward only: a delay is ``nominal * (1 - jitter * u)`` with ``u`` uniform in
[0, 1). ``jitter=1.0`` is AWS-style full jitter (uniform in (0, nominal]), smaller values are
proportional jitter, ``0`` is none. Downward-only keeps ``max_s`` a true ceiling, and the
random source is an injectable ``random.Random`` so tests and replays are deterministic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BackoffPolicy:
    """Capped exponential backoff: ``min(max_s, base_s * factor ** (attempt - 1))``, jittered."""

    base_s: float = 1.0
    factor: float = 2.0
    max_s: float = 30.0
    jitter: float = 0.25
    max_attempts: int = 5

    def __post_init__(self) -> None:
        if self.base_s < 0:
            raise ValueError(f"BackoffPolicy.base_s must be >= 0, got {self.base_s}")
        if self.factor < 1:
            raise ValueError(
                f"BackoffPolicy.factor must be >= 1 (delays must not shrink), got {self.factor}"
            )
        if self.max_s < self.base_s:
            raise ValueError(
                f"BackoffPolicy.max_s must be >= base_s ({self.base_s}), got {self.max_s}"
            )
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"BackoffPolicy.jitter must be within [0, 1], got {self.jitter}")
        if self.max_attempts < 1:
            raise ValueError(
                f"BackoffPolicy.max_attempts must be >= 1 (it counts the first attempt), "
                f"got {self.max_attempts}"
            )

    @property
    def retries(self) -> int:
        """Attempts after the first: Prefect's ``retries``."""
        return self.max_attempts - 1

    def nominal_delay(self, attempt: int) -> float:
        """Un-jittered wait after failed attempt ``attempt`` (1-based) before the next one."""
        if attempt < 1:
            raise ValueError(f"attempt is 1-based, got {attempt}")
        # Bound the exponent before computing: factor ** 1000 overflows a float, and the
        # cap is reached long before that for any factor > 1.
        exponent = min(attempt - 1, 1024)
        try:
            raw = self.base_s * self.factor**exponent
        except OverflowError:
            raw = self.max_s
        return min(self.max_s, raw)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Jittered wait after failed attempt ``attempt`` (1-based) before the next one."""
        nominal = self.nominal_delay(attempt)
        if self.jitter == 0 or nominal == 0:
            return nominal
        source = rng if rng is not None else random.Random()
        return nominal * (1.0 - self.jitter * source.random())

    def delays(self, rng: random.Random | None = None) -> list[float]:
        """The jittered waits between all ``max_attempts`` attempts (``retries`` of them)."""
        source = rng if rng is not None else random.Random()
        return [self.delay(attempt, source) for attempt in range(1, self.max_attempts)]

    def nominal_delays(self) -> list[float]:
        """The un-jittered waits between all ``max_attempts`` attempts."""
        return [self.nominal_delay(attempt) for attempt in range(1, self.max_attempts)]

    def as_prefect_retry_delays(self) -> list[float]:
        """Per-retry delays for a Prefect task's ``retry_delay_seconds`` (with ``retries``).

        Un-jittered on purpose: this list is fixed when the task is decorated, so jitter drawn
        here would be one frozen draw shared by every run. Prefect jitters per run through
        its own ``retry_jitter_factor``.
        """
        return self.nominal_delays()
