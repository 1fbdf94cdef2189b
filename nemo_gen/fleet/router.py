"""Requests in, results out: prompts tokenized on the driver, least-loaded routing over the
serving shards, and re-routing of whatever a lost shard held.

Prompts are tokenized once, on the driver, so a too-long prompt is answered with an error
before it costs a round trip. A shard that dies (or is condemned by its probes, or misses
``fleet.request_timeout_s``) while it holds requests: they are sent again to the serving
shards and whatever it might still answer is dropped, so every prompt gets exactly one
result. The batch path (``generate``), the per-request awaitable (``generate_async``) and the
stream (``generate_stream``) share one rule for "this call is lost" (``_lost``) and one way to
condemn (``_condemn``). A stream is re-routed the same way until its first token has been
handed to the caller; after that, a lost shard ends it with ``ShardDiedError`` naming the shard.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from nemo_gen.core.fleet_health import SERVING_STATES, GenerationFleetHealth, HealthyShardSelector
from nemo_gen.core.members import Member
from nemo_gen.core.retry import describe
from nemo_gen.core.results import Delta, GenerationRequest, GenerationResult, Sample, too_long_error
from nemo_gen.errors import RequestError, ShardDiedError, ShardUnavailableError
from nemo_gen.fleet.driver import Call, ShardDriver, Stream
from nemo_gen.fleet.members import Membership

log = logging.getLogger(__name__)

# A string, token ids, or chat messages ({"role": ..., "content": ...}, rendered here).
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]
# How often a waiting generate call looks at the ledger (a shard condemned meanwhile).
_POLL_S = 0.1
# Sessions remembered (least recently used forgotten first): enough for every live agent.
_SESSIONS = 100_000
_LOST = object()  # a stream's shard was condemned or replaced while it streamed


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) and all(
        isinstance(m, Mapping) for m in prompt)


class Router:
    def __init__(self, health: GenerationFleetHealth, members: Membership, driver: ShardDriver, tokenizer: Any,
                 max_model_len: int, decode_text: bool, request_timeout_s: float,
                 serving_version: Callable[[], int | None], on_lost: Callable[[Member, str], None], fleet_name: str,
                 session_slack: int):
        self.health = health
        self.selector = HealthyShardSelector(health)
        self.members = members
        self.driver = driver
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._decode_text = decode_text  # engines without a tokenizer: text is decoded here
        self.request_timeout_s = request_timeout_s
        self._version = serving_version
        self._on_lost = on_lost
        self._fleet_name = fleet_name
        # session id -> the slot that served its last turn (its prompt's KV is cached there).
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._session_lock = threading.Lock()
        self._session_slack = session_slack
        self.rerouted = 0  # requests sent again after their shard was lost (a metric)

    # -- requests and results -------------------------------------------------------------------

    def requests(self, prompts: Sequence[Prompt]) -> tuple[list[GenerationRequest], dict[int, GenerationResult]]:
        """Tokenize on the driver; too-long prompts become error results right away."""
        if isinstance(prompts, (str, bytes)):
            raise RequestError("prompts must be a list of strings or token-id lists, not one string")
        requests, rejected = [], {}
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
                req = GenerationRequest(index=i, prompt_token_ids=list(ids), prompt=prompt)
            elif _is_chat(prompt):
                req = self._chat(i, prompt)
                if isinstance(req, GenerationResult):
                    rejected[i] = req
                    continue
            elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
                req = GenerationRequest(index=i, prompt_token_ids=list(prompt), prompt=None)
            else:
                raise RequestError(
                    f"prompt {i} must be a string, a list of token ids or a list of chat messages", index=i)
            error = too_long_error(len(req.prompt_token_ids), self.max_model_len) if self.max_model_len else None
            if error:
                rejected[i] = GenerationResult.failed(req, error)
            else:
                requests.append(req)
        return requests, rejected

    def _chat(self, i: int, messages: Sequence[Mapping[str, Any]]) -> GenerationRequest | GenerationResult:
        """Chat messages rendered with the tokenizer's chat template (a generation prompt added)."""
        for m in messages:
            if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise RequestError(f"prompt {i}: a chat message needs a string 'role' and 'content', got {dict(m)!r}",
                                   index=i)
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if not getattr(self.tokenizer, "chat_template", None):
            return GenerationResult.failed(
                GenerationRequest(index=i, prompt_token_ids=[]),
                "RequestError: this prompt is a chat, but the tokenizer (model.tokenizer, or the model's own) "
                "has no chat template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes the special tokens itself: the text is not tokenized with them again.
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return GenerationRequest(index=i, prompt_token_ids=list(ids), prompt=text)

    def result(self, req: GenerationRequest, raw: dict[str, Any], shard: int, version: int | None) -> GenerationResult:
        if raw.get("error"):
            return GenerationResult.failed(req, raw["error"], shard=shard)
        samples = [self._sample(s, version) for s in raw.get("samples") or [raw]]
        first = samples[0]
        return GenerationResult(
            index=req.index, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids), text=first.text,
            token_ids=first.token_ids, logprobs=first.logprobs, finish_reason=first.finish_reason, shard=shard,
            weight_version=first.weight_versions[-1][0] if first.weight_versions else version,
            weight_versions=first.weight_versions, samples=samples,
        )

    def _sample(self, raw: dict[str, Any], version: int | None) -> Sample:
        text = raw.get("text")
        if not text and raw["token_ids"] and self._decode_text:
            text = self.tokenizer.decode(raw["token_ids"], skip_special_tokens=True)
        spans = [(v, n) for v, n in raw.get("weight_versions") or [(version, len(raw["token_ids"]))]]
        return Sample(text=text or "", token_ids=raw["token_ids"], logprobs=raw["logprobs"],
                      finish_reason=raw["finish_reason"], weight_versions=spans)

    # -- routing ---------------------------------------------------------------------------------

    def _try_pick(self, waited_since: float) -> int | None:
        """A serving shard, acquired; None when none serves now but a recovery under way may
        bring one back (a spare being promoted, a restart) and the request has time to wait."""
        if self._version() is None:
            raise ShardUnavailableError(
                f"fleet {self._fleet_name!r} runs in fleet.mode=train and has not been refit "
                "yet: its engines hold dummy weights and serve nothing until the first refit"
            )
        try:
            shard = self.selector.next_shard()
        except ShardUnavailableError:
            if self.members.recovering() and time.monotonic() - waited_since < self.request_timeout_s:
                return None
            self.health.raise_if_exhausted()
            raise
        self.selector.acquire(shard)
        return shard

    def _affine(self, session: str | None) -> int | None:
        """The slot that served ``session``'s last turn, acquired, while it serves and carries at
        most ``fleet.session_affinity_slack`` more requests than the least-loaded one; else None."""
        if session is None:
            return None
        with self._session_lock:
            slot = self._sessions.get(session)
        if slot is None or self.health.state_of(slot) not in SERVING_STATES or not self.members.has_slot(slot):
            return None
        try:
            least = self.selector.next_shard()
        except ShardUnavailableError:
            return None
        if self.selector.inflight(slot) > self.selector.inflight(least) + self._session_slack:
            return None  # too busy: the session moves
        self.selector.acquire(slot)
        return slot

    def _remember(self, session: str | None, slot: int) -> None:
        if session is not None:
            with self._session_lock:
                self._sessions[session] = slot
                self._sessions.move_to_end(session)
                while len(self._sessions) > _SESSIONS:
                    self._sessions.popitem(last=False)

    def session_shard(self, session: str) -> int | None:
        """The slot that served ``session``'s last turn (None: new or forgotten)."""
        with self._session_lock:
            return self._sessions.get(session)

    def _pick(self, session: str | None = None) -> int:
        since = time.monotonic()
        shard = self._affine(session)
        while shard is None and (shard := self._try_pick(since)) is None:
            time.sleep(_POLL_S)
        self._remember(session, shard)
        return shard

    async def _pick_async(self, session: str | None = None) -> int:
        since = time.monotonic()
        shard = self._affine(session)
        while shard is None and (shard := self._try_pick(since)) is None:
            await asyncio.sleep(_POLL_S)
        self._remember(session, shard)
        return shard

    def _assign(self, requests: list[GenerationRequest], sessions: Mapping[int, str | None]
                ) -> dict[int, list[GenerationRequest]]:
        """Least-loaded routing, one request at a time, so a batch spreads over the shards; a
        request of a session goes to its shard (``_affine``)."""
        assignment: dict[int, list[GenerationRequest]] = {}
        try:
            for req in requests:
                assignment.setdefault(self._pick(sessions.get(req.index)), []).append(req)
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
        """A call on the shard failed for an infra reason: a dead actor or engine is certain,
        not a streak — straight to DEAD (and recovery, when on)."""
        log.warning("shard %d failed: %s; re-routing its requests", member.slot, why)
        self._on_lost(member, describe(why).splitlines()[0])

    def _timeout(self) -> TimeoutError:
        return TimeoutError(f"no answer within fleet.request_timeout_s={self.request_timeout_s:g}s")

    # -- the batch path --------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], params: dict[str, Any],
                 session_id: str | Sequence[str | None] | None = None) -> list[GenerationResult]:
        """``session_id``: one for the whole batch, or one (or None) per prompt."""
        requests, results = self.requests(prompts)
        sessions = _sessions_of(session_id, len(prompts))
        pending = requests
        while pending:
            assignment = self._assign(pending, sessions)
            inflight: dict[Call, tuple[Member, list[GenerationRequest], float]] = {}
            for shard, batch in assignment.items():
                handle = self.members.handle(shard)
                call = self.driver.start_generate(handle, batch, params)
                inflight[call] = (Member(handle.name, shard), batch, time.monotonic() + self.request_timeout_s)
            pending = []
            try:
                while inflight:
                    for call in self.driver.wait(inflight, _POLL_S):
                        member, batch, _ = inflight.pop(call)
                        try:
                            out = self.driver.result(call)
                        except ShardDiedError as exc:  # the shard or its engine is gone: re-route
                            self._condemn(member, exc)
                            pending.extend(batch)
                            self.rerouted += len(batch)
                            continue
                        self.health.report_success(member.slot)
                        for req, raw in zip(batch, out["results"]):
                            results[req.index] = self.result(req, raw, out["shard"], out["weight_version"])
                    now = time.monotonic()
                    for call, (member, batch, deadline) in list(inflight.items()):
                        lost = self._lost(member)
                        if lost or now > deadline:  # condemned meanwhile, or wedged: answer elsewhere
                            del inflight[call]
                            self.driver.cancel(call)
                            if not lost:
                                self._condemn(member, self._timeout())
                            pending.extend(batch)
                            self.rerouted += len(batch)
            finally:
                self._release(assignment)
        return [results[i] for i in range(len(prompts))]

    # -- the per-request path --------------------------------------------------------------------

    async def generate_async(self, prompt: Prompt, params: dict[str, Any],
                             session_id: str | None = None) -> GenerationResult:
        requests, rejected = self.requests([prompt])
        if rejected:
            return rejected[0]
        req = requests[0]
        while True:
            shard = await self._pick_async(session_id)
            handle = self.members.handle(shard)
            member = Member(handle.name, shard)
            try:
                future = self.driver.generate_async(handle, [req], params)
                out = await self._await(future, member)
            except Exception as exc:
                error = self.driver.classify(handle, exc, "generate")
                if not isinstance(error, ShardDiedError):  # the request's own fault: the caller's to see
                    raise error from None
                self._condemn(member, error)
                self.rerouted += 1
                continue
            finally:
                self.selector.release(shard)
            if out is None:
                self.rerouted += 1
                continue  # the shard was condemned while it held the request: ask another
            self.health.report_success(shard)
            return self.result(req, out["results"][0], out["shard"], out["weight_version"])

    # -- the stream ----------------------------------------------------------------------------

    async def generate_stream(self, prompt: Prompt, params: dict[str, Any], session_id: str | None = None
                              ) -> AsyncIterator[Delta | GenerationResult]:
        """``generate_async`` as it is generated: ``Delta``s as the shard's engine makes tokens,
        then the ``GenerationResult`` (what ``generate_async`` returns). A shard lost before the
        first delta was handed out: the request goes to another, unseen. Lost after: the stream
        ends with ``ShardDiedError`` naming the shard and the tokens it had sent — never a
        silently short answer. Closing the iterator early cancels the request on its shard."""
        requests, rejected = self.requests([prompt])
        if rejected:
            yield rejected[0]
            return
        req = requests[0]
        while True:
            shard = await self._pick_async(session_id)
            handle = self.members.handle(shard)
            member, stream, sent, started, finished = Member(handle.name, shard), None, 0, False, False
            texts: dict[int, _Decoded] = {}
            try:
                stream = self.driver.generate_stream(handle, req, params)
                deadline = time.monotonic() + self.request_timeout_s
                while (item := await self._next_item(stream, member, deadline)) is not _LOST:
                    if item is None or "result" in item:
                        finished = True
                        if item is None:
                            raise ShardDiedError(shard, "the stream ended without a result")
                        self.health.report_success(shard)
                        yield self.result(req, item["result"], item["shard"], item["weight_version"])
                        return
                    for raw in item["deltas"]:
                        delta = self._delta(raw, shard, texts)
                        sent += len(delta.token_ids)
                        started = True
                        yield delta
                why = ShardDiedError(shard, "condemned while it streamed")
            except Exception as exc:
                why = self.driver.classify(handle, exc, "generate_stream")
                if not isinstance(why, ShardDiedError):  # the request's own fault: the caller's to see
                    raise why from None
                self._condemn(member, why)
            finally:
                self.selector.release(shard)
                if stream is not None and not finished:
                    stream.cancel()
            if started:  # the caller has part of the answer: it cannot be taken back
                raise ShardDiedError(shard, f"lost mid-stream after {sent} tokens: {why.detail}")
            self.rerouted += 1

    def _delta(self, raw: dict[str, Any], shard: int, texts: dict[int, "_Decoded"]) -> Delta:
        text = texts.setdefault(raw["sample"], _Decoded(self.tokenizer if self._decode_text else None))
        return Delta(sample=raw["sample"], token_ids=list(raw["token_ids"]), text=text.add(raw),
                     logprobs=list(raw["logprobs"]), weight_versions=[(v, n) for v, n in raw["weight_versions"]],
                     finish_reason=raw["finish_reason"], shard=shard)

    async def _next_item(self, stream: Stream, member: Member, deadline: float) -> Any:
        """The stream's next item (None after its last); ``_LOST`` when its shard was lost
        meanwhile; TimeoutError past the deadline."""
        task = asyncio.ensure_future(stream.next())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_POLL_S)
                if done:
                    return task.result()
                if self._lost(member):
                    return _LOST
                if time.monotonic() > deadline:
                    raise self._timeout()
        finally:
            if not task.done():
                task.cancel()

    async def _await(self, future: "asyncio.Future", member: Member) -> dict[str, Any] | None:
        """The call's answer; None when its shard was lost meanwhile; TimeoutError at the deadline."""
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            done, _ = await asyncio.wait({future}, timeout=_POLL_S)
            if done:
                return future.result()
            if self._lost(member):
                future.cancel()
                return None
            if time.monotonic() > deadline:
                future.cancel()
                raise self._timeout()


class _Decoded:
    """A streamed sample's text piece by piece: the engine's own, or — engines without a
    tokenizer — decoded here from all its tokens so far, the new part handed out (a partial
    character at the end waits for the token that completes it; the last delta gets the rest)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def add(self, raw: dict[str, Any]) -> str:
        if self.tokenizer is None:
            self.sent += raw["text"]
            return raw["text"]
        self.ids += raw["token_ids"]
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if raw["finish_reason"] is None:
            text = text.rstrip("\ufffd")
        if not text.startswith(self.sent):  # decoded differently with more context: wait for the end
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


def _sessions_of(session_id: str | Sequence[str | None] | None, n: int) -> dict[int, str | None]:
    if session_id is None or isinstance(session_id, str):
        return {i: session_id for i in range(n)}
    if len(session_id) != n:
        raise RequestError(f"session_id has {len(session_id)} entries for {n} prompts (give one, or one per prompt)")
    return dict(enumerate(session_id))
