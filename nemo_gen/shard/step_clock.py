"""The engine's step clock: when it last made progress and how much since it became busy (a
probe's evidence that a busy engine is alive, ``nemo_gen.core.liveness``), and the stretches
without a finished step (``step_gaps``: how long a refit stalled generation, as
bench/refit_inflight.py measures it).

The sync engine's step thread calls ``begin`` at a batch's start and ``stepped`` after each
engine step; the async engine counts outputs instead (``running`` around each request,
``output`` per output) and keeps no gaps.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any, Iterator

from nemo_gen.core.liveness import busy_answer
from nemo_gen.core.wire import StepGaps

# Stretches without a step longer than this are kept (step_gaps): far above a decode step.
GAP_S = 0.005


class StepClock:
    def __init__(self) -> None:
        self.last_step_at = time.monotonic()
        # Steps of the running batch (sync), or outputs since the engine was last idle (async):
        # the first (the prefill of the whole batch, and on a fresh engine kernel selection for
        # new shapes) can take far longer than a decode step without the engine being wedged.
        self.steps = 0
        self.active = 0  # the async engine's requests running now
        # The longest time without a finished step since the last reset, and when the last one ended.
        self.max_step_gap = 0.0
        self._last_step_end: float | None = None
        # Stretches without a finished step longer than GAP_S, as (start, end) on the machine's
        # monotonic clock, so a benchmark can tell which ones a refit caused.
        self._gaps: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)

    def touch(self) -> None:
        """Busy from now: the age of the last step counts from here."""
        self.last_step_at = time.monotonic()

    def begin(self) -> None:
        """A sync batch starts stepping."""
        self.last_step_at = time.monotonic()
        self.steps = 0

    def stepped(self) -> None:
        """A sync engine step finished."""
        now = time.monotonic()
        if self._last_step_end is not None:
            gap = now - self._last_step_end
            self.max_step_gap = max(self.max_step_gap, gap)
            if gap > GAP_S:
                self._gaps.append((self._last_step_end, now))
        self.last_step_at = self._last_step_end = now
        self.steps += 1

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """One request of the async engine running: its outputs are the engine's evidence of progress."""
        if self.active == 0:
            self.steps = 0
            self.last_step_at = time.monotonic()
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    def output(self) -> None:
        """An output of the async engine."""
        self.steps += 1
        self.last_step_at = time.monotonic()

    def evidence(self, stall_s: float, warmup_s: float) -> dict[str, Any]:
        """A probe's answer about the busy engine (``busy_answer``)."""
        return busy_answer(time.monotonic() - self.last_step_at, self.steps, stall_s, warmup_s)

    def gaps(self, reset: bool) -> StepGaps:
        """The longest time the engine went without finishing a step (sync engine) since the
        last reset, and each stretch over ``GAP_S`` as (start, end) monotonic seconds; ``reset``
        starts a new window."""
        out = StepGaps(self.max_step_gap, tuple(self._gaps))
        if reset:
            self.max_step_gap, self._last_step_end = 0.0, None
            self._gaps.clear()
        return out
