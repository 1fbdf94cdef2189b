"""The direct refit path: checkpoint-format weights written straight into a running model's
parameters (and the CPU kernel's repacking redone per complete layer), instead of vLLM's layerwise
reload. Owns the reused scratch buffers and the worker's malloc tuning the path relies on; the
record-and-replay of a load lives in ``nemo_gen.vllm_ext.copy_plan``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from nemo_gen.vllm_ext.copy_plan import CopyPlan, CopyRecorder


class ScratchPool:
    """Reused byte buffers for weights that exist only until the CPU kernel has packed them.
    Kept across refits: their pages are touched once, not on every refit."""

    def __init__(self):
        self._free: list[Any] = []

    def take(self, nbytes: int):
        import torch

        fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf) -> None:
        self._free.append(buf)


_MALLOC_TUNED = False


def _keep_freed_pages() -> None:
    """Let glibc serve large allocations from its heap and keep freed pages there, in this worker.

    Each refit, oneDNN allocates a fresh packed buffer per linear layer and frees the old one;
    with glibc's defaults every such buffer is a new mmap whose pages fault on first touch (~2x
    the cost of the repacking itself here). Kept in the heap, the next layer's buffer reuses the
    pages the previous one freed. This is what vLLM's recommended CPU allocator (tcmalloc, via
    LD_PRELOAD) does anyway; the cost is that the worker's freed memory is cached, not returned."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return
    _MALLOC_TUNED = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 256 << 20)
        libc.mallopt(m_trim_threshold, 1 << 30)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


class DirectLoad:
    """Load checkpoint-format weights into a running CPU or CUDA model without vLLM's layerwise
    reload.

    vLLM's ``reload_weights`` puts every layer back on the meta device, materializes fresh
    tensors, loads into them, repacks, and copies the result back into the kernel tensors. On
    CPU most of that is needless: norms and embeddings keep their checkpoint format, so the
    model's own ``load_weights`` (names merged by each parameter's ``weight_loader``) can write
    straight into them; only linear layers, whose weight the CPU backend repacks into a oneDNN
    handle and drops, need a full-size tensor to load into (a reused scratch buffer) and their
    ``process_weights_after_loading`` re-run, once the layer is complete. On CUDA, unquantized
    layers keep their checkpoint format and their post-processing is a no-op: every weight is
    one copy, in place (the addresses CUDA graphs captured stay valid), instead of a fresh
    materialized layer plus a copy back per layer.

    Used only when every module with weights is one of those kinds (unquantized linear /
    embedding methods, plain modules with no post-processing, attention layers without weights),
    with no LoRA and no quantization; otherwise ``for_model`` returns None and the caller uses
    ``reload_weights``."""

    def __init__(self, model: Any, model_config: Any, kinds: dict):
        self.model, self.model_config, self.kinds = model, model_config, kinds
        self.repack_s = 0.0  # time in the CPU kernel's weight repacking (one DirectLoad per load)
        self.plan_note: str | None = None  # what became of a recorded load (stats)

    def _repack(self, module) -> None:
        t0 = time.perf_counter()
        module.quant_method.process_weights_after_loading(module)
        self.repack_s += time.perf_counter() - t0

    @classmethod
    def for_model(cls, model: Any, vllm_config: Any, model_config: Any = None) -> DirectLoad | None:
        """``model_config``: the loaded model's own (a drafter's differs from the policy's);
        default ``vllm_config.model_config``."""
        model_config = model_config or vllm_config.model_config
        kinds = cls._kinds(model, vllm_config, model_config)
        return None if isinstance(kinds, str) else cls(model, model_config, kinds)

    @classmethod
    def why_not(cls, model: Any, vllm_config: Any, model_config: Any = None) -> str | None:
        kinds = cls._kinds(model, vllm_config, model_config or vllm_config.model_config)
        return kinds if isinstance(kinds, str) else None

    @staticmethod
    def _kinds(model: Any, vllm_config: Any, model_config: Any) -> dict | str:
        """module -> "packed" | "processed" | "plain" | "attention", or why the model is not eligible."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.quantization.base_config import (
            QuantizeMethodBase,
        )
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
        )
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.platforms import current_platform

        if not (current_platform.is_cpu() or current_platform.is_cuda()):
            return "not a CPU or CUDA engine"
        if vllm_config.lora_config is not None:
            return "LoRA is enabled"
        if model_config.quantization is not None:
            return f"quantization {model_config.quantization}"
        if callable(getattr(model, "process_weights_after_loading", None)):
            return f"{type(model).__name__} post-processes its weights as a whole"
        kinds: dict = {}
        for name, module in model.named_modules():
            params = {n for n, p in module._parameters.items() if p is not None}
            method = getattr(module, "quant_method", None)
            if is_deferred_attention_layer(module):
                if params:
                    return f"attention layer {name} holds weights ({sorted(params)})"
                kinds[module] = "attention"
            elif isinstance(method, QuantizeMethodBase):
                if type(method) not in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
                    return f"{name} uses {type(method).__name__}"
                if not params <= {"weight", "bias"}:
                    return f"{name} holds {sorted(params)}"
                weight = module.weight
                meta = (LAYERWISE_INFO[module].restore_metadata[0] if module in LAYERWISE_INFO else {}).get("weight")
                if meta is None:
                    return f"no load-time metadata recorded for {name}"
                if weight.numel() == 0:
                    kinds[module] = "packed"  # the kernel holds the weight; the parameter is empty
                elif tuple(weight.shape) == tuple(meta.shape) and weight.dtype == meta.dtype:
                    kinds[module] = "processed"  # weight kept in checkpoint format, kernel rebuilt from it
                else:
                    return f"{name}.weight is {tuple(weight.shape)} {weight.dtype} in kernel format"
            elif params:
                if callable(getattr(module, "process_weights_after_loading", None)):
                    return f"{name} ({type(module).__name__}) post-processes its weights"
                kinds[module] = "plain"
        return kinds

    def load(self, weights, pool: ScratchPool, record: bool = False) -> "CopyPlan | None":
        """Load ``weights`` ((name, tensor) in checkpoint format) through the model's own
        ``load_weights``. Raises when a repacked layer is only partly covered: its other rows
        live only in the kernel's packed copy and cannot be kept. ``record`` (a model with no
        repacked layer, ``weights`` a list): returns the load as a ``CopyPlan`` if it was only
        copies out of those tensors into parameters."""
        import torch
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import CopyCounter
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
        from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            _keep_freed_pages()
        wrapped: list[tuple[Any, bool, Any]] = []  # (param, had a loader attribute, its loader)
        packed: dict = {}  # module -> {"kernel": param, "buf": scratch, "todo": {param name: numel}}
        touched: list = []

        def finish(module) -> None:
            state = packed.pop(module)
            self._repack(module)
            if hasattr(module, "update_param_tp_status"):
                module.update_param_tp_status()
            if module.weight.numel() == 0:  # repacked and dropped, as when the engine loaded
                module.register_parameter("weight", state["kernel"])
            else:  # kept by the kernel (a fallback GEMM): it must own its bytes
                module.register_parameter("weight", torch.nn.Parameter(module.weight.data.clone(), requires_grad=False))
            pool.give(state["buf"])

        def wrap(module, pname: str, param) -> None:
            had = hasattr(param, "weight_loader")  # a property on vLLM's parameter classes
            original = getattr(param, "weight_loader", default_weight_loader)
            while getattr(original, "__name__", "") == "online_process_loader":
                # left on the recorded metadata by an earlier vLLM reload (it wraps in place)
                original = original.__wrapped__

            def loader(p, loaded_weight, *args, **kwargs):
                state = packed.get(module)
                if state is not None and pname == "weight" and state["buf"] is None:
                    # the layer's first weight arrives: give its stand-in real (reused) bytes
                    state["buf"] = pool.take(p.numel() * p.element_size())
                    p.data = state["buf"][: p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                with CopyCounter() as counter:
                    ret = original(p, loaded_weight, *args, **kwargs)
                if module not in touched:
                    touched.append(module)
                if state is not None and pname in state["todo"]:
                    state["todo"][pname] -= min(counter.copied_numel, get_tensor_load_numel(p))
                    if all(left <= 0 for left in state["todo"].values()):
                        finish(module)
                return ret

            param.weight_loader = loader
            wrapped.append((param, had, original))

        try:
            for module, kind in self.kinds.items():
                if kind == "packed":
                    # A stand-in with the checkpoint-format shape and the loader attributes the
                    # engine recorded at load time; no memory until its first weight arrives.
                    meta = LAYERWISE_INFO[module].restore_metadata[0]["weight"]
                    temp = torch.zeros(1, dtype=meta.dtype).expand(meta.shape)
                    temp.__class__ = meta.__class__
                    temp.__dict__ = meta.__dict__.copy()
                    restore_layer_refs(temp, module)
                    packed[module] = {"kernel": module.weight, "buf": None, "todo": {}}
                    module.register_parameter("weight", temp)
                    packed[module]["todo"] = {
                        n: get_tensor_load_numel(p) for n, p in module._parameters.items() if p is not None
                    }
                if kind in ("packed", "processed", "plain"):
                    for pname, param in module._parameters.items():
                        if param is not None:
                            wrap(module, pname, param)
            recorder = None
            if record and not packed and isinstance(weights, list):
                recorder = CopyRecorder(weights, self.model)
            with torch.no_grad():
                with recorder if recorder is not None else contextlib.nullcontext():
                    self.model.load_weights(weights)
                partial = [m for m in packed if m in touched]
                if partial:
                    names = {m: n for n, m in self.model.named_modules()}
                    raise RuntimeError(
                        "a refit covered only part of the repacked layer(s) "
                        f"{[names.get(m, type(m).__name__) for m in partial]}; the rest of their weights "
                        "exist only in the CPU kernel's packed copy and cannot be kept: send whole layers"
                    )
                self._after_load(touched)
            if recorder is None:
                return None
            plan = recorder.plan(touched, self.kinds)
            self.plan_note = "recorded" if plan is not None else f"not replayable: {recorder.why_not or 'no copy seen'}"
            return plan
        finally:
            for param, had, original in reversed(wrapped):  # a tied parameter is wrapped twice
                if had:
                    param.weight_loader = original
                else:
                    try:
                        del param.weight_loader
                    except AttributeError:
                        pass
            for module, state in list(packed.items()):  # untouched (or failed) layers: as they were
                module.register_parameter("weight", state["kernel"])
                if state["buf"] is not None:
                    pool.give(state["buf"])
            packed.clear()

    def _after_load(self, touched: list) -> None:
        """What follows the loaders: re-run the post-processing of the layers a load wrote."""
        for module in touched:
            if self.kinds[module] == "processed":
                self._repack(module)
                if hasattr(module, "update_param_tp_status"):
                    module.update_param_tp_status()
        if touched:
            for module, kind in self.kinds.items():
                if kind == "attention":  # as vLLM's reload does for every attention layer
                    module.process_weights_after_loading(self.model_config.dtype)

    def replay(self, plan: "CopyPlan") -> None:
        """The recorded copies as one batched device copy, then the same post-processing."""
        import torch

        with torch.no_grad():
            # constants first: a loader that zeroes a parameter and then copies into part of it
            # ends as recorded, and one that fills only what it did not copy (vLLM's padding) too
            for view, value in plan.fills:
                view.fill_(value)
            torch._foreach_copy_(plan.dsts, plan.srcs)
            self._after_load(plan.touched)
        self.plan_note = "replayed"
