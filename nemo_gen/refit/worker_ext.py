"""Methods mixed into every vLLM worker (``worker_extension_cls``) for refit.

Only metadata crosses ``collective_rpc`` (vLLM mangles tensors passed as RPC arguments); the
bytes are read from the shared-memory staging file named in the call, as zero-copy views.
Method names carry a ``nemo_gen_`` prefix so they never shadow vLLM's own weight-transfer
methods (``init_weight_transfer_engine``, ``update_weights``, ...).
"""

from __future__ import annotations

from typing import Any, Iterator

Entry = tuple[str, tuple[int, ...], str, int]  # name, shape, dtype, byte offset


def open_staged(path: str, total: int, entries: list[Entry]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) views over the staging file; no copy until the model loads them."""
    import torch

    buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    for name, shape, dtype, offset in entries:
        dt = getattr(torch, dtype)
        nbytes = _numel(shape) * torch.empty((), dtype=dt).element_size()
        yield name, buf[offset : offset + nbytes].view(dt).view(tuple(shape))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


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


class NemoGenWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def _drafter(self):
        drafter = getattr(self.model_runner, "drafter", None)
        return drafter if drafter is not None and getattr(drafter, "model", None) is not None else None

    def _shared_with_policy(self) -> list[str]:
        """Checkpoint names of drafter tensors that are the policy's own storage (EAGLE-style
        drafters share embed_tokens / lm_head): a draft refit must never write through them."""
        drafter, policy = self._drafter(), self.model_runner.get_model()
        policy_ptrs = {p.data_ptr() for p in policy.parameters()}
        shared = []
        for name, module_path in (("model.embed_tokens.weight", "model.embed_tokens"), ("lm_head.weight", "lm_head")):
            try:
                param = drafter.model.get_submodule(module_path).weight
            except AttributeError:
                continue
            if param.data_ptr() in policy_ptrs:
                shared.append(name)
        return shared

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
        return seen

    def nemo_gen_load_staged(self, path: str, total: int, entries: list[Entry], target: str = "policy") -> int:
        """Phase 2: load the staged tensors into the model (or the drafter) in place.

        ``reload_weights`` rather than ``model.load_weights``: the CPU backend repacks linear
        weights after loading, and only the reload path redoes that step."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        weights = open_staged(path, total, entries)
        if target == "draft":
            drafter = self._drafter()
            shared = set(self._shared_with_policy())
            weights = ((n, t) for n, t in weights if n not in shared)
            config = drafter._create_draft_vllm_config() if hasattr(drafter, "_create_draft_vllm_config") else drafter.vllm_config
            reload_weights(config, drafter.model, weights, None, True)
        else:
            self.model_runner.reload_weights(weights_iterator=weights)
        return len(entries)
