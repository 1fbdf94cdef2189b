"""NeMo-RL's collective refit (``init_collective`` / ``update_weights_from_collective``) mapped onto
vLLM's ``nccl`` weight transfer, as pure rules: which ranks the engines' workers take and what each
round announces. ``nemo_gen.fleet.nemo_rl_refit`` sends them through the fleet's weight-sync client.

NeMo-RL's layout: one NCCL group of ``world_size`` ranks; the trainer's ``train_world_size`` ranks
are 0..T-1 and broadcast from rank 0; the generation workers follow, shard after shard
(``T + rank_prefix + local_rank``). vLLM's worker-side init info says the same with
``rank_offset`` = T (each shard's offset is placed after the previous shard's workers by the
client). Both sides walk the announced state dict in the same order: the update info lists it in
``prepare_refit_info``'s order, and the packing (vLLM's packed broadcast, two buffers) must agree
with the trainer's (``VllmGeneration.get_collective_sender_spec``).
"""

from __future__ import annotations

from typing import Any, Sequence

from nemo_gen.core.ipc_zmq import Entry

# vLLM's packed broadcast geometry (vllm.distributed.weight_transfer.packed_tensor's defaults), which
# the trainer's producer must use too: the consumer cuts its buffers at the same boundaries.
PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
PACKED_NUM_BUFFERS = 2


def collective_init_info(ip: str, port: int, world_size: int, train_world_size: int,
                         engine_ranks: int) -> dict[str, Any]:
    """The worker-side init info of vLLM's nccl backend for NeMo-RL's group; ``ValueError`` when
    ``world_size`` is not the trainer's ranks plus every engine rank (``engine_ranks``)."""
    if train_world_size < 1:
        raise ValueError(f"train_world_size must be >= 1 (the broadcast root is trainer rank 0), got {train_world_size}")
    if world_size != train_world_size + engine_ranks:
        raise ValueError(
            f"init_collective: world_size={world_size}, but the group is train_world_size={train_world_size} trainer "
            f"rank(s) + {engine_ranks} engine worker rank(s) = {train_world_size + engine_ranks}")
    return {"master_address": ip, "master_port": int(port), "world_size": int(world_size),
            "rank_offset": int(train_world_size), "packed": True,
            "packed_buffer_size_bytes": PACKED_BUFFER_SIZE_BYTES, "packed_num_buffers": PACKED_NUM_BUFFERS}


def collective_update_info(entries: Sequence[Entry]) -> dict[str, Any]:
    """One round's update info: every announced tensor, in the announced order."""
    if not entries:
        raise ValueError("update_weights_from_collective: nothing announced; call prepare_refit_info first")
    return {"names": [e[0] for e in entries], "dtype_names": [e[2] for e in entries],
            "shapes": [list(e[1]) for e in entries]}
