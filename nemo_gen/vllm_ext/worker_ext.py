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

from nemo_gen.core.modes import WeightTarget
from nemo_gen.vllm_ext.copy_plan import CopyPlan
from nemo_gen.vllm_ext.direct_load import DirectLoad, ScratchPool
from nemo_gen.vllm_ext.ipc_zmq import IpcZmqWorkerMixin
from nemo_gen.vllm_ext.lora import LoraWorkerMixin

Entry = tuple[str, tuple[int, ...], str, int]  # name, shape, dtype, byte offset


def open_staged(path: str, total: int, entries: list[Entry]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) views over the staging file; no copy until the model loads them."""
    import torch

    from nemo_gen.vllm_ext.views import typed_view

    buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    for name, shape, dtype, offset in entries:
        view = typed_view(buf, offset, shape, dtype)
        if name == _FAULT_TENSOR:  # a fault drill (nemo_gen_fault_staged): this worker's copy only
            view = view.clone()
            view.view(-1).view(torch.uint8)[0] ^= 0xFF
        yield name, view


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


class NemoGenWorkerExtension(LoraWorkerMixin, IpcZmqWorkerMixin):
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

    def nemo_gen_expected_manifest(self, target: WeightTarget = WeightTarget.POLICY) -> dict[str, Any]:
        """What a refit of ``target`` must provide: names, shapes, dtypes,
        which names may be left out (tied output embeddings), and which drafter names are the
        policy's own tensors (accepted, never written)."""
        shared: list[str] = []
        if target == WeightTarget.DRAFT:
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

    def nemo_gen_digest(self, target: WeightTarget = WeightTarget.POLICY) -> float:
        """A cheap fingerprint of the loaded parameters (sum of every one, in float64): invariant
        to how the engine packs them, so tests compare it with a trainer's module. Not a proof
        of the weights: that is the content digest (``nemo_gen_weights_digest``)."""
        import torch

        model = self._drafter().model if target == WeightTarget.DRAFT else self.model_runner.get_model()
        with torch.no_grad():
            return float(sum(p.detach().double().sum().item() for p in model.parameters()))

    def nemo_gen_weights_digest(self) -> str | None:
        """The content digest (``nemo_gen.core.digest``) of the weights the last staged refit
        loaded here, computed here from the bytes loaded; None before any."""
        return getattr(self, "_nemo_gen_loaded_digest", None)

    def nemo_gen_fault_staged(self, name: str | None) -> None:
        """Fault drills: this worker reads tensor ``name`` of later staged refits with its first
        byte flipped, as a transport that corrupted its copy would (None: no more)."""
        global _FAULT_TENSOR
        _FAULT_TENSOR = name

    def nemo_gen_check_staged(self, path: str, total: int, entries: list[Entry], digests: list[int] = ()) -> int:
        """Phase 1: the staged bytes are readable here and, given the trainer's ``digests`` (one
        per entry), are the trainer's: a mismatch raises, naming the first tensor that differs,
        and nothing is loaded. Returns the byte count seen."""
        import os

        from nemo_gen.core.digest import WeightDigest, first_mismatch
        from nemo_gen.vllm_ext.digest import tensor_digests

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
        self._nemo_gen_checked_digest = None
        if digests:
            names = [e[0] for e in entries]
            got = tensor_digests(t for _, t in open_staged(path, total, entries))
            problem = first_mismatch(names, list(digests), got)
            if problem:
                raise ValueError(problem)
            self._nemo_gen_checked_digest = WeightDigest(tuple(names), tuple(got)).digest
        return seen

    def nemo_gen_load_staged(self, path: str, total: int, entries: list[Entry], target: WeightTarget = WeightTarget.POLICY) -> int:
        """Phase 2: load the staged tensors into the model (or the drafter) in place, through
        ``WeightLoad`` (the direct path, or vLLM's layerwise reload for models it does not handle)."""
        weights = open_staged(path, total, entries)
        model, model_config = self._model_and_config(target)
        if target == WeightTarget.DRAFT:
            shared = set(self._shared_with_policy())
            weights = ((n, t) for n, t in weights if n not in shared)
        load = WeightLoad(model, self.vllm_config, model_config, _scratch_pool(self))
        load.begin()
        load.load(weights)
        load.finish()
        self.nemo_gen_last_load = load.path
        self.nemo_gen_last_load_stats = load.stats
        self._nemo_gen_loaded_digest = getattr(self, "_nemo_gen_checked_digest", None)
        if target != WeightTarget.DRAFT:  # what the runner's reload_weights does after loading
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                getattr(self.model_runner, reset, lambda: None)()
        return len(entries)

    def nemo_gen_weight_update(self, update_info: dict[str, Any], target: WeightTarget = WeightTarget.POLICY) -> float:
        """vLLM's start_weight_update (or start_draft_weight_update) -> update_weights ->
        finish_weight_update here, in one RPC: a one-chunk refit costs one round trip into the
        engine instead of three (a round trip is milliseconds; a colocated refit's copy can be
        less). The same worker methods, so the same checks and backends. Returns its seconds."""
        t0 = time.perf_counter()
        if target == WeightTarget.DRAFT:
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

    def nemo_gen_weight_load(self, target: WeightTarget = WeightTarget.POLICY) -> "WeightLoad":
        """A ``WeightLoad`` into ``target`` (the policy, or the drafter), for a refit path to drive."""
        model, model_config = self._model_and_config(target)
        return WeightLoad(model, self.vllm_config, model_config, _scratch_pool(self))

    def _model_and_config(self, target: WeightTarget):
        """(model, its ModelConfig) for ``target``: the policy, or the speculative drafter."""
        if target == WeightTarget.DRAFT:
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

    def nemo_gen_load_path(self, target: WeightTarget = WeightTarget.POLICY) -> str:
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

        from nemo_gen.vllm_ext.fp8 import dequantized, has_fp8

        # fp8 tensors with their scales (refit.quantize: trainer) load as the model's dtype;
        # vLLM's FP8 engine re-quantizes them as it does any load. A list is checked first, so
        # the copy plan is recorded only from the very tensors the model holds.
        if not isinstance(weights, list) or has_fp8(weights):
            weights, record = dequantized(weights, self.model_config.dtype), False
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


# A fault drill, per worker process (``nemo_gen_fault_staged``): the staged tensor this worker
# reads corrupted. None: none.
_FAULT_TENSOR: str | None = None


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
