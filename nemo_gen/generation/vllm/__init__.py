"""The vLLM backend: ``VllmGeneration``, the class ``resolve_generation_class`` returns for
``backend: vllm``."""

from nemo_gen.generation.vllm.vllm_generation import VllmGeneration

__all__ = ["VllmGeneration"]
