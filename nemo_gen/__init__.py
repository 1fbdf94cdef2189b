"""nemo_gen: a fleet of vLLM generation engines on Ray — launch, generate, refit, recover —
usable from Python, the ``nemo-gen`` CLI, or Prefect flows.

Importing this package changes no environment variable and starts nothing; the heavy names
below are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "GenerationFleet": "nemo_gen.fleet.fleet",
    "NemoGenSettings": "nemo_gen.settings",
    "GenerationResult": "nemo_gen.core.results",
    "FleetExhausted": "nemo_gen.errors",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # pragma: no cover
    from nemo_gen.core.results import GenerationResult as GenerationResult  # re-exported
    from nemo_gen.errors import FleetExhausted as FleetExhausted  # re-exported
    from nemo_gen.fleet.fleet import GenerationFleet as GenerationFleet  # re-exported
    from nemo_gen.settings import NemoGenSettings as NemoGenSettings  # re-exported


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nemo_gen' has no attribute {name!r}")
