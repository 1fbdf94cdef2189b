"""What a shard's forkserver imports before it forks the EngineCore (``nemo_gen.shard.engine_start``).

These are the modules a spawned EngineCore would import after its start (seconds of every
launch and restart: bench/results/2026-12-03/h200.md). On a GPU this is no more than a bare
``vllm.LLM`` has imported when it forks its EngineCore, and nothing here initialises CUDA (a
forked child could not use it: should a later vLLM do so, the server exits and the
EngineCore is spawned); tests/gpu runs with EngineCores forked after this preload
(docs/gpu.md). The CPU worker's module is imported too: that is safe there and saves its import.

It never fails. A module that cannot be imported here is imported by the EngineCore itself,
which is what happens under spawn, and the reason is logged.
"""

from __future__ import annotations

import importlib
import logging
import sys

log = logging.getLogger(__name__)

try:
    importlib.import_module("vllm.v1.engine.core")
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        importlib.import_module("vllm.v1.worker.cpu_worker")
except Exception as exc:  # noqa: BLE001 — see the module doc: never fail the server
    log.warning("the forkserver could not preload vLLM (the EngineCore will import it): %s", exc)

_torch = sys.modules.get("torch")
if _torch is not None and _torch.cuda.is_initialized():
    # A forked child could not use CUDA. The server exits before it forks anything; the shard
    # then finds no server and spawns its EngineCore (engine_start.engine_core_context).
    log.error("importing vLLM initialised CUDA in the shard's forkserver: the server exits, the EngineCore is spawned")
    raise SystemExit(3)  # out of the server's preload, before its loop: it forks nothing
