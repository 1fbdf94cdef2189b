"""What a shard's rules need of its engine (``EngineLike``): exactly the calls ``Shard``
(``nemo_gen.shard.rules``) makes, no more. ``nemo_gen.shard.engine.Engine`` (one vLLM
engine) is one; the fake tier's ``FakeEngine`` (``tests/fakes.py``) is another, so the fast
tests run the real rules over an engine that dies, hangs or slows down on command.
"""

from __future__ import annotations

from typing import Any, AsyncContextManager, AsyncGenerator, Protocol

from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.wire import InFlight, RequestProgress, RequestResult, Sampling, StepGaps, StreamDeltas, Unfinished


class EngineLike(Protocol):
    """A started engine, as a shard uses it. Every generated token is counted under the weight
    version that sampled it. A drain refit holds the engine (``exclusive``, or ``hold``/``release``)
    and changes the version with ``set_version``; an in-flight one (``keep``/``abort``) swaps the
    weights under running requests between ``begin_swap`` and ``end_swap``."""

    # -- what the shard reports about it ---------------------------------------------------------
    # (read-only: an engine that always knows them, or a fake that may not, both fit)
    @property
    def max_model_len(self) -> int | None: ...

    @property
    def dtype(self) -> str | None: ...

    @property
    def load_s(self) -> float | None: ...

    @property
    def generating(self) -> bool: ...  # a batch is running now

    @property
    def steps_made(self) -> int: ...  # that batch's steps so far

    def child_pids(self) -> list[int]: ...

    # its EngineCore's exit code once ended (negative: the killing signal), waiting up to wait_s;
    # None while it runs, or when no process of it is known
    async def core_exit(self, wait_s: float) -> int | None: ...

    # -- generation ------------------------------------------------------------------------------
    async def generate(self, requests: list[GenerationRequest], sampling: Sampling) -> list[RequestResult]: ...

    # ``StreamDeltas`` items, then the request's ``RequestResult``
    def stream(self, req: GenerationRequest, sampling: Sampling) -> AsyncGenerator[StreamDeltas | RequestResult, None]: ...

    # its running keyed requests' tokens past what the driver knows (key -> tokens known): fleet.migration
    def progress(self, known: dict[str, int]) -> tuple[RequestProgress, ...]: ...

    async def probe(self, sampling: Sampling, token_ids: list[int], stall_s: float,
                    warmup_s: float) -> dict[str, Any]: ...

    # -- weights: control RPCs to the workers, and how requests meet a change ----------------------
    async def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]: ...

    def exclusive(self) -> AsyncContextManager[None]: ...  # drain: running requests finish first

    async def hold(self) -> None: ...  # drain, for a session driven call by call

    async def release(self) -> None: ...

    async def set_version(self, version: int | None) -> None: ...  # serve ``version`` from now on

    @property
    def version(self) -> int | None: ...  # the weight version it serves

    # LoRA adapter ids held and the weight version they were loaded on (``nemo_gen.shard.adapters``)
    adapters_held: tuple[frozenset[int], int | None]

    async def begin_swap(self) -> None: ...  # keep / abort: freeze the running batch

    async def end_swap(self, version: int | None, in_flight: InFlight, failed: str | None = None) -> None: ...

    # -- vLLM's sleep mode (the colocated layout; the shard drained its requests first) --------------
    async def sleep(self, level: int) -> None: ...  # reset the prefix cache, then sleep at ``level``

    async def wake(self, tags: list[str]) -> None: ...  # bring ``tags`` ("weights", "kv_cache") back

    async def reset_prefix_cache(self) -> bool: ...  # False: vLLM could not (requests were running)

    # -- the rest --------------------------------------------------------------------------------
    def vllm_metrics(self) -> list[dict[str, Any]]: ...

    def unfinished(self) -> Unfinished: ...

    def step_gaps(self, reset: bool) -> StepGaps: ...

    def shutdown(self, grace_s: float) -> None: ...
