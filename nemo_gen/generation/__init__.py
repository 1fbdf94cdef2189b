"""The generation API of NeMo-RL's ``nemo_rl.models.generation``, re-created for nemo_gen.

This package owns the steps a driver takes between reading its settings and launching
engines:

- ``maybe_configure_engine_reaping_env``: let the raylet reap an orphaned EngineCore
  (call before Ray starts);
- ``configure_generation_config``: fill in and cross-check the ``generation`` config once
  the tokenizer exists;
- ``resolve_generation_class``: map ``generation.backend`` to its ``GenerationInterface``
  class, importing the backend only then;
- ``draft_full_refit_enabled``: the policy-side fact ``configure_generation_config`` needs
  about drafter refit.

Importing it changes no environment variable and imports neither torch, transformers,
vLLM, Ray nor Prefect: ``TokenizerType`` is resolved on first access and backends on
first resolution. The config and backend contracts live in ``interfaces``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nemo_gen.core.generation_config import (
    VLLM_BACKEND,
    check_backend,
    configure_generation_config,
    draft_full_refit_enabled,
)
from nemo_gen.environment import maybe_configure_engine_reaping_env
from nemo_gen.generation.interfaces import GenerationConfig, GenerationInterface

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as TokenizerType

__all__ = [
    "TokenizerType",
    "configure_generation_config",
    "draft_full_refit_enabled",
    "maybe_configure_engine_reaping_env",
    "resolve_generation_class",
]

# Backend name -> "module:Class". Adding a backend is one line here (and its name in
# nemo_gen.core.generation_config.IMPLEMENTED_BACKENDS); its module is imported only when a
# config selects it.
_BACKEND_CLASSES: dict[str, str] = {
    VLLM_BACKEND: "nemo_gen.generation.vllm:VllmGeneration",
}


def __getattr__(name: str) -> Any:
    # TokenizerType is transformers' PreTrainedTokenizerBase, imported on first access so
    # that importing this package does not pull in transformers (and through it torch).
    if name == "TokenizerType":
        from transformers import PreTrainedTokenizerBase

        globals()["TokenizerType"] = PreTrainedTokenizerBase
        return PreTrainedTokenizerBase
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"TokenizerType"})


def resolve_generation_class(
    generation_config: GenerationConfig | Mapping[str, Any],
) -> type[GenerationInterface]:
    """Map ``generation_config`` to its ``GenerationInterface`` class.

    The backend's module is imported here, not at package import, so selecting vLLM is
    what loads vLLM.

    Raises:
        ConfigError: (a ``ValueError``) ``generation.backend`` is missing, names one of
            NeMo-RL's backends that nemo_gen does not implement, or is unknown.
        ImportError: the backend's registered class cannot be found.
    """
    backend = check_backend(generation_config, _BACKEND_CLASSES)
    target = _BACKEND_CLASSES[backend]
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, GenerationInterface)):
        raise ImportError(
            f"generation backend {backend!r} is registered as {target!r}, but "
            f"{module_name} has no GenerationInterface subclass named {class_name}"
        )
    return cls
