"""Resolve settings into everything a launch needs, before any engine starts.

Runs NeMo-RL's ``configure_generation_config`` against the real tokenizer, picks the device,
plans placement and checks it against the live cluster, and builds one ``ShardSpec`` per
shard. Every configuration mistake surfaces here as a ``ConfigError``/``PlacementError``
naming the field — never as a hung placement group or a crashed engine.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_gen.core import engine_args
from nemo_gen.core.placement import (
    ClusterResources,
    FleetPlacementPlan,
    check_fits,
    plan_fleet_placement,
    spread_shards,
)
from nemo_gen.errors import ConfigError
from nemo_gen.fleet.handles import ShardSpec
from nemo_gen.core.generation_config import check_backend, configure_generation_config
from nemo_gen.settings import NemoGenSettings


@dataclass(frozen=True)
class ResolvedGeneration:
    """The launch plan. Picklable, so a Prefect task can hand it to the next."""

    settings: NemoGenSettings
    generation_config: dict[str, Any]
    device: str
    model_dir: str
    tokenizer_dir: str
    plan: FleetPlacementPlan
    shards: tuple[ShardSpec, ...]
    spares: tuple[ShardSpec, ...] = ()  # fleet.spares warm engines (serve no slot until promoted)
    # The model config's vocab_size: the embedding rows the engines index, so the bound every
    # prompt's token ids are checked against on the driver (None: the config names none).
    vocab_size: int | None = None

    @property
    def max_model_len(self) -> int | None:
        return self.generation_config["vllm_cfg"].get("max_model_len")


def ensure_model(settings: NemoGenSettings) -> Path:
    """The model directory; makes the tiny local model when ``model.path`` is unset."""
    if settings.model.path is None:
        from nemo_gen.tiny_model import make_tiny_model

        return make_tiny_model(settings.model_dir())
    path = settings.model_dir()
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a Hugging Face model directory (no config.json)", field="model.path")
    return path


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {path}: {exc}", field="model.tokenizer") from None


def resolve_generation(
    settings: NemoGenSettings, cluster: ClusterResources | None, tokenizer=None
) -> ResolvedGeneration:
    """Build the launch plan. ``cluster`` None skips the fit check (planning offline)."""
    gen_cfg = settings.generation.to_generation_config()
    # Fails with the unknown backend's name before anything else is done.
    check_backend(gen_cfg)
    model_dir = ensure_model(settings)
    tokenizer_dir = settings.tokenizer_dir() if settings.model.tokenizer else model_dir
    if tokenizer is None:
        tokenizer = load_tokenizer(tokenizer_dir)
    gen_cfg = configure_generation_config(
        copy.deepcopy(gen_cfg),
        tokenizer,
        is_eval=settings.is_eval(),
        has_refit_draft_weights=settings.refit.draft,
        draft_full_refit=settings.refit.draft_full,
    )
    _resolve_max_model_len(gen_cfg, model_dir)

    device = _device(settings, cluster)
    if settings.generation.colocated.enabled and settings.fleet.spares:
        # (a spare is not in the slots a sleep reaches; awake, it would keep its memory from the trainer)
        raise ConfigError("fleet.spares must be 0 with generation.colocated.enabled: a warm spare stays awake "
                          "and holds the GPU memory the sleeping engines give the trainer", field="fleet.spares")
    vc = gen_cfg["vllm_cfg"]
    # Spares are engines like the others: they are planned, and must fit, with the fleet.
    plan = plan_fleet_placement(
        settings.fleet.num_shards + settings.fleet.spares,
        vc["tensor_parallel_size"],
        vc["pipeline_parallel_size"],
        device,
        settings.fleet.cpus_per_worker,
        shards_per_gpu=settings.fleet.shards_per_gpu,
    )
    hints: dict[int, str] = {}
    if cluster is not None:
        check_fits(plan, cluster)
        # Several nodes: spread shards across them (PACK within a shard), so losing a node
        # costs the fewest shards.
        hints = spread_shards(plan, cluster)
    kwargs = engine_args.engine_kwargs(
        gen_cfg, model_dir=str(model_dir), tokenizer_dir=str(tokenizer_dir), device=device,
        weight_transfer_backend=settings.refit.backend,
    )
    version = 0 if settings.is_eval() else None
    cores = _cores_per_shard(settings, plan, cluster)
    specs = tuple(
        ShardSpec(
            fleet=settings.fleet.name,
            namespace=settings.ray.namespace,
            index=shard.shard,
            bundles=[dict(b) for b in shard.bundles],
            # Ray honours a node hint only for STRICT_PACK; the hint is soft (a full or dead
            # node: placed elsewhere), the whole shard still lands on one node.
            strategy="STRICT_PACK" if shard.shard in hints else shard.strategy,
            node_hint=hints.get(shard.shard),
            engine_kwargs=kwargs,
            engine_env=engine_args.engine_env(
                gen_cfg,
                device=device,
                omp_threads=settings.fleet.omp_threads_per_engine,
                cpu_kvcache_space_gb=settings.fleet.cpu_kvcache_space_gb,
                cpu_cores=cores[shard.shard] if cores else None,
                niceness=settings.fleet.engine_niceness,
                weight_transfer_backend=engine_args.transfer_backend(kwargs),
            ),
            async_engine=bool(vc.get("async_engine")),
            device=device,
            weight_version=version,
            placement_timeout_s=settings.fleet.placement_timeout_s,
            engine_start_timeout_s=settings.fleet.engine_start_timeout_s,
            engine_core_start=settings.fleet.engine_core_start,
        )
        for shard in plan.shards
    )
    num = settings.fleet.num_shards
    spares = tuple(
        dataclasses.replace(spec, name=f"{settings.fleet.name}-spare-{spec.index - num}", spare=True)
        for spec in specs[num:]
    )
    return ResolvedGeneration(
        spares=spares,
        settings=settings,
        generation_config=gen_cfg,
        device=device,
        model_dir=str(model_dir),
        tokenizer_dir=str(tokenizer_dir),
        plan=plan,
        shards=specs[:num],
        vocab_size=model_vocab_size(model_dir),
    )


def _model_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The model directory's config.json (``ensure_model`` checked that it is there)."""
    import json

    return json.loads((Path(model_dir) / "config.json").read_text())


def _resolve_max_model_len(gen_cfg: dict[str, Any], model_dir: Path) -> None:
    """Make max_model_len explicit (from the model's config when unset) so the driver can
    reject a too-long prompt before dispatching it."""
    vc = gen_cfg["vllm_cfg"]
    if vc.get("max_model_len") is None:
        cfg = _model_config(model_dir)
        if "max_position_embeddings" in cfg:
            vc["max_model_len"] = int(cfg["max_position_embeddings"])


def model_vocab_size(model_dir: str | os.PathLike) -> int | None:
    """The model config's ``vocab_size`` (its text model's, for a config that nests one), as vLLM
    reads it (``ModelConfig.get_vocab_size``); None when the config has none."""
    cfg = _model_config(model_dir)
    for section in (cfg.get("text_config"), cfg):
        if isinstance(section, dict) and isinstance(section.get("vocab_size"), int):
            return section["vocab_size"]
    return None


def _device(settings: NemoGenSettings, cluster: ClusterResources | None) -> str:
    if settings.fleet.device != "auto":
        return settings.fleet.device
    has_gpu = cluster is not None and cluster.total.get("GPU", 0) > 0
    return "gpu" if has_gpu else "cpu"


def _cores_per_shard(
    settings: NemoGenSettings, plan: FleetPlacementPlan, cluster: ClusterResources | None
) -> dict[int, list[int]] | None:
    """Pin each CPU shard to its own cores when the fleet fits the machine's cores; otherwise
    leave binding to the OS (two engines bound to one core would each run at half speed)."""
    if plan.device != "cpu":
        return None
    ncores = os.cpu_count() or 1
    per_shard = plan.workers_per_shard * settings.fleet.omp_threads_per_engine
    if per_shard * plan.num_shards > ncores:
        return None
    return {i: list(range(i * per_shard, (i + 1) * per_shard)) for i in range(plan.num_shards)}
