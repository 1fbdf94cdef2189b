"""One vLLM engine inside a shard actor: ``Engine.start``, which starts the one the config names
and warms it up, as an ``EngineLike`` (``nemo_gen.shard.engine_protocol``: what a shard may ask of it).

vLLM's two engines sit behind the one protocol, as vLLM's own ``LLMEngine``/``AsyncLLM`` and
NeMo-RL's sync and async vLLM workers do: the sync ``vllm.LLM`` (best batch throughput;
``nemo_gen.shard.engine_sync``) steps one batch at a time on a worker thread, the ``AsyncLLM``
(``vllm_cfg.async_engine``; ``nemo_gen.shard.engine_async``) serves concurrent requests
natively. What they share is in ``nemo_gen.shard.engine_base``; their collaborators are the
admission gate (``gate.Gate``), the in-flight weight swap (``swap``) and the step
clock (``step_clock.StepClock``); every touch of vLLM's internals is in ``vllm_compat``.
"""

from __future__ import annotations

import time
from typing import Any

from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.stream_pace import STREAM_INTERVAL_S
from nemo_gen.core.wire import Sampling
from nemo_gen.shard import vllm_compat
from nemo_gen.shard.engine_async import AsyncEngine
from nemo_gen.shard.engine_protocol import EngineLike
from nemo_gen.shard.engine_sync import SyncEngine
from nemo_gen.shard.vllm_compat import sampling_params

__all__ = ["STREAM_INTERVAL_S", "AsyncEngine", "Engine", "EngineLike", "SyncEngine", "sampling_params"]

# One greedy token: the warm-up generation of a fresh engine.
_WARMUP = Sampling(max_new_tokens=1, temperature=0.0, ignore_eos=True)


class Engine:
    """Starts an engine: ``await Engine.start(kwargs, async_engine, version)`` gives a
    ``SyncEngine`` or an ``AsyncEngine`` (both ``EngineLike``)."""

    @staticmethod
    async def start(kwargs: dict[str, Any], async_engine: bool, version: int | None,
                    started: float | None = None) -> SyncEngine | AsyncEngine:
        """``started``: when the caller began starting it (``time.monotonic()``), if before this
        call: ``load_s`` counts from there (the shard imports vLLM before it calls this)."""
        t0 = time.monotonic() if started is None else started
        llm = await vllm_compat.build(kwargs, async_engine)
        engine = (AsyncEngine if async_engine else SyncEngine)(llm, time.monotonic() - t0, version)
        # One token before the engine counts as up: its first step (kernel selection for the
        # decode shapes) is paid here, not by the first probe, which would time out on it.
        (out,) = await engine.generate([GenerationRequest(index=0, prompt_token_ids=[1, 1])], _WARMUP)
        if out.error:
            raise RuntimeError(f"the engine's warm-up generation failed: {out.error}")
        vllm_compat.freeze_heap()
        engine.load_s = time.monotonic() - t0
        return engine
