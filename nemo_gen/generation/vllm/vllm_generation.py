"""``VllmGeneration``: NeMo-RL's GenerationInterface over a nemo_gen ``GenerationFleet``.

NeMo-RL code hands a right-padded token batch (``GenerationDatumSpec``) and expects a
right-padded ``GenerationOutputSpec`` back; this adapter does that translation and lets the
fleet do the work (routing, health, per-shard weight versions).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from nemo_gen.errors import RequestError
from nemo_gen.generation.interfaces import GenerationInterface, verify_right_padding

log = logging.getLogger(__name__)


class VllmGeneration(GenerationInterface):
    """Generation on a fleet of vLLM engines.

    ``VllmGeneration(config)`` launches a fleet from a NeMo-RL generation config (the other
    sections come from ``settings`` or their defaults); ``VllmGeneration(fleet=fleet)`` wraps a
    fleet that is already running and leaves its shutdown to its owner.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, settings=None, fleet=None):
        from nemo_gen.fleet.fleet import GenerationFleet
        from nemo_gen.server import serve
        from nemo_gen.settings import NemoGenSettings

        self._owns_fleet = fleet is None
        if fleet is None:
            overrides: dict[str, Any] = {}
            if config is not None:
                # Internal keys (_pad_token_id, ...) are recomputed by configure_generation_config.
                overrides["generation"] = {k: v for k, v in config.items() if not str(k).startswith("_")}
            if settings is not None:
                base = settings.model_dump(mode="json")
                base.update(overrides)
                overrides = base
            # NeMo-RL composes the process here: the fleet, and its server when vllm_cfg asks for one
            fleet = serve(GenerationFleet.launch(NemoGenSettings.load(overrides=overrides)))
        self.fleet = fleet
        self.cfg = fleet.resolved.generation_config
        self._refits = None

    @property
    def refits(self):
        """NeMo-RL's refit calls on this fleet (``nemo_gen.fleet.nemo_rl_refit``), made once."""
        if self._refits is None:
            from nemo_gen.fleet.nemo_rl_refit import NemoRlRefit

            self._refits = NemoRlRefit(self.fleet)
        return self._refits

    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> None:
        """The trainer's ``{name: (shape, dtype)}``, checked against the engines now."""
        self.refits.prepare_refit_info(state_dict_info)

    def update_weights_via_ipc_zmq(self) -> list:
        """Receive NeMo-RL's ``stream_weights_via_ipc_zmq`` on every shard (the caller launched the
        policy's stream first, as ``refit_policy_generation`` does); returns one result per shard
        (True: it serves the new version; a False one was quarantined), as Ray refs."""
        return _refs([s.ok for s in self.refits.update_weights_via_ipc_zmq().shards])

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list:
        """Join the trainer's NCCL group (vLLM's nccl weight transfer, ``refit.backend=nccl``): the
        trainer's ranks first, the engines' workers after. Returns when the group is set up (the
        caller launched the trainer's side first), as a list of Ray refs."""
        self.refits.init_collective(ip, port, world_size, train_world_size)
        return _refs([True])

    def update_weights_from_collective(self, refit_timeout_s: float | None = None) -> list:
        """One broadcast round over the announced state dict; one result per shard, as Ray refs.
        ``refit_timeout_s`` must be None: the fleet's deadline is ``refit.timeout_s``."""
        if refit_timeout_s is not None:
            raise ValueError("refit_timeout_s is not supported here: the fleet's refit deadline is refit.timeout_s")
        return _refs([s.ok for s in self.refits.update_weights_from_collective().shards])

    def get_collective_sender_spec(self):
        """The packing the trainer's broadcast must use: vLLM's packed consumer cuts at the same bytes."""
        from nemo_gen.core.nemo_rl_collective import PACKED_BUFFER_SIZE_BYTES, PACKED_NUM_BUFFERS
        from nemo_gen.generation.interfaces import CollectiveSenderSpec

        return CollectiveSenderSpec(buffer_size_bytes=PACKED_BUFFER_SIZE_BYTES, num_buffers=PACKED_NUM_BUFFERS)

    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> dict[str, Any]:
        import torch

        input_ids, lengths = data["input_ids"], data["input_lengths"]
        pad = self.cfg.get("_pad_token_id")
        verify_right_padding({"input_ids": input_ids, "input_lengths": lengths}, pad_value=pad)
        prompts = [input_ids[i, : int(lengths[i])].tolist() for i in range(input_ids.shape[0])]
        sampling: dict[str, Any] = {"temperature": 0.0} if greedy else {}
        results = self.fleet.generate(prompts, **sampling)
        failed = [r for r in results if not r.ok]
        if failed:
            raise RequestError(f"sample {failed[0].index}: {failed[0].error}", index=failed[0].index)
        total = [len(r.prompt_token_ids) + len(r.token_ids) for r in results]
        width = max(total)
        output_ids = torch.full((len(results), width), pad, dtype=input_ids.dtype)
        logprobs = torch.zeros((len(results), width), dtype=torch.float32)
        for i, r in enumerate(results):
            n = len(r.prompt_token_ids)
            output_ids[i, :n] = torch.as_tensor(r.prompt_token_ids, dtype=input_ids.dtype)
            if r.token_ids:
                output_ids[i, n : total[i]] = torch.as_tensor(r.token_ids, dtype=input_ids.dtype)
                logprobs[i, n : total[i]] = torch.as_tensor(r.logprobs, dtype=torch.float32)
        return {
            "output_ids": output_ids,
            "logprobs": logprobs,
            "generation_lengths": torch.tensor([len(r.token_ids) for r in results]),
            "unpadded_sequence_lengths": torch.tensor(total),
            "truncated": torch.tensor([r.finish_reason == "length" for r in results]),
        }

    @property
    def colocated(self) -> bool:
        """The engines share their GPUs with a trainer and sleep between phases
        (``generation.colocated.enabled``)."""
        return self.fleet.sleeper.enabled

    def prepare_for_generation(self, *args: Any, tags: list[str] | None = None, **kwargs: Any) -> bool:
        """Colocated: wake ``tags`` (``["weights"]``, ``["kv_cache"]``; None: both), a no-op on an
        awake fleet. Not colocated: nothing to do (NeMo-RL's semantics). A failure is logged and
        returns False, as NeMo-RL's does."""
        if not self.colocated:
            return True
        try:
            return not self.fleet.wake(tags).failed
        except Exception:
            log.exception("prepare_for_generation(tags=%s) failed", tags)
            return False

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Colocated: the engines sleep (level 1; prefix cache reset, running requests finish
        first). Not colocated: only the prefix cache is reset. ``release_gpu`` is NeMo-RL's
        Megatron-only flag: vLLM engines sleep whenever colocated."""
        try:
            if self.colocated:
                return not self.fleet.sleep(1).failed
            return self.fleet.sleeper.reset_prefix_cache()
        except Exception:
            log.exception("finish_generation failed")
            return False

    def invalidate_kv_cache(self) -> bool:
        """Every engine drops its prefix cache; True only when all did (a sleeping one holds none)."""
        return self.fleet.sleeper.reset_prefix_cache()

    def blocks_training(self) -> bool:
        return self.colocated

    def shutdown(self) -> bool:
        if self._owns_fleet:
            self.fleet.shutdown()
        return True


def _refs(values: list) -> list:
    """``values`` as NeMo-RL's callers take them (``ray.get`` on a list of refs); plain values
    where no Ray runs here (the fake tier)."""
    import ray

    return [ray.put(v) for v in values] if ray.is_initialized() else list(values)
