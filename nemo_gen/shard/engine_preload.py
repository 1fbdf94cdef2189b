"""What a shard's forkserver imports before it forks the EngineCore (``nemo_gen.shard.engine_start``).

These are the modules a spawned EngineCore would import after its start (~11 s on a 2-core
CPU machine, ~21 s with CUDA's libraries on the H200). On a GPU this is no more than a bare
``vllm.LLM`` has imported when it forks its EngineCore, and nothing here initialises CUDA (a
forked child could not use it: should a later vLLM do so, the server exits and the
EngineCore is spawned). On the H200 with vLLM 0.32 every test of tests/gpu passed with
EngineCores forked after this preload (2026-12-03). The CPU worker's module is imported too:
that is safe there and saves its ~0.6 s.

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
