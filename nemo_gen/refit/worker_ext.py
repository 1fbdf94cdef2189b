"""Methods mixed into every vLLM worker (``worker_extension_cls``) for refit.

Only metadata crosses ``collective_rpc`` (vLLM mangles tensors passed as RPC arguments); the
bytes are read from the shared-memory staging file named in the call, as zero-copy views.
Method names carry a ``nemo_gen_`` prefix so they never shadow vLLM's own weight-transfer
methods (``init_weight_transfer_engine``, ``update_weights``, ...).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

Entry = tuple[str, tuple[int, ...], str, int]  # name, shape, dtype, byte offset


def open_staged(path: str, total: int, entries: list[Entry]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) views over the staging file; no copy until the model loads them."""
    import torch

    from nemo_gen.refit.views import typed_view

    buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    for name, shape, dtype, offset in entries:
        yield name, typed_view(buf, offset, shape, dtype)


def hf_manifest(hf_config: Any, dtype: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint-layout names and shapes of a model, from its config alone (meta tensors:
    nothing is allocated). Floating tensors are expected in the engine's dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    out = {}
    for name, t in model.state_dict().items():
        dt = dtype if t.is_floating_point() else t.dtype
        out[name] = (tuple(t.shape), str(dt).removeprefix("torch."))
    return out


def split_stacked(model: Any, names: list[str]) -> list[str]:
    """Stacked layers (``packed_modules_mapping``: q/k/v -> qkv_proj, gate/up -> gate_up_proj) that
    ``names`` cover only in part. Such a layer is one tensor in the engine; reloading it needs all
    of its parts (the others would be left uninitialized: on CPU the old ones live only in the
    kernel's packed copy), so a refit must carry all of them or none."""
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    staged = set(names)
    problems = set()
    for name in staged:
        head, _, tail = name.rpartition(".")  # tail: weight / bias
        parent, _, leaf = head.rpartition(".")
        for stacked, parts in mapping.items():
            missing = [f"{parent}.{p}.{tail}" for p in parts if f"{parent}.{p}.{tail}" not in staged]
            if leaf in parts and missing:
                problems.add(f"{parent}.{stacked} lacks {', '.join(missing)}")
    return sorted(problems)


class NemoGenWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def _drafter(self):
        """The speculative drafter with its model: vLLM's V1 model runner (CPU) keeps it as
        ``drafter``, its V2 runner (CUDA) as ``speculator``; None without a draft model."""
        for attr in ("drafter", "speculator"):
            drafter = getattr(self.model_runner, attr, None)
            if drafter is not None and getattr(drafter, "model", None) is not None:
                return drafter
        return None

    def _shared_with_policy(self) -> list[str]:
        return shared_with_policy(self._drafter().model, self.model_runner.get_model())

    def nemo_gen_expected_manifest(self, target: str = "policy") -> dict[str, Any]:
        """What a refit of ``target`` ("policy" or "draft") must provide: names, shapes, dtypes,
        which names may be left out (tied output embeddings), and which drafter names are the
        policy's own tensors (accepted, never written)."""
        shared: list[str] = []
        if target == "draft":
            drafter = self._drafter()
            if drafter is None:
                return {"tensors": {}, "optional": [], "shared": [], "available": False}
            cfg = drafter.speculative_config.draft_model_config
            shared = self._shared_with_policy()
        else:
            cfg = self.model_runner.model_config
        hf = cfg.hf_config
        optional = ["lm_head.weight"] if getattr(hf, "tie_word_embeddings", False) else []
        return {"tensors": hf_manifest(hf, cfg.dtype), "optional": optional + shared, "shared": shared, "available": True}

    def nemo_gen_digest(self, target: str = "policy") -> float:
        """A cheap fingerprint of the loaded weights (sum of every parameter, in float64), so tests
        and operators can tell which weights a model holds without moving them."""
        import torch

        model = self._drafter().model if target == "draft" else self.model_runner.get_model()
        with torch.no_grad():
            return float(sum(p.detach().double().sum().item() for p in model.parameters()))

    def nemo_gen_check_staged(self, path: str, total: int, entries: list[Entry]) -> int:
        """Phase 1: the staged bytes are readable here; returns the byte count seen."""
        import os

        size = os.path.getsize(path)
        if size < total:
            raise ValueError(f"staging file {path} holds {size} bytes, the refit needs {total}")
        seen = 0
        for _, tensor in open_staged(path, total, entries):
            seen += tensor.numel() * tensor.element_size()
        split = split_stacked(self.model_runner.get_model(), [e[0] for e in entries])
        if split:
            raise ValueError(
                "the refit splits stacked layers (their parts load as one tensor, which a reload "
                f"rewrites whole): {'; '.join(split)}"
            )
        return seen

    def nemo_gen_load_staged(self, path: str, total: int, entries: list[Entry], target: str = "policy") -> int:
        """Phase 2: load the staged tensors into the model (or the drafter) in place, through
        ``WeightLoad`` (the direct path, or vLLM's layerwise reload for models it does not handle)."""
        weights = open_staged(path, total, entries)
        model, model_config = self._model_and_config(target)
        if target == "draft":
            shared = set(self._shared_with_policy())
            weights = ((n, t) for n, t in weights if n not in shared)
        load = WeightLoad(model, self.vllm_config, model_config, _scratch_pool(self))
        load.begin()
        load.load(weights)
        load.finish()
        self.nemo_gen_last_load = load.path
        self.nemo_gen_last_load_stats = load.stats
        if target != "draft":  # what the runner's reload_weights does after loading
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                getattr(self.model_runner, reset, lambda: None)()
        return len(entries)

    def nemo_gen_weight_update(self, update_info: dict[str, Any], target: str = "policy") -> float:
        """vLLM's start_weight_update (or start_draft_weight_update) -> update_weights ->
        finish_weight_update here, in one RPC: a one-chunk refit costs one round trip into the
        engine instead of three (a round trip is milliseconds; a colocated refit's copy can be
        less). The same worker methods, so the same checks and backends. Returns its seconds."""
        t0 = time.perf_counter()
        if target == "draft":
            self.start_draft_weight_update()
        else:
            self.start_weight_update()
        try:
            self.update_weights(update_info)
        except BaseException:
            # vLLM has ended the worker's session; the backend's own load must end too (a
            # layerwise reload puts its layers back). The weights may be half-loaded: the fleet
            # quarantines this shard.
            with contextlib.suppress(Exception):
                self.weight_transfer_engine.finish_weight_update()
                self.weight_transfer_engine.reset_weight_update_target()
            raise
        self.finish_weight_update()
        return time.perf_counter() - t0

    def _model_and_config(self, target: str):
        """(model, its ModelConfig) for ``target``: the policy, or the speculative drafter."""
        if target == "draft":
            return self._drafter().model, self.vllm_config.speculative_config.draft_model_config
        return self.model_runner.get_model(), self.model_runner.model_config

    def nemo_gen_load_stats(self) -> dict[str, Any]:
        """How the last load went here (a staged refit, or one through the weight-transfer
        engine): path, seconds, the kernel repack's share."""
        engine = getattr(self, "weight_transfer_engine", None)
        candidates = [getattr(self, "nemo_gen_last_load_stats", {}), getattr(engine, "last_stats", {})]
        return max(candidates, key=lambda st: st.get("finished_at", 0.0))

    def nemo_gen_set_load_path(self, path: str | None) -> str:
        """Diagnostics: make later refits here take ``"reload_weights"``, or ``"auto"`` (the direct
        path where the model qualifies); None: back to what the environment says. Returns the
        path a policy refit takes now."""
        global _LOAD_PATH_OVERRIDE
        if path not in (None, "auto", "reload_weights"):
            raise ValueError(f"unknown load path {path!r}: use 'auto', 'reload_weights' or None")
        _LOAD_PATH_OVERRIDE = path
        return self.nemo_gen_load_path()

    def nemo_gen_load_path(self, target: str = "policy") -> str:
        """Which path a refit of ``target`` takes here: "direct" or "reload_weights" (and why)."""
        model, model_config = self._model_and_config(target)
        reason = WeightLoad.why_not_direct(model, self.vllm_config, model_config)
        return "direct" if reason is None else f"reload_weights: {reason}"


def shared_with_policy(drafter: Any, policy: Any) -> list[str]:
    """Checkpoint names of drafter tensors that are the policy's own storage (EAGLE-style
    drafters share embed_tokens / lm_head): a draft refit must never write through them."""
    policy_ptrs = {p.data_ptr() for p in policy.parameters()}
    shared = []
    for name, module_path in (("model.embed_tokens.weight", "model.embed_tokens"), ("lm_head.weight", "lm_head")):
        try:
            param = drafter.get_submodule(module_path).weight
        except AttributeError:
            continue
        if param.data_ptr() in policy_ptrs:
            shared.append(name)
    return shared


class WeightLoad:
    """One in-place load of checkpoint-format weights into a running model, in vLLM's
    begin / load (one or more batches) / finish shape.

    The direct path (``DirectLoad``) when every module of the model is one it handles; vLLM's
    layerwise reload otherwise (``initialize_layerwise_reload`` ... ``finalize_layerwise_reload``,
    what ``reload_weights`` does in one call): the CPU backend repacks linear weights after
    loading, and only those two paths redo that step."""

    def __init__(self, model: Any, vllm_config: Any, model_config: Any, pool: "ScratchPool",
                 plan: "CopyPlan | None" = None):
        """``plan``: the last recorded load of this engine; while it still describes ``model``
        (the same parameters), its classification of the modules is reused instead of redone
        (~0.1 ms a module: milliseconds per refit of a large model)."""
        self.model, self.model_config, self.pool = model, model_config, pool
        t0 = time.perf_counter()
        # the plan this load may replay: checked here, once per load (the parameters cannot
        # move between here and the load: the engine is held for the refit)
        forced = _forced_reload()
        self.plan = plan if plan is not None and not forced and plan.describes(model) else None
        if forced:
            self.direct = None
        elif self.plan is not None:
            self.direct = DirectLoad(model, model_config, self.plan.kinds)
        else:
            self.direct = DirectLoad.for_model(model, vllm_config, model_config)
        self._prepare_s = time.perf_counter() - t0  # classifying the model's modules (stats)
        self.path = "direct" if self.direct is not None else "reload_weights"
        self._begun = False
        self._t0 = 0.0
        self._load_s = 0.0  # in the loaders (or the replay) only: begin..finish also spans RPCs
        self.stats: dict[str, Any] = {}

    @staticmethod
    def why_not_direct(model: Any, vllm_config: Any, model_config: Any) -> str | None:
        if _forced_reload():
            if _LOAD_PATH_OVERRIDE is not None:
                return "nemo_gen_set_load_path('reload_weights')"
            return f"{FORCE_RELOAD_ENV}=reload_weights"
        return DirectLoad.why_not(model, vllm_config, model_config)

    def begin(self) -> None:
        if self.direct is None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
        self._begun = True
        self._t0 = time.perf_counter()

    def load(self, weights, record: bool = False) -> "CopyPlan | None":
        """Load a batch of (name, tensor). On the direct path a repacked layer must arrive whole
        within one batch (its parts are one kernel tensor). ``record``: also return the load as a
        ``CopyPlan`` when it was nothing but copies out of ``weights`` (a list, kept by the caller
        with the plan) into the model's parameters; None otherwise."""
        if not self._begun:
            raise RuntimeError("WeightLoad.load before begin")
        import torch

        t0 = time.perf_counter()
        try:
            if self.direct is not None:
                return self.direct.load(weights, self.pool, record=record)
            with torch.no_grad():
                self.model.load_weights(weights)
            return None
        finally:
            self._load_s += time.perf_counter() - t0

    def replays(self, weights: Any) -> bool:
        """``weights`` are the very tensors the plan given at construction was recorded from."""
        return self.plan is not None and self.plan.weights is weights

    def replay(self) -> None:
        """Load what the plan recorded, from the same source tensors (now holding new values)."""
        if not self._begun:
            raise RuntimeError("WeightLoad.replay before begin")
        if self.plan is None:
            raise RuntimeError("no copy plan that still describes this model")
        t0 = time.perf_counter()
        self.direct.replay(self.plan)
        self._load_s += time.perf_counter() - t0

    def finish(self) -> None:
        if self.direct is None and self._begun:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
        self._begun = False
        # repack_s: what the CPU kernel's repacking took (direct path only): no refit of this
        # engine can be faster, whatever the transport (bench/refit.py reports it)
        self.stats = {"path": self.path, "seconds": time.perf_counter() - self._t0,
                      "load_s": self._load_s, "prepare_s": self._prepare_s,
                      "repack_s": self.direct.repack_s if self.direct is not None else None,
                      "plan": self.direct.plan_note if self.direct is not None else None,
                      "finished_at": time.time()}


# A diagnostic override, set in the engine's environment (generation.vllm_cfg.env_vars): load
# every refit through vLLM's reload_weights, as before the direct path existed. bench/refit.py
# uses it to measure both paths on one machine.
FORCE_RELOAD_ENV = "NEMO_GEN_REFIT_LOAD"


# The same override at run time, per worker process (``nemo_gen_set_load_path``): benchmarks
# compare both paths on one running engine. None: the environment decides.
_LOAD_PATH_OVERRIDE: str | None = None


def _forced_reload() -> bool:
    import os

    if _LOAD_PATH_OVERRIDE is not None:
        return _LOAD_PATH_OVERRIDE == "reload_weights"
    return os.environ.get(FORCE_RELOAD_ENV) == "reload_weights"


def _scratch_pool(worker: Any) -> ScratchPool:
    pool = getattr(worker, "_nemo_gen_scratch", None)
    if pool is None:
        pool = worker._nemo_gen_scratch = ScratchPool()
    return pool


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


def _storage_ptr(t: Any) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (meta, sparse, a functional wrapper)
        return None


def _param_ptrs(model: Any) -> tuple[int | None, ...]:
    return tuple(_storage_ptr(p) for p in model.parameters())


def _param_slots(model: Any) -> list[tuple[Any, str, Any, int]]:
    """(module, name, parameter, where its data is) for every parameter of ``model``."""
    return [(module, name, p, p.data_ptr())
            for module in model.modules() for name, p in module._parameters.items() if p is not None]


class CopyPlan:
    """The copies one load made: (destination view in a parameter, source view in an incoming
    tensor) pairs, the constants it filled parameters with, and the layers it wrote. A trainer
    refits the same tensors over and over (an optimizer writes in place; ``nemo_gen_ipc``'s views
    of them are the same list while the layout is); replaying the plan loads the new values with
    one batched copy instead of the model's per-tensor loaders (name mapping, stacking,
    narrowing: ~100 us of Python a tensor).

    Valid only for the very list it was recorded from and while every parameter keeps its
    storage (vLLM's reload writes back in place, CUDA graphs rely on it; anything else fails
    ``replays`` and the next load records afresh)."""

    def __init__(self, weights: list, model: Any, copies: list[tuple[Any, Any]], fills: list[tuple[Any, Any]],
                 touched: list, kinds: dict):
        self.weights, self.model = weights, model
        self.dsts = [d for d, _ in copies]
        self.srcs = [s for _, s in copies]
        self.fills = fills  # (view of a parameter, constant), in the order the loaders wrote them
        self.touched = touched
        self.kinds = kinds  # DirectLoad's classification of the model's modules, as recorded
        self._slots = _param_slots(model)  # every parameter, and where its data was, as the load left them

    def describes(self, model: Any) -> bool:
        """``model`` is the one recorded, every parameter still the same object, its data where it
        was. Checked through the recorded modules' own parameter dicts: walking the model again
        (``model.parameters()``) costs ~10x as much, a millisecond per refit of a large model."""
        return model is self.model and all(
            module._parameters.get(name) is p and p.data_ptr() == ptr for module, name, p, ptr in self._slots)

    def replays(self, weights: Any, model: Any) -> bool:
        return weights is self.weights and self.describes(model)


class CopyRecorder:
    """Watches one load at the dispatcher (a ``TorchDispatchMode``, like vLLM's ``CopyCounter``):
    every ``copy_`` out of the incoming tensors into a parameter is recorded; any other write
    to a parameter, or a copy of incoming bytes anywhere else (a temporary the loader
    transforms), makes the load not replayable."""

    def __init__(self, weights: list, model: Any):
        self.weights, self.model = weights, model
        self.sources = {_storage_ptr(t) for _, t in weights} - {None}
        self.params = set(_param_ptrs(model)) - {None}
        self.copies: list[tuple[Any, Any]] = []
        self.fills: list[tuple[Any, Any]] = []
        self.why_not: str | None = None
        self._mode = _recording_mode(self)

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def see(self, func: Any, args: tuple, kwargs: dict) -> None:
        import torch

        if self.why_not is not None:
            return
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            into, out_of = _storage_ptr(dst) in self.params, _storage_ptr(src) in self.sources
            if into and out_of and tuple(dst.shape) == tuple(src.shape):
                self.copies.append((dst, src))
            elif into or out_of:
                self.why_not = f"a copy {tuple(src.shape)} -> {tuple(dst.shape)} not from an incoming tensor into a parameter"
            return
        if func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default) and _storage_ptr(args[0]) in self.params:
            # a constant into part of a parameter (vLLM's embedding loader zeroes the vocabulary's padding)
            if args[0].numel():
                self.fills.append((args[0], args[1] if len(args) > 1 else 0))
            return
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor) and _storage_ptr(t) in self.params:
                    self.why_not = f"{func} writes a parameter"
                    return

    def plan(self, touched: list, kinds: dict) -> CopyPlan | None:
        if self.why_not is not None or not self.copies:
            return None
        return CopyPlan(self.weights, self.model, self.copies, self.fills, list(touched), kinds)


def _recording_mode(recorder: CopyRecorder):
    """A dispatch mode that shows every op to ``recorder`` (torch is imported only when used)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordingMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            recorder.see(func, args, kwargs)
            return func(*args, **kwargs)

    return RecordingMode()

