"""One request's way through the fault model: its deadline, its tries, and the fleet's bound.

What the router does after each failure of a request is decided here, by the failure's kind
(``nemo_gen.core.retry``):

- *dead*: the request is sent to another shard, at most ``max_reroutes`` times; then it fails
  with the last ``ShardDiedError``. (Condemning the dead shard is the router's, not the
  request's, business.) An ``EngineCrashError`` (the engine failed on its own while it ran the
  request, which may be its cause) is never re-routed: the request fails with it at once.
- *busy*: the request is offered to another shard after a backoff (``busy_backoff_s``,
  doubling), at most ``busy_retries`` times; then it fails with ``FleetBusy``.
- *slow* and *data*: the request fails as it is; nothing is retried.

``Deadline`` is a request's deadline (unbounded when none is set), on a clock that tests can
replace; a stream restarts it after each of its items. ``Admission`` bounds the requests the
fleet holds at once (``fleet.max_pending_requests``): past it a call fails at once with
``FleetBusy`` and nothing of it is sent.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from nemo_gen.core.wire import FailureKind
from nemo_gen.errors import EngineCrashError, FleetBusy, ShardDiedError

Clock = Callable[[], float]


@dataclass(frozen=True)
class TryPolicy:
    """How often one request is tried again (``fleet.max_reroutes``, ``fleet.busy_*``)."""

    max_reroutes: int
    busy_retries: int
    busy_backoff_s: float
    retry_after_s: float = 1.0  # what a FleetBusy tells its caller to wait


@dataclass(frozen=True)
class RequestLimits:
    """What bounds the fleet's requests: the default deadline (``fleet.request_timeout_s``; None:
    none), the tries after a failure, and the requests held at once (``fleet.max_pending_requests``)."""

    timeout_s: float | None
    tries: TryPolicy
    max_pending: int | None
    # fleet.migration: how often running requests are checkpointed (None: off, a loss re-routes from the prompt).
    checkpoint_s: float | None = None


@dataclass(frozen=True)
class Retry:
    """Send the request again after ``delay_s``, to a shard other than ``avoid`` if there is one."""

    delay_s: float = 0.0
    avoid: int | None = None


@dataclass(frozen=True)
class Fail:
    """Give up: the request fails with ``error``."""

    error: BaseException


def may_be_poison(error: BaseException) -> bool:
    """The engine exited on its own (``EngineCrashError``) while it ran the request: the request
    may be what killed it, and sent anywhere (re-routed, or migrated with its tokens) it would
    kill the next engine too. Such a request fails; it goes to no other engine."""
    return isinstance(error, EngineCrashError)


class Attempts:
    """The tries of one request so far, and what to do after the next failure."""

    def __init__(self, policy: TryPolicy):
        self.policy = policy
        self.rerouted = 0  # sent again after a dead shard
        self.refused = 0  # refused by busy shards

    def after(self, error: BaseException, kind: FailureKind, shard: int | None) -> Retry | Fail:
        """``error`` (of ``kind``: dead / busy / slow / data) ended the try on ``shard``."""
        p = self.policy
        if kind is FailureKind.DEAD:
            if may_be_poison(error):
                return Fail(error)
            if self.rerouted >= p.max_reroutes:
                detail = getattr(error, "detail", None) or str(error)
                return Fail(ShardDiedError(-1 if shard is None else shard,
                                           f"{detail} (the request was re-routed {self.rerouted} time(s) already: "
                                           f"fleet.max_reroutes={p.max_reroutes})"))
            self.rerouted += 1
            return Retry()
        if kind is FailureKind.BUSY:
            self.refused += 1
            if self.refused > p.busy_retries:
                return Fail(FleetBusy(
                    f"no shard admits the request now: refused {self.refused} time(s) by busy shards "
                    f"(fleet.busy_retries={p.busy_retries}; last: {error})", retry_after_s=p.retry_after_s))
            return Retry(delay_s=p.busy_backoff_s * 2 ** (self.refused - 1), avoid=shard)
        return Fail(error)


class Deadline:
    """When a request gives up waiting: ``timeout_s`` from now on ``clock``; None: never."""

    def __init__(self, timeout_s: float | None, clock: Clock = time.monotonic):
        self.timeout_s = timeout_s
        self._clock = clock
        self._at = math.inf
        self.restart()

    def restart(self) -> None:
        """From now again (a stream's deadline runs between two of its items)."""
        self._at = math.inf if self.timeout_s is None else self._clock() + self.timeout_s

    @property
    def bounded(self) -> bool:
        return self.timeout_s is not None

    def remaining(self) -> float:
        return self._at - self._clock()

    def passed(self) -> bool:
        return self._clock() >= self._at

    def wait_s(self, at_most: float) -> float:
        """How long a poll may sleep: ``at_most``, or less when the deadline comes first."""
        return max(0.0, min(at_most, self.remaining()))


class Admission:
    """Requests held at once, against ``limit`` (None: no bound), in the words of the ``setting``
    that sets it. Thread-safe."""

    def __init__(self, limit: int | None, retry_after_s: float = 1.0, setting: str = "fleet.max_pending_requests",
                 holder: str = "the fleet"):
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.setting = setting
        self.holder = holder
        self.held = 0
        self.refused = 0  # requests refused at the bound so far (a metric)
        self._lock = threading.Lock()

    def admit(self, count: int) -> None:
        """Hold ``count`` more; ``FleetBusy`` at once past the bound (nothing is held then)."""
        with self._lock:
            if self.limit is not None and self.held + count > self.limit:
                held = self.held
                self.refused += count
                raise FleetBusy(f"{self.holder} holds {held} request(s) and admits at most {self.limit} "
                                f"({self.setting}); {count} more were refused, none sent",
                                retry_after_s=self.retry_after_s)
            self.held += count

    def check_room(self) -> None:
        """``FleetBusy`` at once if not even one more fits: the cheap refusal, before a request
        is parsed to learn how many it would hold."""
        if self.limit is not None and self.held >= self.limit:
            self.admit(1)  # refuses, with the message and the count

    def release(self, count: int) -> None:
        with self._lock:
            self.held -= count

    @contextmanager
    def admitted(self, count: int) -> Iterator[None]:
        """Hold ``count`` requests while the block runs."""
        self.admit(count)
        try:
            yield
        finally:
            self.release(count)
