"""Record-and-replay of a direct load: the copies one load made from a trainer's tensors into the
model's parameters, kept so the next refit of the same tensors is one batched copy.
"""

from __future__ import annotations

from typing import Any


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
