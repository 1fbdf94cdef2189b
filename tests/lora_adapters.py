"""PEFT LoRA adapters for the tiny model, written by hand (no ``peft`` in the environment):
``adapter_config.json`` plus ``adapter_model.safetensors`` with PEFT's tensor names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

PREFIX = "base_model.model."
# The tiny Llama's linear layers, (in, out) as multiples of the model's sizes.
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def module_dims(hidden: int = 128, intermediate: int = 256) -> dict[str, tuple[int, int]]:
    """leaf -> (in_features, out_features) of the tiny model (2 heads of 64: q/k/v are hidden wide)."""
    dims = {leaf: (hidden, hidden) for leaf in _ATTN}
    dims.update(gate_proj=(hidden, intermediate), up_proj=(hidden, intermediate), down_proj=(intermediate, hidden))
    return dims


def adapter_tensors(rank: int = 8, targets=("q_proj", "v_proj"), seed: int = 0, layers: int = 2,
                    scale: float = 0.2, dims: dict[str, tuple[int, int]] | None = None) -> dict[str, torch.Tensor]:
    """PEFT-named lora_A (rank, in) / lora_B (out, rank) tensors; B is nonzero so the adapter
    changes greedy tokens (a freshly initialised PEFT adapter has B = 0 and changes nothing)."""
    g = torch.Generator().manual_seed(seed)
    dims = dims or module_dims()
    out = {}
    for layer in range(layers):
        for leaf in targets:
            part = "self_attn" if leaf in _ATTN else "mlp"
            d_in, d_out = dims[leaf]
            name = f"{PREFIX}model.layers.{layer}.{part}.{leaf}"
            out[f"{name}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * scale
            out[f"{name}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * scale
    return out


def adapter_config(base: str | Path, rank: int = 8, targets=("q_proj", "v_proj"), alpha: int | None = None) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
            "target_modules": list(targets), "base_model_name_or_path": str(base), "bias": "none",
            "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "modules_to_save": None}


def write_adapter(path: str | Path, base: str | Path, rank: int = 8, targets=("q_proj", "v_proj"), seed: int = 0,
                  tensors: dict[str, torch.Tensor] | None = None, config: dict | None = None) -> Path:
    """A PEFT adapter directory at ``path``; returns it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(rank, targets, seed) if tensors is None else tensors
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(config or adapter_config(base, rank, targets)))
    return path
