"""LoRA adapters inside a vLLM worker (mixed into ``NemoGenWorkerExtension``), and the one
place the engine's requests are given their adapter.

vLLM loads an adapter when a request first names its id, from ``LoRARequest.lora_path`` on
disk. nemo_gen loads it ahead of any request instead, from tensors the driver staged in shared
memory (a PEFT directory's or a trainer's live ones: no disk on the live path): the worker
builds vLLM's own ``LoRAModel`` from them (``LoRAModel.from_lora_tensors``, what vLLM's loader
calls after reading the files) and registers it with the runner's LoRA manager under the fresh
engine id the fleet chose. Requests then name that id with a path that does not exist
(``PLACEHOLDER_ROOT``): vLLM never reloads an id it holds, and should it ever need to (the id
was dropped), the load fails loudly instead of reading some other version from disk.
"""

from __future__ import annotations

from typing import Any

# Never a directory: an adapter the engine lost cannot be reloaded from here (module doc).
PLACEHOLDER_ROOT = "/nonexistent/nemo-gen-adapter"
# Where a request's adapter rides in its SamplingParams.extra_args: (engine name, engine id).
EXTRA_KEY = "nemo_gen_adapter"


def lora_request_of(params: Any, engine: Any) -> Any:
    """The ``LoRARequest`` a request's params name (``EXTRA_KEY``), or None: the base model.
    An adapter ``engine`` does not hold now (a replacement shard, or new base weights since it
    was loaded: vLLM dropped it) is a ``RequestError`` for that request alone: vLLM would try to
    load it from the placeholder path inside an engine step, which is no request's error but the
    engine's."""
    chosen = (params.extra_args or {}).get(EXTRA_KEY)
    if not chosen:
        return None
    from vllm.lora.request import LoRARequest

    from nemo_gen.errors import RequestError

    name, engine_id = chosen
    held, at_version = getattr(engine, "adapters_held", (frozenset(), None))
    if engine_id not in held or at_version != engine.version:
        raise RequestError(f"adapter {name} is not loaded on this shard's engine; refit it again")
    return LoRARequest(lora_name=name, lora_int_id=int(engine_id), lora_path=f"{PLACEHOLDER_ROOT}/{name}")


def _expected_modules(adapter_manager: Any) -> set[str]:
    """Module leaves vLLM accepts in an adapter (what its own loader expects)."""
    packed = adapter_manager.packed_modules_mapping
    out: set[str] = set()
    for module in adapter_manager.supported_lora_modules:
        out.update(packed.get(module, [module]))
    return out


class LoraWorkerMixin:
    """``self`` is a vLLM worker started with ``enable_lora``."""

    def _lora_manager(self):
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            raise ValueError("the engine was started without LoRA (generation.vllm_cfg.lora.enabled)")
        return manager

    def _lora_models(self):
        """The runner's LoRA model manager: its registry of built adapters, which the worker's
        manager keeps private (vLLM has no public call that registers a built ``LoRAModel``)."""
        manager = self._lora_manager()
        return manager._adapter_manager

    def nemo_gen_lora_modules(self) -> dict[str, Any]:
        """What this engine can take: the module leaves it can adapt, its max rank and slots."""
        manager, am = self._lora_manager(), self._lora_models()
        return {"supported": sorted(_expected_modules(am)), "max_rank": manager.lora_config.max_lora_rank,
                "capacity": am.capacity, "held": sorted(manager.list_adapters())}

    def nemo_gen_load_adapter(self, path: str, total: int, entries: list, config: dict[str, Any],
                              engine_id: int, evict: list[int]) -> list[int]:
        """Build the adapter from the staged tensors and register it under ``engine_id`` after
        removing ``evict``; returns the ids held afterwards. The adapter is built and checked
        before anything is removed: a bad one changes nothing."""
        import torch
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        from nemo_gen.vllm_ext.views import typed_view

        manager, am = self._lora_manager(), self._lora_models()
        if engine_id in manager.list_adapters():
            raise ValueError(f"engine id {engine_id} is loaded already: an id is never reused")
        # Copies: the staging file is rewritten by the next load.
        buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        tensors = {name: typed_view(buf, offset, shape, dtype).clone() for name, shape, dtype, offset in entries}
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        expected = _expected_modules(am)
        model = am.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        unexpected = sorted({n for n in tensors if n.rpartition(".lora_")[0].rpartition(".")[2] not in expected})
        if unexpected:
            raise ValueError(f"tensors for modules the engine cannot adapt: {unexpected[:4]}")
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=engine_id, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        for old in evict:
            manager.remove_adapter(old)
        if len(am) >= am.capacity:
            raise ValueError(f"no free adapter slot ({len(am)} of {am.capacity} held): the fleet's bound was not kept")
        am.add_adapter(lora)
        return sorted(manager.list_adapters())

    def nemo_gen_remove_adapters(self, engine_ids: list[int]) -> list[int]:
        manager = self._lora_manager()
        for engine_id in engine_ids:
            manager.remove_adapter(engine_id)
        return sorted(manager.list_adapters())
