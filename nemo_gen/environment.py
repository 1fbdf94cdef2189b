"""Process environment that must be in place before Ray starts.

The raylet reads ``RAY_process_group_cleanup_enabled`` once, at its own start, and Ray snapshots
the driver environment for the workers it forks: so this runs first in every entry point (the
pipeline's first task, ``GenerationFleet.launch``), never at import.
"""

from __future__ import annotations

import logging
import os

from nemo_gen.generation import maybe_configure_engine_reaping_env
from nemo_gen.settings import NemoGenSettings

log = logging.getLogger(__name__)

REAPING_FLAG = "RAY_process_group_cleanup_enabled"

# Ray phones home and dedups worker logs by default; neither helps a fleet operator here.
_RAY_DEFAULTS = {"RAY_USAGE_STATS_ENABLED": "0"}


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
    keys = [REAPING_FLAG, *_RAY_DEFAULTS, "RAY_AUTH_MODE"]
    return {k: os.environ[k] for k in keys if k in os.environ}
