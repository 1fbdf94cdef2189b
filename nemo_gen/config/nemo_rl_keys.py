"""NeMo-RL's keys that nemo_gen reads but does not use, each with its reason: the generation keys
nemo_gen does not implement (and which of their values ask for nothing missing), the keys it knows
by another name, and the recipe sections that belong to the trainer. ``config_loader`` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


def _any(value: Any) -> bool:
    return True


def _null(value: Any) -> bool:
    return value is None


def _off(value: Any) -> bool:
    return value is None or value is False or value == 0


@dataclass(frozen=True)
class ForeignKey:
    """A NeMo-RL key with no nemo_gen field: why, and which values ask for nothing missing."""

    reason: str
    accepts: Callable[[Any], bool] = _any
    accepted: str = "any value"


_HTTP = ("not supported yet: part of NeMo-RL's per-shard HTTP servers (nemo_gen serves the whole fleet through one "
         "OpenAI-compatible server: vllm_cfg.expose_http_server, server.*)")
_OTHER_BACKEND = "configures another NeMo-RL backend; nemo_gen implements backend=vllm"
_QUANT = ("NeMo-RL's ModelOpt quantization is not supported; vllm_cfg.precision=fp8 or "
          "vllm_kwargs.quantization select vLLM's own")

#: Dotted keys under nemo_gen's tree (``generation.…``) that NeMo-RL defines and nemo_gen does not.
NEMO_RL_KEYS: dict[str, ForeignKey] = {
    "generation.colocated.resources": ForeignKey(
        "NeMo-RL's separate cluster for non-colocated engines; nemo_gen places its engines by fleet.* "
        "(num_shards, device, shards_per_gpu) on the Ray cluster it runs on"),
    "generation.port_range_low": ForeignKey("ports of NeMo-RL's per-worker servers; nemo_gen's engines open none"),
    "generation.port_range_high": ForeignKey("ports of NeMo-RL's per-worker servers; nemo_gen's engines open none"),
    "generation.use_async_rollouts": ForeignKey("SGLang's switch; with vLLM, vllm_cfg.async_engine decides"),
    "generation.refit_transport": ForeignKey(
        "NeMo-RL's refit transports (nixl, nccl_reshard, sparse deltas, plugins) are not supported; "
        "nemo_gen refits through refit.backend (nemo_gen_shm, nemo_gen_ipc, or vLLM's ipc / nccl)",
        _null, "null"),
    "generation.refit_cfg": ForeignKey("configures NeMo-RL's refit transports (refit_transport)"),
    "generation.quant_cfg": ForeignKey(_QUANT, _null, "null"),
    "generation.real_quant": ForeignKey(_QUANT, _off, "false or null"),
    "generation.real_quant_export_cpu_offload": ForeignKey("only read with real_quant"),
    "generation.real_quant_ignore": ForeignKey("only read with real_quant"),
    "generation.val_temperature": ForeignKey(
        "NeMo-RL's validation sampling: a trainer passes it per call (fleet.generate(..., "
        "temperature=...)); nemo-gen runs sample with temperature / top_p / top_k"),
    "generation.val_top_p": ForeignKey("NeMo-RL's validation sampling (see val_temperature)"),
    "generation.val_top_k": ForeignKey("NeMo-RL's validation sampling (see val_temperature)"),
    "generation.num_prompts_per_step": ForeignKey("NeMo-RL's eval batching; nemo-gen batches with run.batch_size"),
    "generation.mcore_generation_config": ForeignKey(_OTHER_BACKEND),
    "generation.sglang_cfg": ForeignKey(_OTHER_BACKEND),
    "generation.trtllm_cfg": ForeignKey(_OTHER_BACKEND),
    "generation.dynamo_cfg": ForeignKey(_OTHER_BACKEND),
    "generation.vllm_cfg.http_refit_api_key_env_var": ForeignKey(_HTTP, _null, "null"),
    "generation.vllm_cfg.http_refit_server_port": ForeignKey(_HTTP, _null, "null"),
    "generation.vllm_cfg.zmq_refit_server_port": ForeignKey(_HTTP, _null, "null"),
    "generation.vllm_cfg.http_server_serving_chat_kwargs": ForeignKey(_HTTP, _null, "null"),
    "generation.vllm_cfg.tool_parser_plugin": ForeignKey(_HTTP, _null, "null"),
    "generation.vllm_cfg.reasoning_parser_plugin": ForeignKey(_HTTP, _null, "null"),
    "generation.vllm_cfg.use_tqdm": ForeignKey("vLLM's own progress bars; nemo-gen shows its own progress"),
    "generation.vllm_cfg.is_mx": ForeignKey("MX-format weights are not supported", _off, "false or null"),
    "generation.vllm_cfg.enable_return_routed_experts": ForeignKey(
        "results do not carry MoE routing (routed experts); not supported", _off, "false or null"),
    "generation.vllm_cfg.num_first_layers_in_bf16": ForeignKey(
        "NeMo-RL's fp8 layer exclusions are not supported (precision=fp8 quantizes every layer)", _off, "0 or null"),
    "generation.vllm_cfg.num_last_layers_in_bf16": ForeignKey(
        "NeMo-RL's fp8 layer exclusions are not supported (precision=fp8 quantizes every layer)", _off, "0 or null"),
    "generation.vllm_cfg.video": ForeignKey("video inputs are not supported (prompts are text or token ids)", _null, "null"),
    "generation.vllm_cfg.reset_encoder_cache_after_weight_update": ForeignKey(
        "nemo_gen resets the encoder cache after every refit anyway (as vLLM's reload_weights does)"),
    "generation.vllm_cfg.cap_max_tokens_to_context": ForeignKey(
        "vLLM stops a request at max_model_len (finish_reason 'length'); false (fail instead) is not "
        "supported", lambda v: v is None or v is True, "true or null"),
}

#: NeMo-RL keys with another name in nemo_gen: the value moves to the nemo_gen field.
NEMO_RL_ALIASES: dict[str, str] = {
    "generation.worker_extension_cls_fqn": "generation.vllm_cfg.worker_extension_cls",
}

#: Top-level sections of NeMo-RL recipes (training and eval). One of them (or ``policy``) marks a
#: document as a recipe; in a recipe, every top-level key nemo_gen does not read is not used.
NEMO_RL_SECTIONS = frozenset({
    "policy", "grpo", "sft", "dpo", "rm", "distillation", "eval", "loss_fn", "checkpointing", "data",
    "env", "logger", "cluster", "tokenizer", "teacher", "async_rl", "reward_model", "profiler",
})

SECTION_REASONS = {
    "cluster": "NeMo-RL's cluster shape; a nemo_gen fleet is sized by fleet.num_shards on the Ray "
               "cluster it finds (ray.address)",
    "eval": "NeMo-RL's scoring loop (metric, k); nemo-gen writes samples, scoring is the caller's",
    "data": "NeMo-RL's datasets; nemo-gen reads prompts from run.input (JSONL)",
    "tokenizer": "tokenizer options besides the name (chat template); nemo-gen sends prompts as given",
}

#: policy.* keys nemo_gen maps (the rest of policy is the trainer's).
POLICY_MAPPED = ("generation", "model_name", "tokenizer", "max_total_sequence_length", "precision")


@dataclass(frozen=True)
class NotUsed:
    """A key from the settings sources that nemo_gen read and does not use, and why."""

    key: str
    value: Any
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "reason": self.reason}
