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

VLLM_BACKEND = "vllm"
SGLANG_BACKEND = "sglang"
MEGATRON_BACKEND = "megatron"
DYNAMO_BACKEND = "dynamo"
TRTLLM_BACKEND = "trtllm"

# NeMo-RL backends that nemo_gen knows by name but does not implement.
NEMO_RL_ONLY_BACKENDS: frozenset[str] = frozenset(
    {SGLANG_BACKEND, MEGATRON_BACKEND, DYNAMO_BACKEND, TRTLLM_BACKEND}
)

# Refit transports that send XOR/overwrite deltas against the weights vLLM loaded from
# disk at start-up, so the engine must start from the real checkpoint (load_format="auto").
VLLM_SPARSE_REFIT_TRANSPORTS: frozenset[str] = frozenset({"vllm_s3_sparse", "vllm_zmq_sparse"})

# speculative_config.method values whose drafter is the policy's own MTP layer. Its weights
# are loaded from disk after start (or arrive in the policy refit stream), so these methods
# can start from dummy weights; any other drafter (Eagle, draft_model, ...) cannot.
MTP_SPECULATIVE_METHODS: frozenset[str] = frozenset({"deepseek_mtp", "mtp"})
