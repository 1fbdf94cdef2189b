"""Routing: least-loaded picks over the serving shards, sessions' shards (``affinity.py``), and the fault model
(``nemo_gen.core.retry``) applied to every request of the batch, per-request and stream paths.

Building requests from prompts is ``requests.py``'s; turning shard replies into results and
stream deltas is ``decode.py``'s; ``Router`` keeps the public methods that front both. What
happens to a request whose try fails is ``nemo_gen.core.attempts``'s decision, by the failure's
kind:

- *dead* (the shard's actor or engine is gone, or it was condemned meanwhile by its watch or
  its probes): the shard is condemned and the request goes on on another from the tokens it
  had made (``fleet.migration``: ``nemo_gen.fleet.migrate``), or, none kept, is sent again, at
  most ``fleet.max_reroutes`` times; whatever the lost shard might still answer is dropped, so
  every prompt gets exactly one result;
- *busy* (the shard refused admission): the request goes to another shard after a backoff,
  at most ``fleet.busy_retries`` times, then ``FleetBusy``; the shard is never condemned;
- *slow* (the request's deadline passed: ``timeout_s``, else ``fleet.request_timeout_s``; a
  stream's between two items): that request fails with ``RequestTimeout`` and is aborted on
  its engine; the shard serves on. No deadline is set by default: a healthy shard finishes a
  generation of any length, and a wedged one is found by its probes.

Cancelling a call (``generate_async``'s task, closing a stream) aborts its requests on their
engines. ``fleet.max_pending_requests`` bounds what the fleet holds at once (``FleetBusy`` at
once past it). The batch path (``generate``), the per-request awaitable (``generate_async``)
and the stream (``generate_stream``) share one rule for "this call is lost" (``_lost``) and one
way to condemn (``_condemn``); the last two also share how a failed try is read (``_failed``)
and what comes next (``_next_try``). A stream lost after its first token goes on from the
tokens it handed the caller (``stream_moves.py``; migration off, or a call asking for
logprobs > 0 or the prompt's: it ends with ``ShardDiedError``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from nemo_gen.core.attempts import Admission, Attempts, Clock, Deadline, Fail, RequestLimits
from nemo_gen.core.drain import move_cause
from nemo_gen.core.fleet_health import SERVING_STATES, HealthyShardSelector
from nemo_gen.core.members import Member
from nemo_gen.core.retry import describe, kind_of
from nemo_gen.core.results import Delta, GenerationRequest, GenerationResult, MoveCause
from nemo_gen.core.slots import SlotTable
from nemo_gen.core.wire import FailureKind, RequestResult, Sampling, StreamDeltas
from nemo_gen.errors import FleetAsleep, RequestTimeout, ShardDiedError, ShardUnavailableError
from nemo_gen.fleet.affinity import SessionAffinity
from nemo_gen.fleet.decode import StreamDecoder, decode_result
from nemo_gen.fleet.driver import Call, ShardDriver
from nemo_gen.fleet.members import Membership
from nemo_gen.fleet.rolling import route_new
from nemo_gen.fleet.migrate import Checkpointer, Moving, answers, closed, movable, moving_for
from nemo_gen.fleet.stream_moves import StreamMoves
from nemo_gen.fleet.waiting import LOST, POLL_S, answer, next_item
from nemo_gen.fleet.requests import Prompt, build_requests, on_loop, sampling_of, sessions_of

__all__ = ["Prompt", "Router"]


log = logging.getLogger(__name__)


class Router:
    def __init__(self, *, slots: SlotTable, members: Membership, driver: ShardDriver, tokenizer: Any,
                 max_model_len: int, decode_text: bool, limits: RequestLimits, serving_version: Callable[[], int | None],
                 fleet_name: str, session_slack: int, vocab_size: int | None = None,
                 clock: Clock = time.monotonic, digest_of: Callable[[int | None], str | None] | None = None):
        self.slots = slots
        self.health = health = slots.ledger  # read only: every write is a table transaction
        self.selector = HealthyShardSelector(health)
        self.members = members
        self.driver = driver
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size  # token ids past it are refused before any shard sees them
        self._decode_text = decode_text  # engines without a tokenizer: streams' text is decoded here
        self.request_timeout_s = limits.timeout_s
        self.tries = limits.tries
        self.admission = Admission(limits.max_pending, limits.tries.retry_after_s)
        self.clock = clock  # requests' deadlines run on it (a test may turn it fast)
        self._version = serving_version
        self._digest_of = digest_of or (lambda version: None)  # each version's weight digest (results)
        self._fleet_name = fleet_name
        self.affinity = SessionAffinity(health, members, self.selector, session_slack)  # sessions' shards
        self.rerouted = 0  # requests sent again after their shard was lost (a metric)
        # fleet.migration on: running requests are checkpointed, a lost one goes on from its tokens.
        self.checkpointer = Checkpointer(driver, limits.checkpoint_s) if limits.checkpoint_s else None
        self.refused = 0  # requests a busy shard refused (a metric)
        self.timed_out = 0  # requests that failed at their deadline (a metric)

    def deadline(self, timeout_s: float | None) -> Deadline:
        """A request's deadline: the call's own ``timeout_s``, else ``fleet.request_timeout_s``."""
        return Deadline(self.request_timeout_s if timeout_s is None else timeout_s, self.clock)

    # -- requests and results (built in requests.py, decoded in decode.py) ----------------------

    def requests(self, prompts: Sequence[Prompt]) -> tuple[list[GenerationRequest], dict[int, GenerationResult]]:
        """Tokenize on the driver; too-long prompts become error results right away."""
        return build_requests(prompts, self.tokenizer, self.max_model_len, self.vocab_size)

    async def requests_async(self, prompts: Sequence[Prompt]
                             ) -> tuple[list[GenerationRequest], dict[int, GenerationResult]]:
        """``requests`` off the event loop: tokenizing a long prompt or rendering a chat template
        must not hold up the loop's other requests (an HTTP server's /health among them). Token
        ids and short strings (``on_loop``) are done on the loop: the thread hop costs more."""
        if on_loop(prompts):
            return self.requests(prompts)
        return await asyncio.to_thread(self.requests, prompts)

    def result(self, req: GenerationRequest, raw: RequestResult, shard: int, version: int | None) -> GenerationResult:
        return decode_result(req, raw, shard, version, self.tokenizer, engines_decode=not self._decode_text,
                             digest_of=self._digest_of)

    def _text_tokenizer(self) -> Any | None:
        """The tokenizer to decode a stream's text with here: engines without one send none."""
        return self.tokenizer if self._decode_text else None

    # -- routing ---------------------------------------------------------------------------------

    def _try_pick(self, deadline: Deadline, avoid: int | None = None) -> int | None:
        """A serving shard, acquired; None when none serves now but a recovery under way may
        bring one back (a spare being promoted, a restart) and the request has time to wait."""
        if self._version() is None:
            raise ShardUnavailableError(
                f"fleet {self._fleet_name!r} runs in fleet.mode=train and has not been refit "
                "yet: its engines hold dummy weights and serve nothing until the first refit"
            )
        if (roll := self.slots.roll()) is not None and (
                shard := route_new(self.slots, self.health, self.members, self.selector, roll, avoid)) is not None:
            return shard  # a rolling refit: the newest version serving (nemo_gen.fleet.rolling)
        try:
            shard = self.selector.next_shard(avoid)
        except ShardUnavailableError:
            if self.members.recovering() and not deadline.passed():
                return None
            self.health.raise_if_exhausted()
            raise
        self.selector.acquire(shard)
        return shard

    def session_shard(self, session: str) -> int | None:
        """The slot that served ``session``'s last turn (None: new or forgotten)."""
        return self.affinity.last_shard(session)

    def open_session(self, session: str) -> int:
        """Place an open session (``fleet.session()``, the gateway): ``nemo_gen.fleet.affinity``."""
        return self.affinity.open(session)

    def close_session(self, session: str) -> int | None:
        """The session ended: its shard is released."""
        return self.affinity.close(session)

    def _check_awake(self) -> None:
        """A sleeping fleet (``nemo_gen.fleet.sleep``) admits nothing: a state, not a fault."""
        if (why := self.slots.sleep_state().refusal(self._fleet_name, self._version())) is not None:
            raise FleetAsleep(why, retry_after_s=self.tries.retry_after_s)

    def _pick(self, deadline: Deadline, session: str | None = None, avoid: int | None = None) -> int:
        self._check_awake()
        shard = self.affinity.pick(session) if avoid is None else None
        while shard is None and (shard := self._try_pick(deadline, avoid)) is None:
            time.sleep(POLL_S)
        self.affinity.remember(session, shard)
        return shard

    async def _pick_async(self, deadline: Deadline, session: str | None = None, avoid: int | None = None) -> int:
        self._check_awake()
        shard = self.affinity.pick(session) if avoid is None else None
        while shard is None and (shard := self._try_pick(deadline, avoid)) is None:
            await asyncio.sleep(POLL_S)
        self.affinity.remember(session, shard)
        return shard

    def _assign(self, requests: list[GenerationRequest], sessions: Mapping[int, str | None], deadline: Deadline,
                avoid: Mapping[int, int]) -> dict[int, list[GenerationRequest]]:
        """Least-loaded routing, one request at a time, so a batch spreads over the shards; a
        request of a session goes to its shard (``affinity.pick``); one a busy shard just refused goes
        elsewhere if it can (``avoid``: request index -> that shard)."""
        assignment: dict[int, list[GenerationRequest]] = {}
        try:
            for req in requests:
                shard = self._pick(deadline, sessions.get(req.index), avoid.get(req.index))
                assignment.setdefault(shard, []).append(req)
        except BaseException:
            self._release(assignment)  # nothing was sent: give the slots back
            raise
        return assignment

    def _release(self, assignment: dict[int, list[GenerationRequest]]) -> None:
        for shard, batch in assignment.items():
            for _ in batch:
                self.selector.release(shard)

    def _lost(self, member: Member) -> bool:
        """The call's shard was replaced or condemned meanwhile: its answer no longer counts."""
        return not self.members.is_current(member) or self.health.state_of(member.slot) not in SERVING_STATES

    def _condemn(self, member: Member, why: BaseException) -> None:
        """A call on the shard failed because the shard is dead (its actor or engine is gone):
        certain, not a streak — straight to DEAD, and a ``ShardLost`` for recovery. Only dead condemns."""
        log.warning("shard %d failed: %s; re-routing its requests", member.slot, why)
        self.members.condemn(member, describe(why).splitlines()[0])

    def _timeout(self, deadline: Deadline, shard: int | None, what: str = "no answer") -> RequestTimeout:
        self.timed_out += 1
        where = f"; aborted on shard {shard}, which serves on" if shard is not None else ""
        return RequestTimeout(f"{what} within {deadline.timeout_s:g}s (timeout_s, else fleet.request_timeout_s)"
                              f"{where}", shard=shard)

    # -- the batch path --------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], params: dict[str, Any],
                 session_id: str | Sequence[str | None] | None = None,
                 timeout_s: float | None = None) -> list[GenerationResult]:
        """``session_id``: one for the whole batch, or one (or None) per prompt. ``timeout_s``:
        the deadline of the whole call; a prompt not answered by then gets a ``RequestTimeout``
        result and is aborted on its engine. A prompt whose tries ran out (dead shards past
        ``fleet.max_reroutes``, busy ones past ``fleet.busy_retries``) gets that error as its
        result; the others are answered."""
        requests, results = self.requests(prompts)
        sampling = sampling_of(params)
        sessions = sessions_of(session_id, len(prompts))
        deadline = self.deadline(timeout_s)
        attempts = {req.index: Attempts(self.tries) for req in requests}
        avoid: dict[int, int] = {}
        moving = moving_for(self.checkpointer, sampling)
        requests = moving.keyed(requests) if moving is not None else requests
        with self.admission.admitted(len(requests)), closed(moving):
            pending, not_before = requests, 0.0
            while pending:
                if not_before > self.clock():  # busy shards asked for a moment
                    time.sleep(deadline.wait_s(not_before - self.clock()))
                if deadline.passed():
                    for req in pending:
                        results[req.index] = GenerationResult.failed(req, describe(self._timeout(deadline, None)))
                    break
                assignment = self._assign(pending, sessions, deadline, avoid)
                pending, not_before = self._run_batch(assignment, sampling, results, attempts, avoid, deadline,
                                                      moving)
        return [results[i] for i in range(len(prompts))]

    def _run_batch(self, assignment: dict[int, list[GenerationRequest]], sampling: Sampling,
                   results: dict[int, GenerationResult], attempts: dict[int, Attempts], avoid: dict[int, int],
                   deadline: Deadline, moving: Moving | None = None) -> tuple[list[GenerationRequest], float]:
        """One round: ``assignment``'s calls until each is answered, lost or past the deadline;
        (the requests to send again, not before when)."""
        inflight: dict[Call, tuple[Member, list[GenerationRequest]]] = {}
        again: list[GenerationRequest] = []
        not_before = 0.0

        def retry(batch: list[GenerationRequest], error: BaseException, kind: FailureKind, member: Member) -> None:
            nonlocal not_before
            shard, cause = member.slot, move_cause(kind, self.slots.was_drained(member))
            if moving is not None and movable(error, kind):  # those that kept tokens go on from them, uncounted
                carried, batch, done = moving.carry(member, batch, shard, self.result, cause=cause)
                again.extend(carried)
                results.update((r.index, r) for r in done)
            if cause is MoveCause.DRAINED:  # no fault of the shard's or the request's: again, uncounted
                return again.extend(batch)
            for req in batch:
                decision = attempts[req.index].after(error, kind, shard)
                if isinstance(decision, Fail):
                    results[req.index] = GenerationResult.failed(req, describe(decision.error), shard=shard)
                    continue
                if kind is FailureKind.DEAD:
                    self.rerouted += 1
                if decision.avoid is not None:
                    avoid[req.index] = decision.avoid
                not_before = max(not_before, self.clock() + decision.delay_s)
                again.append(req)

        try:
            for shard, batch in assignment.items():
                handle = self.members.handle(shard)
                inflight[self.driver.start_generate(handle, batch, sampling)] = (Member(handle.name, shard), batch)
                if moving is not None:
                    moving.sent(handle, batch)
            while inflight:
                for call in self.driver.wait(inflight, deadline.wait_s(POLL_S)):
                    member, batch = inflight.pop(call)
                    try:
                        out = self.driver.result(call)
                    except ShardDiedError as exc:  # the shard or its engine is gone: re-route
                        self._condemn(member, exc)
                        retry(batch, exc, FailureKind.DEAD, member)
                        continue
                    except Exception as exc:
                        if kind_of(exc) is not FailureKind.BUSY:
                            raise  # the request's own fault: the caller's to see
                        self.refused += len(batch)
                        if moving is not None:
                            moving.checkpointer.done(call.handle, batch)
                        retry(batch, exc, FailureKind.BUSY, member)
                        continue
                    self.slots.record_success(member.slot)
                    results.update((r.index, r) for r in answers(moving, call.handle, batch, out.results, out.shard,
                                                                 out.weight_version, self.result))
                for call, (member, batch) in list(inflight.items()):
                    if self._lost(member):  # condemned meanwhile (its watch, its probes): answer elsewhere
                        del inflight[call]
                        self.driver.cancel(call)
                        retry(batch, ShardDiedError(member.slot, "condemned while it held the requests"), FailureKind.DEAD,
                              member)
                    elif deadline.passed():  # slow: these requests fail; the shard serves on
                        del inflight[call]
                        self.driver.cancel(call)
                        error = describe(self._timeout(deadline, member.slot))
                        for req in batch:
                            results[req.index] = GenerationResult.failed(req, error, shard=member.slot)
        finally:
            for call in inflight:  # an error above: nothing may go on generating for nobody
                self.driver.cancel(call)
            self._release(assignment)
        return again, not_before

    # -- the per-request path --------------------------------------------------------------------

    async def generate_async(self, prompt: Prompt, params: dict[str, Any], session_id: str | None = None,
                             timeout_s: float | None = None) -> GenerationResult:
        """One request; cancelling the awaiting task aborts it on its engine."""
        requests, rejected = await self.requests_async([prompt])
        if rejected:
            return rejected[0]
        req, deadline, attempts, avoid = requests[0], self.deadline(timeout_s), Attempts(self.tries), None
        sampling = sampling_of(params)
        moving = moving_for(self.checkpointer, sampling)
        batch = moving.keyed([req]) if moving is not None else [req]  # a moved request: its samples' continuations
        with self.admission.admitted(1), closed(moving):
            while True:
                shard = await self._pick_async(deadline, session_id, avoid)
                handle = self.members.handle(shard)
                member = Member(handle.name, shard)
                if moving is not None:
                    moving.sent(handle, batch)
                try:
                    out = await answer(self.driver.generate_async(handle, batch, sampling), lambda: self._lost(member),
                                       deadline, lambda: self._timeout(deadline, member.slot))
                except (RequestTimeout, asyncio.CancelledError):
                    raise
                except Exception as exc:
                    error, kind = self._failed(handle, member, exc, "generate")
                else:
                    if out is not None:
                        self.slots.record_success(shard)
                        return answers(moving, handle, batch, out.results, out.shard, out.weight_version, self.result)[0]
                    error, kind = ShardDiedError(shard, "condemned while it held the request"), FailureKind.DEAD
                finally:
                    self.selector.release(shard)
                cause = move_cause(kind, self.slots.was_drained(member))
                if moving is not None and movable(error, kind):
                    carried, again, done = moving.carry(member, batch, shard, self.result, cause=cause)
                    if done:
                        return done[0]
                    batch = carried + again
                    if not again:  # every part kept tokens: no re-route is counted
                        continue
                if cause is MoveCause.DRAINED:  # kept tokens or not: a drain counts no re-route
                    continue
                avoid = await self._next_try(attempts, error, kind, shard, deadline)

    def _failed(self, handle: Any, member: Member, exc: BaseException, what: str) -> tuple[BaseException, FailureKind]:
        """A try of one request raised ``exc``: (the error it means, its kind); a dead shard is
        condemned here, so the per-request path and the stream condemn alike."""
        error = self.driver.classify(handle, exc, what)
        kind = kind_of(error)
        if kind is FailureKind.DEAD:
            self._condemn(member, error)
        return error, kind

    async def _next_try(self, attempts: Attempts, error: BaseException, kind: FailureKind, shard: int,
                        deadline: Deadline) -> int | None:
        """After a failed try of one request: raise what it fails with, or wait what the fault
        model says and return the shard to avoid on the next try."""
        decision = attempts.after(error, kind, shard)
        if isinstance(decision, Fail):
            raise decision.error from None
        self.rerouted += kind is FailureKind.DEAD
        self.refused += kind is FailureKind.BUSY
        if decision.delay_s:
            await asyncio.sleep(deadline.wait_s(decision.delay_s))
        return decision.avoid

    # -- the stream ----------------------------------------------------------------------------

    async def generate_stream(self, prompt: Prompt, params: dict[str, Any], session_id: str | None = None,
                              timeout_s: float | None = None) -> AsyncIterator[Delta | GenerationResult]:
        """``generate_async`` as it is generated: ``Delta``s as the shard's engine makes tokens,
        then the ``GenerationResult`` (what ``generate_async`` returns). A shard lost before the
        first delta was handed out: the request goes to another, unseen. Lost after: it goes on
        from the tokens each sample had sent (``fleet.migration``: ``stream_moves.py``); else the stream ends with
        ``ShardDiedError`` naming the shard and those tokens — never a silently short answer. ``timeout_s`` (else ``fleet.request_timeout_s``) is the longest
        wait between two items: past it, ``RequestTimeout``. Closing the iterator early cancels
        the request on its shard."""
        requests, rejected = await self.requests_async([prompt])
        if rejected:
            yield rejected[0]
            return
        req, deadline, attempts, avoid = requests[0], self.deadline(timeout_s), Attempts(self.tries), None
        sampling = sampling_of(params)
        moves = StreamMoves(moving_for(self.checkpointer, sampling), req, sampling.n)  # what each sample sent
        with self.admission.admitted(1), closed(moves.moving):
            while True:
                req, shard = moves.req, await self._pick_async(deadline, session_id, avoid)
                handle = self.members.handle(shard)
                member, stream, sent, started, finished = Member(handle.name, shard), None, 0, False, False
                kept = moves.kept()  # what this try handed the caller: a lost shard's request goes on from it
                decoder = StreamDecoder(self._text_tokenizer(), self._digest_of)
                try:
                    stream = self.driver.generate_stream(handle, req, sampling)
                    deadline.restart()
                    while (item := await next_item(stream, lambda: self._lost(member), deadline,
                                                   lambda: self._timeout(deadline, member.slot, "no token"))) is not LOST:
                        deadline.restart()
                        if not isinstance(item, StreamDeltas):
                            finished = True
                            if item is None:
                                raise ShardDiedError(shard, "the stream ended without a result")
                            self.slots.record_success(shard)
                            if (whole := moves.ended(handle, item, self.result)) is not None:
                                yield whole
                                return
                            break  # the next sample's continuation
                        for raw in item.deltas:
                            delta = moves.delta(decoder.delta(raw, shard), kept)
                            sent += len(delta.token_ids)
                            started = True
                            yield delta
                    else:
                        error, kind = ShardDiedError(shard, "condemned while it streamed"), FailureKind.DEAD
                except RequestTimeout:
                    raise
                except Exception as exc:
                    error, kind = self._failed(handle, member, exc, "generate_stream")
                finally:
                    self.selector.release(shard)
                    if stream is not None and not finished:
                        stream.cancel()
                if finished:
                    continue
                cause = move_cause(kind, self.slots.was_drained(member))
                if started and moves.moving is not None and movable(error, kind):  # on from what the caller has
                    if (done := moves.lost(member, shard, kept, cause, self.result)) is not None:
                        yield done
                        return
                    continue
                if started and kind is FailureKind.DEAD:  # the caller has part of the answer: it cannot be taken back
                    raise ShardDiedError(shard, f"lost mid-stream after {sent} tokens: {getattr(error, 'detail', error)}")
                if cause is MoveCause.DRAINED:  # not started: sent again, uncounted
                    continue
                avoid = await self._next_try(attempts, error, kind, shard, deadline)
