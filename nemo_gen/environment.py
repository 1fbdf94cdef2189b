"""Process environment that must be in place before Ray starts.

The raylet reads ``RAY_process_group_cleanup_enabled`` once, at its own start, and Ray snapshots
the driver environment for the workers it forks: so this runs first in every entry point (the
pipeline's first task, ``GenerationFleet.launch``), never at import.
"""

from __future__ import annotations

import logging
import os

from nemo_gen.core.engine_args import REAPING_FLAG
from nemo_gen.settings import NemoGenSettings

log = logging.getLogger(__name__)
# The NeMo-RL API's logger (``maybe_configure_engine_reaping_env`` is re-exported there).
logger = logging.getLogger("nemo_gen.generation")

# Ray phones home and dedups worker logs by default; neither helps a fleet operator here.
_RAY_DEFAULTS = {"RAY_USAGE_STATS_ENABLED": "0"}
# Every variable set here is one vllm_cfg.env_vars may not name (core.engine_args.FLEET_ENV).
SET_HERE = (REAPING_FLAG, *_RAY_DEFAULTS, "RAY_AUTH_MODE")


def maybe_configure_engine_reaping_env(enabled: bool) -> None:
    """Let the raylet reap a dead generation worker's EngineCore, on runs the driver owns.

    A vLLM generation worker spawns its EngineCore as a plain multiprocessing child --
    ``context.Process(target=EngineCoreProc.run_engine_core)``, no ``setsid``, not a
    daemon -- and that child owns the CUDA context and the KV cache. Every cleanup path
    that exists runs INSIDE the dying process, so SIGKILL defeats all of them: vLLM's
    ``weakref.finalize`` never fires, a non-daemon multiprocessing child is designed to
    outlive its parent, and Ray's default ``RAY_kill_child_processes_on_worker_exit`` is
    the worker's own exit handler. The orphan then holds its GPU for the life of the job:
    measured on 4xGB200, one SIGKILLed shard left 114.95 GiB of a 184.31 GiB device still
    held, and it did not come back across five restart attempts -- the replacement could
    not fit, so re-admission failed while the survivors carried on. Because the
    EngineCore never calls ``setsid`` it stays in the worker's process group, which is
    exactly what per-worker process-group cleanup reaches.

    **The raylet is the only reader, and this only reaches the raylet on runs where the
    driver starts it.** Ray reads ``process_group_cleanup_enabled`` in the raylet, at the
    raylet's own startup. Call this **before** Ray is initialised (``init_ray()``), like
    NeMo-RL's ``maybe_configure_data_plane_env``: on a local/single-node run ``ray.init``
    forks a raylet that inherits this environment, so it lands. On a Slurm or k8s cluster
    it does NOT: ``ray start`` has already run on every node before the driver process
    exists, and ``init_ray()`` then attaches to it with ``address="auto"``. Nothing the
    driver sets afterwards can change a raylet that is already up. Those deployments set
    the flag where the raylet is actually launched -- NeMo-RL exports
    ``RAY_process_group_cleanup_enabled`` in ``ray.sub`` -- which means it is unconditional
    there, not scoped to fleet health.

    So the gate below buys scoping on exactly one deployment shape. It is still worth
    having: a raylet-wide behaviour change should not follow from ``import nemo_gen``, and
    a run that starts no EngineCore has nothing to reap. But it is not a property of the
    flag, it is a property of who started the raylet. (Ray 2.60, which nemo_gen runs on,
    already defaults the cleanup to on; setting it keeps the behaviour when that default
    is absent or changes.)

    ``setdefault``, not assignment: an operator debugging a wedged engine may want the
    corpse, and an explicit ``RAY_process_group_cleanup_enabled=0`` stays honoured. It is
    logged as a warning when honoured, because that run will leak a killed shard's memory.

    Args:
        enabled: Whether this run can lose a generation worker and keep going. A ``bool``
            rather than the fleet-health config, so any entrypoint that builds vLLM
            generation can call it -- the leak is not specific to fleet health, it just
            takes a run that survives the loss to leave the orphan behind. Note this is
            ``fleet_health.enabled``, not ``restart_dead_shards``: any shard loss leaks
            that GPU, restarting is only what makes the loss survivable.
    """
    if not enabled:
        return
    flag = REAPING_FLAG
    existing = os.environ.get(flag)
    os.environ.setdefault(flag, "1")
    # Ray parses its boolean env settings as "1" or "true" (any case); anything else
    # disables the cleanup.
    if existing is not None and existing.strip().lower() not in ("1", "true"):
        logger.warning(
            "%s=%r is set in the environment and is honoured: the EngineCore of a killed "
            "generation worker will not be reaped and keeps its device memory",
            flag,
            existing,
        )


def configure_environment(settings: NemoGenSettings) -> dict[str, str]:
    """Set what the raylet and engines must inherit; return the variables as they now stand.

    Uses setdefault throughout: an operator's explicit value (``RAY_process_group_cleanup_enabled=0``
    to keep a dead engine for debugging) always wins.
    """
    maybe_configure_engine_reaping_env(settings.health.enabled)
    for key, value in _RAY_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if settings.ray.address is not None:
        # Ray >= 2.59 enables token auth for clusters it starts; a client naming an address
        # must opt in or it fails with InvalidAuthToken.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ.get(REAPING_FLAG) == "0":
        log.warning(
            "%s=0 is set explicitly: a killed shard's EngineCore/worker processes will be left "
            "running (and holding memory) for debugging",
            REAPING_FLAG,
        )
    return {k: os.environ[k] for k in SET_HERE if k in os.environ}
