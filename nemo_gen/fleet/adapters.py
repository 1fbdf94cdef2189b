"""LoRA adapters on a fleet: ``FleetAdapters``, the driver side of ``fleet.refit_adapter`` and
of ``generate(..., adapter=name)`` (a shard's side is ``nemo_gen.shard.adapters``).

A refit of an adapter: read the source (a PEFT directory, or a trainer's live tensors), check
it against the base model's manifest (``nemo_gen.core.adapters.check_adapter``) — a bad one is
refused by name before any shard sees it — reserve a fresh engine id and the evictions that
keep the bound (``AdapterRegistry``), stage the tensors in a shared-memory file of their own
(the full refit's staging keeps the base weights a newcomer catches up from), and have every
shard's workers build and register it (``nemo_gen.vllm_ext.lora``). If any shard fails, the new
id is removed from every shard that took it and the registry is unchanged: the old version
serves on. An adapter load never pauses generation: vLLM runs it between two engine steps,
and requests already running keep the adapter id they started with — every token of a
request comes from one adapter version, the one its result names. Full weights and adapters
share the refit lock, so the two never interleave.

A full refit drops every adapter in vLLM (the runner resets its LoRA state after new base
weights): adapters are then refused by name until refit again (``AdapterRegistry.acquire``
compares the base version each was loaded on). A newcomer shard (a replacement, a spare) loads
every adapter the fleet holds when it catches up with the base weights, under the same ids,
from a copy of the bytes each id was loaded from.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from nemo_gen.core.adapters import (
    AdapterEntry,
    AdapterError,
    AdapterRegistry,
    BaseLoraManifest,
    base_lora_manifest,
    check_adapter,
    refuse,
)
from nemo_gen.core.manifest import TensorMeta, canonical_dtype, is_floating, layout
from nemo_gen.core.modes import WeightTarget
from nemo_gen.core.wire import AdapterLoad, AdapterModules, AdapterRemove, AdapterState, InFlight
from nemo_gen.core.members import Member
from nemo_gen.fleet.driver import ShardDriver
from nemo_gen.fleet.handles import ShardHandle
from nemo_gen.fleet.refit import Refitter
from nemo_gen.fleet.weights import FleetWeights
from nemo_gen.settings import NemoGenSettings
from nemo_gen.vllm_ext.lora import EXTRA_KEY
from nemo_gen.vllm_ext.staging import SharedMemoryStaging

_MARGIN_S = 60.0
log = logging.getLogger(__name__)


@dataclass
class AdapterReport:
    """One adapter refit: its name, version and engine id, the bytes staged (what every shard
    read), the seconds, and the adapters evicted to make room."""

    name: str
    version: int
    engine_id: int
    bytes: int
    tensors: int
    seconds: float
    shards: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)


def read_adapter(source: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(PEFT config, name -> tensor) from a PEFT directory (``adapter_config.json`` +
    ``adapter_model.safetensors``), or from live tensors: a mapping ``{"config": ...,
    "tensors": ...}`` or a ``(config, tensors)`` pair."""
    if isinstance(source, (str, os.PathLike)):
        from safetensors.torch import load_file

        path = Path(source)
        cfg, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
        for needed in (cfg, weights):
            if not needed.is_file():
                raise AdapterError(f"{path} is not a PEFT adapter directory: {needed.name} is missing")
        try:
            config = json.loads(cfg.read_text())
        except ValueError as exc:
            raise AdapterError(f"{cfg}: not JSON ({exc})") from None
        return config, load_file(str(weights))
    if isinstance(source, Mapping) and {"config", "tensors"} <= set(source):
        return dict(source["config"]), dict(source["tensors"])
    if isinstance(source, tuple) and len(source) == 2:
        return dict(source[0]), dict(source[1])
    raise AdapterError(
        f"an adapter source is a PEFT directory or live tensors ({{'config': ..., 'tensors': ...}}), "
        f"not {type(source).__name__}"
    )


@dataclass
class Chosen:
    """The adapter one generate call runs on (None: the base model): what its sampling dict
    carries to the engines, and the stamp its results get."""

    entry: AdapterEntry | None = None

    @property
    def sampling(self) -> dict[str, Any]:
        return {} if self.entry is None else {EXTRA_KEY: [self.entry.engine_name, self.entry.engine_id]}

    def stamp(self, result: Any) -> Any:
        """A result, or a list of them, named with the adapter and version that produced it: the
        engine id the request carried belongs to that version alone."""
        if self.entry is not None:
            for r in result if isinstance(result, list) else [result]:
                if hasattr(r, "adapter"):
                    r.adapter, r.adapter_version = self.entry.name, self.entry.version
        return result


class FleetAdapters:
    """The fleet's adapters. ``refitter`` gives the members and the base manifest, ``driver``
    carries the calls, ``weights`` holds the refit lock and the base version."""

    def __init__(self, refitter: Refitter, driver: ShardDriver, weights: FleetWeights, settings: NemoGenSettings):
        lora = settings.generation.vllm_cfg.lora
        self.enabled = lora.enabled
        self.refitter = refitter
        self.driver = driver
        self.weights = weights
        self.registry = AdapterRegistry(lora.max_adapters)
        self.max_rank = lora.max_rank
        self._model_names = [str(settings.model.path or ""), str(settings.model.name or "")]
        self._staging_at = (settings.refit.staging_dir, f"{settings.fleet.name}-adapters")
        self._base: BaseLoraManifest | None = None
        self._seeded = False
        # What each loaded adapter was made of (engine id -> config, tensors): a newcomer shard
        # loads the same bytes under the same ids, so each id still means exactly one load.
        self._kept: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        refitter.after_catch_up.append(self.catch_up)

    # -- refit -------------------------------------------------------------------------------

    def base(self) -> BaseLoraManifest:
        if self._base is None:
            expected = self.refitter.expected(WeightTarget.POLICY)
            engine = self._modules()
            self._base = base_lora_manifest(expected.tensors, engine.supported,
                                            min(self.max_rank, engine.max_rank), self._model_names)
        return self._base

    def _modules(self) -> AdapterState:
        """What the first shard that answers says its engine can adapt and holds."""
        errors = []
        for member, handle in self.refitter.refit_members().items():
            answer = self.driver.fan_out({member: handle}, AdapterModules(), _MARGIN_S)[member]
            if answer.ok:
                return answer.value
            errors.append(f"shard {member.label}: {answer.error}")
        raise AdapterError(f"no shard could describe its adapters: {'; '.join(errors)}")

    def refit(self, name: str, source: Any, version: int | None) -> AdapterReport:
        if not self.enabled:
            raise AdapterError(f"adapter {name!r} refused: this fleet's engines started without LoRA "
                               "(generation.vllm_cfg.lora.enabled)")
        t0 = time.perf_counter()
        config, tensors = read_adapter(source)
        with self.weights.refitting():
            self._seed_ids()
            if any(e.base_version != self.weights.version for e in self.registry.loaded()):
                self.registry.forget_all()  # new base weights since: vLLM dropped them all
            members = self.refitter.refit_members()
            base = self.base()
            refuse(name, check_adapter(name, config, {k: tuple(v.shape) for k, v in tensors.items()}, base))
            reservation = self.registry.reserve(name, version, self.weights.version)
            entry, evict = reservation.entry, [e.engine_id for e in reservation.evict]
            total, count, answers = self._load(members, config, tensors, entry.engine_id, evict)
            failed = {m: a.error for m, a in answers.items() if not a.ok}
            if failed:
                loaded = {m: members[m] for m, a in answers.items() if a.ok}
                self.driver.fan_out(loaded, AdapterRemove((entry.engine_id,)), _MARGIN_S)
                # A shard that took the load evicted as asked: those leave everywhere.
                if loaded and evict:
                    self.driver.fan_out(members, AdapterRemove(tuple(evict)), _MARGIN_S)
                    for gone in reservation.evict:
                        self.registry.drop(gone)
                why = "; ".join(f"shard {m.label}: {e}" for m, e in failed.items())
                raise AdapterError(f"adapter {name!r} v{entry.version} refused, the previous version serves on: {why}")
            self.registry.commit(reservation)
            # A copy: a trainer's live tensors move on, and this id must keep meaning these bytes.
            self._kept[entry.engine_id] = (config, {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()})
            self._prune()
        return AdapterReport(name, entry.version, entry.engine_id, total, count, time.perf_counter() - t0,
                             shards=sorted(m.label for m in members),
                             evicted=[e.engine_name for e in reservation.evict])

    def _load(self, handles: Mapping[Any, Any], config: Mapping[str, Any], tensors: Mapping[str, Any],
              engine_id: int, evict: list[int]) -> tuple[int, int, dict[Any, Any]]:
        """Stage one adapter and have ``handles`` register it; (bytes, tensors, member -> Outcome).
        A staging file of its own for the load alone (the workers copy what they read), so the full
        refit's staged base weights stay for a newcomer to catch up from."""
        staging = SharedMemoryStaging(*self._staging_at)
        try:
            total, entries = self._stage(staging, tensors)
            load = AdapterLoad(str(staging.path), total, tuple((n, tuple(shape), dt, off) for n, shape, dt, off in entries),
                               _plain(config), engine_id, tuple(evict))
            answers = self.driver.fan_out(handles, load, _MARGIN_S)
        finally:
            staging.close()
        return total, len(entries), answers

    def _prune(self) -> None:
        loaded = {e.engine_id for e in self.registry.loaded()}
        self._kept = {i: kept for i, kept in self._kept.items() if i in loaded}

    def catch_up(self, member: Member, handle: ShardHandle) -> None:
        """A newcomer (a replacement, a spare) that caught up with the base weights loads every
        adapter the fleet holds on them, under the same ids (``Refitter.after_catch_up``, under the
        refit lock). One that fails is left out on that shard: its requests there fail by name
        (``lora_request_of``), never reach another version."""
        if not self.enabled:
            return
        self._prune()
        for entry in self.registry.loaded():
            if entry.base_version != self.weights.version or entry.engine_id not in self._kept:
                continue
            config, tensors = self._kept[entry.engine_id]
            answer = self._load({member: handle}, config, tensors, entry.engine_id, [])[2][member]
            if not answer.ok:
                log.warning("shard %s: adapter %s was not loaded: %s", member.label, entry.engine_name, answer.error)

    def _seed_ids(self) -> None:
        """Engines outlive a driver (an attached fleet): new ids start past every id a shard holds."""
        if not self._seeded:
            held = self._modules().held
            if held:
                self.registry = AdapterRegistry(self.registry.max_adapters, first_id=max(held) + 1)
            self._seeded = True

    def _stage(self, staging: SharedMemoryStaging, tensors: Mapping[str, Any]) -> tuple[int, list]:
        import torch

        dtype_name = self.refitter.engine_dtype
        metas = [TensorMeta.of(n, t.shape, dtype_name if is_floating(canonical_dtype(str(t.dtype))) else str(t.dtype))
                 for n, t in sorted(tensors.items())]
        placed, total = layout(metas)
        staging.ensure(total)
        for p in placed:
            staging.write(p, tensors[p.name], getattr(torch, dtype_name))
        return total, staging.entries(placed)

    # -- serving -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def selected(self, name: str | None, sampling: dict[str, Any]):
        """(``Chosen``, the request's sampling with it) for the newest version of adapter ``name``
        (None: the base model), counted in flight — never evicted — until the block ends."""
        if name is None:
            yield Chosen(), sampling
            return
        if not self.enabled:
            raise AdapterError(f"adapter {name!r}: this fleet's engines started without LoRA "
                               "(generation.vllm_cfg.lora.enabled)")
        entry = self.registry.acquire(name, self.weights.version)
        try:
            chosen = Chosen(entry)
            yield chosen, {**sampling, **chosen.sampling}
        finally:
            self.registry.release(entry)

    def stream(self, name: str | None, sampling: dict[str, Any], start: Callable[[dict[str, Any]], Any]):
        """``start(sampling)``'s stream on adapter ``name``'s newest version (None: the base model):
        an unknown adapter is refused here, before any request; the adapter is held in flight (never
        evicted) until the stream ends, and its result is stamped with the adapter and version."""
        if name is None:
            return start(sampling)
        context = self.selected(name, sampling)
        chosen, with_adapter = context.__enter__()  # raises AdapterError now, not at the first item

        async def relay():
            try:
                async for item in start(with_adapter):
                    yield chosen.stamp(item) if hasattr(item, "adapter_version") else item
            finally:
                context.__exit__(None, None, None)

        return relay()

    @contextlib.contextmanager
    def full_refit(self, in_flight: InFlight):
        """Around a refit of the base weights, which drops every adapter in vLLM: under ``keep``
        or ``abort`` a running adapter request would step on after its adapter is gone, so with
        adapters loaded only ``drain`` is taken."""
        if self.registry.loaded() and not in_flight.drain:
            raise AdapterError(
                f"a full refit drops the loaded adapters ({', '.join(sorted(self.registry.names()))}) and "
                f"in_flight '{in_flight.mode}' would run their requests on after that: use in_flight='drain'"
            )
        yield


def _plain(config: Mapping[str, Any]) -> dict[str, Any]:
    """The PEFT config as JSON data (sets and tuples from a live config become lists)."""
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))
