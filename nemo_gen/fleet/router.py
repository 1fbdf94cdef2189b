"""Requests in, results out: prompts tokenized on the driver, least-loaded routing over the
serving shards, and re-routing of whatever a lost shard held.

Prompts are tokenized once, on the driver, so a too-long prompt is answered with an error
before it costs a round trip. A shard that dies (or is condemned by its probes, or misses
``fleet.request_timeout_s``) while it holds requests: they are sent again to the serving
shards and whatever it might still answer is dropped, so every prompt gets exactly one
result. The batch path (``generate``) and the per-request awaitable (``generate_async``)
share one rule for "this call is lost" (``_lost``) and one way to condemn (``_condemn``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Sequence

from nemo_gen.core.fleet_health import SERVING_STATES, GenerationFleetHealth, HealthyShardSelector
from nemo_gen.core.members import Member
from nemo_gen.core.retry import describe
from nemo_gen.core.results import GenerationRequest, GenerationResult, too_long_error
from nemo_gen.errors import RequestError, ShardDiedError, ShardUnavailableError
from nemo_gen.fleet.driver import Call, ShardDriver
from nemo_gen.fleet.members import Membership

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]
# How often a waiting generate call looks at the ledger (a shard condemned meanwhile).
_POLL_S = 0.1


class Router:
    def __init__(self, health: GenerationFleetHealth, members: Membership, driver: ShardDriver, tokenizer: Any,
                 max_model_len: int, decode_text: bool, request_timeout_s: float,
                 serving_version: Callable[[], int | None], on_lost: Callable[[Member, str], None], fleet_name: str):
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
            elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
                req = GenerationRequest(index=i, prompt_token_ids=list(prompt), prompt=None)
            else:
                raise RequestError(f"prompt {i} must be a string or a list of token ids", index=i)
            error = too_long_error(len(req.prompt_token_ids), self.max_model_len) if self.max_model_len else None
            if error:
                rejected[i] = GenerationResult.failed(req, error)
            else:
                requests.append(req)
        return requests, rejected

    def result(self, req: GenerationRequest, raw: dict[str, Any], shard: int, version: int | None) -> GenerationResult:
        if raw.get("error"):
            return GenerationResult.failed(req, raw["error"], shard=shard)
        text = raw.get("text")
        if not text and raw["token_ids"] and self._decode_text:
            text = self.tokenizer.decode(raw["token_ids"], skip_special_tokens=True)
        return GenerationResult(
            index=req.index, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids), text=text or "",
            token_ids=raw["token_ids"], logprobs=raw["logprobs"], finish_reason=raw["finish_reason"],
            shard=shard, weight_version=version,
        )

    # -- routing ---------------------------------------------------------------------------------

    def _pick(self) -> int:
        if self._version() is None:
            raise ShardUnavailableError(
                f"fleet {self._fleet_name!r} runs in fleet.mode=train and has not been refit "
                "yet: its engines hold dummy weights and serve nothing until the first refit"
            )
        try:
            shard = self.selector.next_shard()
        except ShardUnavailableError:
            self.health.raise_if_exhausted()
            raise
        self.selector.acquire(shard)
        return shard

    def _assign(self, requests: list[GenerationRequest]) -> dict[int, list[GenerationRequest]]:
        """Least-loaded routing, one request at a time, so a batch spreads over the shards."""
        assignment: dict[int, list[GenerationRequest]] = {}
        try:
            for req in requests:
                assignment.setdefault(self._pick(), []).append(req)
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

    def generate(self, prompts: Sequence[Prompt], params: dict[str, Any]) -> list[GenerationResult]:
        requests, results = self.requests(prompts)
        pending = requests
        while pending:
            assignment = self._assign(pending)
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
            finally:
                self._release(assignment)
        return [results[i] for i in range(len(prompts))]

    # -- the per-request path --------------------------------------------------------------------

    async def generate_async(self, prompt: Prompt, params: dict[str, Any]) -> GenerationResult:
        requests, rejected = self.requests([prompt])
        if rejected:
            return rejected[0]
        req = requests[0]
        while True:
            shard = self._pick()
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
                continue
            finally:
                self.selector.release(shard)
            if out is None:
                continue  # the shard was condemned while it held the request: ask another
            self.health.report_success(shard)
            return self.result(req, out["results"][0], out["shard"], out["weight_version"])

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
