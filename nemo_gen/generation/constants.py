"""Names that generation configs are matched against: backends, refit transports, MTP methods.

Only ``VLLM_BACKEND`` is implemented by nemo_gen. The other backend names are here so that a
NeMo-RL config naming one of them is recognised and refused with a clear message (see
``nemo_gen.generation.resolve_generation_class``) instead of being reported as a typo.
"""

from __future__ import annotations

__all__ = [
    "DYNAMO_BACKEND",
    "MEGATRON_BACKEND",
    "MTP_SPECULATIVE_METHODS",
    "NEMO_RL_ONLY_BACKENDS",
    "SGLANG_BACKEND",
    "TRTLLM_BACKEND",
    "VLLM_BACKEND",
    "VLLM_SPARSE_REFIT_TRANSPORTS",
]

from nemo_gen.core.generation_config import (  # noqa: E402  (one home: the core rules)
    DYNAMO_BACKEND,
    MEGATRON_BACKEND,
    MTP_SPECULATIVE_METHODS,
    NEMO_RL_ONLY_BACKENDS,
    SGLANG_BACKEND,
    TRTLLM_BACKEND,
    VLLM_BACKEND,
    VLLM_SPARSE_REFIT_TRANSPORTS,
)
