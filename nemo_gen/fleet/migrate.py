"""The driver's side of migration (``fleet.migration``; the rules are ``nemo_gen.core.migration``'s).

``Checkpointer``: one background thread that, every ``fleet.migration.checkpoint_s``, asks each
shard holding keyed requests for their tokens since the last answer (``ShardDriver.start_progress``,
one call per busy shard, never a second while one is unanswered, so a hung shard costs nothing
more) and keeps them in ``Checkpoints``. ``Moving``: one generate call's migrations — its
requests keyed, sent (tracked by the checkpointer), answered (continuations joined to what was
kept) or lost (carried on from their checkpoints).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from typing import Any, Callable, Iterable, Iterator

from nemo_gen.core.attempts import may_be_poison
from nemo_gen.core.migration import Checkpoints, Kept, Migrations
from nemo_gen.core.results import GenerationRequest, GenerationResult, MoveCause
from nemo_gen.core.wire import FailureKind, RequestResult, Sampling

log = logging.getLogger(__name__)

# The router's result of a request from a shard's answer: (request, answer, shard, version).
Decode = Callable[[GenerationRequest, RequestResult, "int | None", "int | None"], GenerationResult]


class Checkpointer:
    """See the module doc. ``driver``: the fleet's ``ShardDriver``; ``period_s``: the cadence."""

    def __init__(self, driver: Any, period_s: float):
        self.driver = driver
        self.period_s = period_s
        self.checkpoints = Checkpoints()
        self.calls = 0  # progress calls made (a metric: what checkpointing costs)
        self.migrated = 0  # requests' samples that went on elsewhere from their tokens (a metric)
        self._lock = threading.Condition()
        self._held: dict[str, tuple[Any, set[str]]] = {}  # actor name -> (its handle, keys running there)
        self._serial = itertools.count()
        self._thread: threading.Thread | None = None

    def call_name(self) -> str:
        return f"c{next(self._serial)}"

    def sent(self, handle: Any, requests: Iterable[GenerationRequest]) -> None:
        with self._lock:
            _, keys = self._held.setdefault(handle.name, (handle, set()))
            keys.update(r.key for r in requests if r.key is not None)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nemo-gen-checkpoints", daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def drop(self, keys: Iterable[str]) -> None:
        """A call is over: its keys run nowhere any more and what was kept of them is forgotten."""
        keys = set(keys)
        with self._lock:
            for name, (_, held) in list(self._held.items()):
                held.difference_update(keys)
                if not held:
                    del self._held[name]
            for key in keys:
                self.checkpoints.take(key)

    def done(self, handle: Any, requests: Iterable[GenerationRequest], forget: bool = True) -> None:
        """``requests`` no longer run on ``handle`` (answered, or lost: ``forget`` False keeps
        their checkpoints for ``take``)."""
        keys = [r.key for r in requests]
        with self._lock:
            held = self._held.get(handle.name)
            if held is not None:
                held[1].difference_update(keys)
                if not held[1]:
                    del self._held[handle.name]
            if forget:
                for key in keys:
                    self.checkpoints.take(key)

    def take(self, key: str | None) -> list[Kept]:
        with self._lock:
            return self.checkpoints.take(key)

    def holds(self, name: str) -> bool:
        """Does a call's request still run on actor ``name`` (a drain waits until none does)?"""
        with self._lock:
            return name in self._held

    def kept_now(self) -> dict[str, list[list[int]]]:
        """Each running request's samples' tokens as checkpointed now, by key (diagnostics, tests)."""
        with self._lock:
            return self.checkpoints.tokens()

    def _run(self) -> None:
        asked: dict[str, Any] = {}  # actor name -> its progress call in flight
        while True:
            with self._lock:
                while not self._held and not asked:
                    self._lock.wait()
                held = {name: (handle, set(keys)) for name, (handle, keys) in self._held.items()}
            began = time.monotonic()
            for name, (handle, keys) in held.items():
                if name not in asked:
                    with self._lock:
                        known = self.checkpoints.known(sorted(keys))
                    try:
                        asked[name] = self.driver.start_progress(handle, known)
                        self.calls += 1
                    except Exception as exc:  # the shard is going: its loss is the router's to see
                        log.debug("progress of %s not asked: %s", name, exc)
            answered = self.driver.wait(list(asked.values()), self.period_s) if asked else []
            for call in answered:
                asked.pop(call.handle.name, None)
                try:
                    progress = self.driver.result(call)
                except Exception as exc:  # lost meanwhile: what was kept before stays
                    log.debug("progress of %s failed: %s", call.handle.name, exc)
                    continue
                with self._lock:
                    running = self._held.get(call.handle.name, (None, set()))[1]
                    self.checkpoints.apply(p for p in progress if p.key in running)
            for name in [n for n in asked if n not in held]:  # nothing runs there any more
                self.driver.cancel(asked.pop(name))
            # The next round a period after this one began, not a period after its answers.
            rest = self.period_s - (time.monotonic() - began)
            if rest > 0:
                with self._lock:
                    self._lock.wait(rest)


class Moving:
    """One generate call's migrations (``Migrations`` over the fleet's ``Checkpointer``)."""

    def __init__(self, checkpointer: Checkpointer, sampling: Sampling):
        self.checkpointer = checkpointer
        self.migrations = Migrations(sampling)
        self.name = checkpointer.call_name()
        self._keys: set[str] = set()  # every key this call sent

    def keyed(self, requests: list[GenerationRequest]) -> list[GenerationRequest]:
        return Migrations.keyed(requests, self.name)

    def sent(self, handle: Any, requests: list[GenerationRequest]) -> None:
        self._keys.update(r.key for r in requests if r.key is not None)
        self.checkpointer.sent(handle, requests)

    def close(self) -> None:
        """The call is over (answered, failed, timed out or cancelled): nothing of it is checkpointed now."""
        self.checkpointer.drop(self._keys)

    def lost(self, handle: Any, req: GenerationRequest, shard: int,
             kept: list[Kept] | None = None, cause: MoveCause = MoveCause.LOST) -> list[GenerationRequest] | None:
        """``req`` was lost with its shard (or drained: ``cause``) after making ``kept`` (by
        sample; None: what its checkpoints say): its continuations, or None (sent again as it is)."""
        self.checkpointer.done(handle, [req], forget=False)
        return self.migrations.lost(req, shard, self.checkpointer.take(req.key) if kept is None else kept, cause)

    def carry(self, member: Any, batch: list[GenerationRequest], shard: int, decode: Decode,
              kept: list[Kept] | None = None, cause: MoveCause = MoveCause.LOST
              ) -> tuple[list[GenerationRequest], list[GenerationRequest], list[GenerationResult]]:
        """``batch`` was lost with shard ``shard`` (actor ``member``): (the continuations of those
        that kept tokens, those that kept none and go again as they are — a re-route that counts —,
        the results of any that needed nothing more). ``kept``: what a stream's one request had
        made (its caller has it), instead of its checkpoints."""
        carried, again, done = [], [], []
        for req in batch:
            more = self.lost(member, req, shard, kept, cause)
            if more is None:
                again.append(req)
                continue
            carried += more
            self.checkpointer.migrated += len(more)
            if not more and (whole := self.migrations.whole(req.index)) is not None:
                done.append(self._stamp(decode(self.migrations.request(req), whole, shard, None)))
        return carried, again, done

    def answered(self, handle: Any, batch: list[GenerationRequest], results: Iterable[RequestResult],
                 shard: int | None, version: int | None, decode: Decode) -> list[GenerationResult]:
        """A shard's answers for ``batch``: the caller's results that are whole now (a
        continuation's joined to what its request kept; none while other samples of it run)."""
        self.checkpointer.done(handle, batch)
        out = []
        for req, raw in zip(batch, results):
            whole = self.migrations.answered(req, raw)
            if whole is not None:
                out.append(self._stamp(decode(self.migrations.request(req), whole, shard, version)))
        return out

    def _stamp(self, result: GenerationResult) -> GenerationResult:
        result.migrations = self.migrations.moves(result.index)
        return result


def answers(moving: Moving | None, handle: Any, batch: list[GenerationRequest], results: Iterable[RequestResult],
            shard: int | None, version: int | None, decode: Decode) -> list[GenerationResult]:
    """A shard's answers for ``batch`` as the caller's results: each decoded, or — the call's
    requests may move (``moving``) — those whole now (``Moving.answered``)."""
    if moving is None:
        return [decode(req, raw, shard, version) for req, raw in zip(batch, results)]
    return moving.answered(handle, batch, results, shard, version, decode)


@contextlib.contextmanager
def closed(moving: Moving | None) -> Iterator[None]:
    """``moving`` closed when the call ends, however it ends."""
    try:
        yield
    finally:
        if moving is not None:
            moving.close()


def moving_for(checkpointer: Checkpointer | None, sampling: Sampling) -> Moving | None:
    """A call's migrations; None when fleet.migration is off or the call asks for what a
    checkpoint does not carry (each token's alternatives, the prompt's logprobs): such a call's
    requests start again from their prompts."""
    if checkpointer is None or sampling.logprobs or sampling.prompt_logprobs is not None:
        return None
    return Moving(checkpointer, sampling)


def movable(error: BaseException, kind: FailureKind) -> bool:
    """A lost shard's requests go on elsewhere from their tokens (``fleet.migration``), unless the
    fault model's poison rule (``nemo_gen.core.attempts.may_be_poison``) keeps them off every engine."""
    return kind is FailureKind.DEAD and not may_be_poison(error)
