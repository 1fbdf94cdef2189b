"""LoRA adapters as versioned weights: which adapters a fleet serves, under which engine ids,
and whether a new one fits the base model — pure logic, no engine.

Two rules make a stale adapter impossible to serve:

- Every load gets a **fresh engine id** (``AdapterRegistry.reserve``), never one used before in
  this fleet — not for another adapter, not for an earlier version of the same name. vLLM caches
  an adapter by its id and never reloads an id it holds, and its prefix cache keys KV by the
  adapter's name and path; a request names its adapter by the id (and an engine name made from
  it), so a request resolved after a refit cannot reach the old version's weights.
- A name resolves to its **newest** version only; an older version stays loaded while requests
  that started on it run, and is evicted first once they finish.

The bound: at most ``max_adapters`` adapters are loaded on the engines at once (current versions
and superseded ones still finishing requests). Making room takes, in this order, the least
recently used superseded adapter with no request in flight, then the least recently used current
one with none in flight (its name stops resolving: refit it again); an adapter with requests in
flight is never evicted — when every slot is busy the refit is refused (``AdapterError``).

``check_adapter`` compares an adapter's manifest (its PEFT config and tensor shapes) with the
base model's before any shard sees it: target modules the engine can wrap, rank within the
fleet's ``max_rank``, every tensor's shape against its base layer, and the base model's name.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from nemo_gen.core.manifest import RefitError

# PEFT's names: "base_model.model." + the model's module + ".lora_A.weight" / ".lora_B.weight".
PEFT_PREFIX = "base_model.model."
_LORA_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


class AdapterError(RefitError):
    """An adapter was refused (bad manifest, no free slot) or cannot be served; the message
    names the adapter. Nothing changed on any shard."""


@dataclass
class AdapterEntry:
    """One adapter load: ``name`` at ``version``, under engine id ``engine_id`` (unique for the
    fleet's lifetime), on top of base weights ``base_version``."""

    name: str
    version: int
    engine_id: int
    base_version: int | None
    in_flight: int = 0
    current: bool = True  # False: a newer version of its name replaced it
    last_used: int = 0

    @property
    def engine_name(self) -> str:
        """The name the engines know it by: unique per load, as vLLM keys its caches by it."""
        return f"{self.name}#{self.engine_id}"


@dataclass
class Reservation:
    """A load about to be sent to the shards: the new entry and the entries that must leave the
    engines first to keep the bound."""

    entry: AdapterEntry
    evict: list[AdapterEntry] = field(default_factory=list)


class AdapterRegistry:
    """Names -> versions -> fresh engine ids, with the bound and the eviction rule (module doc)."""

    def __init__(self, max_adapters: int, first_id: int = 1):
        if max_adapters < 1:
            raise ValueError("max_adapters must be at least 1")
        self.max_adapters = max_adapters
        self._ids = itertools.count(max(1, first_id))
        self._clock = itertools.count(1)
        self._loaded: dict[int, AdapterEntry] = {}  # engine id -> entry, everything on the engines
        self._current: dict[str, AdapterEntry] = {}  # name -> its newest version
        self._last_version: dict[str, int] = {}  # survives eviction: versions only move forward

    # -- loading -----------------------------------------------------------------------------

    def next_version(self, name: str, version: int | None) -> int:
        last = self._last_version.get(name)
        if version is None:
            return 1 if last is None else last + 1
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise AdapterError(f"adapter {name!r}: version must be a positive integer, got {version!r}")
        if last is not None and version <= last:
            raise AdapterError(f"adapter {name!r}: version {version} is not newer than its version {last}")
        return version

    def reserve(self, name: str, version: int | None, base_version: int | None) -> Reservation:
        """A fresh engine id for ``name`` at ``version`` (default: its last + 1) and what to evict
        so that it fits. Nothing changes until ``commit``."""
        if not isinstance(name, str) or not name or "#" in name:
            raise AdapterError(f"adapter name {name!r} must be a non-empty string without '#'")
        version = self.next_version(name, version)
        evict = self._victims(len(self._loaded) + 1 - self.max_adapters, name)
        entry = AdapterEntry(name, version, next(self._ids), base_version)
        return Reservation(entry, evict)

    def _victims(self, needed: int, loading: str) -> list[AdapterEntry]:
        if needed <= 0:
            return []
        idle = [e for e in self._loaded.values() if e.in_flight == 0]
        # Superseded first; then, among current ones, never the version the new load replaces
        # (it keeps serving if the load fails) unless nothing else is free.
        idle.sort(key=lambda e: (e.current, e.current and e.name == loading, e.last_used))
        if len(idle) < needed:
            busy = sorted(e.engine_name for e in self._loaded.values() if e.in_flight)
            raise AdapterError(
                f"adapter {loading!r} refused: all {self.max_adapters} adapter slots "
                f"(generation.vllm_cfg.lora.max_adapters) hold adapters with requests in flight ({', '.join(busy)})"
            )
        return idle[:needed]

    def commit(self, reservation: Reservation) -> None:
        """The load landed: the new entry serves its name, the old version (if any) is
        superseded, the evicted leave."""
        for gone in reservation.evict:
            self.drop(gone)
        entry = reservation.entry
        old = self._current.get(entry.name)
        if old is not None:
            old.current = False
        entry.last_used = next(self._clock)
        self._loaded[entry.engine_id] = entry
        self._current[entry.name] = entry
        self._last_version[entry.name] = entry.version

    def drop(self, entry: AdapterEntry) -> None:
        """``entry`` left the engines."""
        self._loaded.pop(entry.engine_id, None)
        if self._current.get(entry.name) is entry:
            del self._current[entry.name]

    def forget_all(self) -> list[AdapterEntry]:
        """Every adapter left the engines (a full refit drops them in vLLM): nothing resolves."""
        gone = list(self._loaded.values())
        self._loaded.clear()
        self._current.clear()
        return gone

    # -- serving -----------------------------------------------------------------------------

    def acquire(self, name: str, base_version: int | None) -> AdapterEntry:
        """The newest version of ``name`` for one request, counted in flight until ``release``."""
        entry = self._current.get(name)
        if entry is None:
            known = sorted(self._current)
            why = "it was evicted or dropped; refit it again" if name in self._last_version else "no such adapter"
            raise AdapterError(f"adapter {name!r} is not loaded ({why}); loaded: {known or 'none'}")
        if entry.base_version != base_version:
            raise AdapterError(
                f"adapter {name!r} v{entry.version} was loaded on base weights v{entry.base_version}, the "
                f"fleet now serves v{base_version}; refit the adapter again"
            )
        entry.in_flight += 1
        entry.last_used = next(self._clock)
        return entry

    def release(self, entry: AdapterEntry) -> None:
        entry.in_flight = max(0, entry.in_flight - 1)

    # -- views -------------------------------------------------------------------------------

    def current(self, name: str) -> AdapterEntry | None:
        return self._current.get(name)

    def loaded(self) -> list[AdapterEntry]:
        return sorted(self._loaded.values(), key=lambda e: e.engine_id)

    def names(self) -> dict[str, int]:
        """name -> the version it serves."""
        return {n: e.version for n, e in sorted(self._current.items())}


# -- the manifest check ------------------------------------------------------------------------


@dataclass(frozen=True)
class BaseLoraManifest:
    """What the base model takes: its linear layers (module path -> (in, out) features), the
    module leaves the engine can wrap with LoRA, the fleet's max rank, and the model's names
    (its path and, where known, its hub name)."""

    layers: Mapping[str, tuple[int, int]]
    supported: frozenset[str]
    max_rank: int
    model_names: frozenset[str]


def base_lora_manifest(tensors: Mapping[str, tuple[tuple[int, ...], str]], supported: list[str], max_rank: int,
                       model_names: list[str]) -> BaseLoraManifest:
    """From the engine's manifest (checkpoint name -> (shape, dtype)): every 2-D ``*.weight`` of a
    supported leaf is a linear layer (out, in)."""
    layers = {}
    for name, (shape, _) in tensors.items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name[: -len(".weight")]
        if module.rpartition(".")[2] in supported:
            layers[module] = (int(shape[1]), int(shape[0]))
    names = {n for n in model_names if n}
    names |= {n.rstrip("/").rpartition("/")[2] for n in names}
    return BaseLoraManifest(layers, frozenset(supported), max_rank, frozenset(names))


def check_adapter(name: str, config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]],
                  base: BaseLoraManifest) -> list[str]:
    """Problems with adapter ``name`` (its PEFT ``config`` and tensor name -> shape) against the
    base; an empty list: it fits. ``refuse`` turns them into an ``AdapterError``."""
    problems: list[str] = []
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        problems.append(f"adapter_config.json's r is {rank!r}, not a positive integer")
        rank = None
    elif rank > base.max_rank:
        problems.append(f"rank {rank} exceeds the fleet's max rank {base.max_rank} (generation.vllm_cfg.lora.max_rank)")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type is {config.get('peft_type')!r}, only LORA is served")
    for flag in ("use_dora",):
        if config.get(flag):
            problems.append(f"{flag} is set; vLLM serves plain LoRA only")
    base_name = config.get("base_model_name_or_path")
    if base_name and base.model_names and str(base_name).rstrip("/") not in base.model_names \
            and str(base_name).rstrip("/").rpartition("/")[2] not in base.model_names:
        problems.append(f"it was trained on base model {base_name!r}, the fleet serves {sorted(base.model_names)[0]!r}")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # PEFT allows a regex; the tensors below are checked anyway
        targets = []
    for target in targets:
        if target.rpartition(".")[2] not in base.supported:
            problems.append(f"target module {target!r} is not one the engine can adapt ({', '.join(sorted(base.supported))})")
    if not shapes:
        problems.append("it holds no tensors")
    for tensor, shape in sorted(shapes.items()):
        match = _LORA_NAME.match(tensor)
        if match is None:
            problems.append(f"tensor {tensor!r} is not a lora_A/lora_B weight")
            continue
        module = match["module"].removeprefix(PEFT_PREFIX)
        if module not in base.layers:
            leaf = module.rpartition(".")[2]
            why = "no such layer in the base model" if leaf in base.supported else "not a module the engine can adapt"
            problems.append(f"tensor {tensor!r}: {why}")
            continue
        d_in, d_out = base.layers[module]
        want = (rank, d_in) if match["ab"] == "A" else (d_out, rank)
        if rank is not None and tuple(shape) != want:
            problems.append(f"tensor {tensor!r} has shape {tuple(shape)}, the base layer needs {want}")
    return problems


def refuse(name: str, problems: list[str]) -> None:
    """Raise ``AdapterError`` naming the adapter and its first problems, if there are any."""
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise AdapterError(f"adapter {name!r} refused, nothing changed: " + "; ".join(problems[:5]) + more)
