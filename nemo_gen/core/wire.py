"""The shard's wire: every message the fleet's own protocol carries across Ray (or a shard's
direct line), both ways, as a frozen dataclass or an enum. The driver (``nemo_gen.fleet.driver``),
the shard's rules (``nemo_gen.shard.rules``) and the fake tier (``tests/fakes.py``) import
these and nothing else, so a change to a message is a change to one class that the type checker
and every tier see. No dict of the fleet's crosses the boundary (the fake tier checks every call:
``tests/fake/test_wire_no_dicts.py``); what vLLM defines stays vLLM's, and only these fields carry
a mapping (``VLLM_OWNED``): a weight-sync ``init_info`` or ``update_info``, a LoRA adapter's
PEFT ``config``; and ``vllm_metrics`` answers vLLM's own stats rows as it reads them.

- ``ShardInfo``: a shard's own account of itself (``info``, ``start``, ``assign``).
- ``Sampling``: a request's resolved sampling parameters (``Structured``: a grammar to decode under).
- ``GenerateReply``: what a generate call answers, one ``RequestResult`` (of ``SampleResult``s)
  per request; ``StreamDeltas`` (of ``SampleDelta``s) / ``StreamEnd``: a stream's items.
- ``InFlight``: how running requests meet a refit (``refit.in_flight`` and its options).
- ``StepGaps``, ``Unfinished``, ``LoadStats``: diagnostics for tests and benchmarks.
- ``ProbeReply``: a probe's answer, its ``ProbeStatus`` saying what the shard showed.
- ``CheckRefit`` / ``LoadRefit``: the two phases of a checkpoint refit on one shard.
- ``SyncRequest``: one step of vLLM's weight-sync protocol, ``SyncStep`` naming it and one frozen
  payload type per step; ``SyncReply`` its answer (``ApplyTimings`` for a one-call apply).
- ``ChannelAddress``: where a shard's direct line for weight-sync steps listens.
- ``FleetRecordState`` / ``SlotRecord``: what the fleet's record actor (``nemo_gen.fleet.record``)
  holds and is told: the fleet's version and its checkpoint, each slot's restarts and retirement.
- ``EngineManifest``: the tensors a refit of the policy or the drafter must provide.
- ``AdapterModules`` / ``AdapterLoad`` / ``AdapterRemove``: a LoRA adapter call on one shard;
  ``AdapterState`` its answer.
- ``Failure``: how a call failed, by the fault model (``nemo_gen.core.retry``): dead, busy, slow
  or data — never a bare string.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Union

from nemo_gen.core.modes import RefitMode, WeightTarget

# The generate path's messages and the diagnostics, in their own module for size; part of the wire.
from nemo_gen.core.wire_generation import (  # noqa: F401
    GenerateReply, LoadStats, RequestProgress, RequestResult, SampleDelta, SampleProgress, SampleResult, Sampling, Spans, StepGaps, StreamDeltas,
    StreamEnd, Structured, TokenLogprobs, Unfinished, pairs,
)

# -- failures --------------------------------------------------------------------------------------


class FailureKind(enum.StrEnum):
    """The fault model's kinds (``nemo_gen.core.retry``): only DEAD condemns a shard. The one type
    of that name: ``retry.kind_of`` answers it, the router and the attempts policy take it."""

    DEAD = "dead"  # the actor, its engine or its node is gone, or a control call went unanswered
    BUSY = "busy"  # admission refused for now: retry elsewhere, later
    SLOW = "slow"  # a deadline passed while the engine made progress: this request alone fails
    DATA = "data"  # the shard said no (a bad manifest, a bad request): the same on any shard


def exception_line(exc: BaseException) -> str:
    """``Type: last line`` of an exception the actor raised: how a shard's direct line answers a
    failed call, and how the Ray path reports one (``nemo_gen.fleet.faults.root_cause`` describes
    the task error's cause). Pydantic's closing pointer to its docs is no line worth keeping: the
    one before it says why."""
    text = [line for line in str(exc).strip().splitlines()
            if line.strip() and not line.strip().startswith("For further information visit")]
    return f"{type(exc).__name__}: {text[-1].strip() if text else ''}"


@dataclass(frozen=True)
class Failure:
    """Why one shard's call failed: its kind, the type of the exception the shard raised (or the
    transport's, for a lost or silent one) and that exception's last line."""

    kind: FailureKind
    type_name: str
    detail: str

    @property
    def infra(self) -> bool:
        """The shard's loss, silence or refusal for now, not a verdict on the input."""
        return self.kind is not FailureKind.DATA

    def __str__(self) -> str:  # the ledger's ``last_error`` form: "Type: message"
        return f"{self.type_name}: {self.detail}"


# -- a shard's account of itself -------------------------------------------------------------------


@dataclass(frozen=True)
class ShardInfo:
    """What a shard actor says about itself. The driver keeps the last one on its handle and
    replaces it (``with_version``), never edits it. ``unresponsive``: set only on the driver's
    stand-in for an actor found alive but silent while attaching (why it did not answer)."""

    slot: int | None  # the fleet position it serves; None while a spare
    weight_version: int | None  # None while it loads (half-loaded weights carry no version)
    index: int | None = None  # the index it was launched as
    fleet: str = ""
    weight_source: str | None = None  # the checkpoint its version came from
    restarts: int = 0  # restarts of the slot it serves, as of its installation
    actor_pid: int | None = None
    engine_pids: tuple[int, ...] = ()
    node_id: str | None = None
    node_ip: str | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    load_s: float | None = None
    async_engine: bool = False
    engine_core_start: str | None = None  # how its EngineCore was started (forkserver, spawn)
    direct_calls: int = 0  # weight_sync calls that came over its direct line
    generating: bool = False  # a batch is running now
    batch_steps: int = 0  # that batch's engine steps so far
    unresponsive: str | None = None
    sleep_level: int | None = None  # asleep at this vLLM level (nemo_gen.core.sleep); None: awake
    sleep_resident: tuple[str, ...] = ()  # while asleep, the wake tags brought back already

    def with_version(self, version: int | None) -> "ShardInfo":
        return dataclasses.replace(self, weight_version=version)

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for a progress event or a printed table (never sent back to a shard)."""
        out = dataclasses.asdict(self)
        out["engine_pids"] = list(self.engine_pids)
        return out


class ProbeStatus(str, enum.Enum):
    """What a probe showed about a shard (Ray Serve's ``ReplicaHealthCheckResponse``'s role)."""

    OK = "ok"  # idle and made a real token
    BUSY = "busy"  # generating, and made a step within the stall bound (or refused admission: alive)
    SKIPPED = "skipped"  # held on purpose (a refit or control call): no evidence either way
    FAILED = "failed"  # answered, but unwell (no step for too long, half-loaded weights, no engine)
    DEAD = "dead"  # the probe call found the actor or its engine gone: condemn at once
    UNANSWERED = "unanswered"  # no answer within the probe's deadline: one step of a streak

    @property
    def alive(self) -> bool:
        return self in (ProbeStatus.OK, ProbeStatus.BUSY)


@dataclass(frozen=True)
class ProbeReply:
    status: ProbeStatus
    detail: str | None = None  # why, when not alive; what was refused, when busy
    step_age_s: float | None = None  # since the busy engine's last step
    seconds: float | None = None  # the idle engine's one token took this long

    @property
    def ok(self) -> bool:
        """Alive, or skipped (a probe that must not count against the shard)."""
        return self.status.alive or self.status is ProbeStatus.SKIPPED


# -- a refit -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InFlight:
    """What a refit does to running requests (``refit.in_flight`` and its options, built by
    ``nemo_gen.settings.policies.in_flight``): ``drain`` holds new ones back until the running
    ones finish; ``keep`` / ``abort`` swap the weights under them, cutting those with more than
    ``max_staleness`` tokens from older weights (``keep``) or all (``abort``), resumed on the new
    weights when ``resume_aborted``; ``recompute_kv``: their KV recomputed as they resume."""

    mode: RefitMode
    resume_aborted: bool = True
    max_staleness: int | None = None
    recompute_kv: bool = False

    def __post_init__(self) -> None:  # a spelling ("keep") becomes the member; an unknown one fails here
        object.__setattr__(self, "mode", RefitMode(self.mode))

    @property
    def drain(self) -> bool:
        return self.mode is RefitMode.DRAIN



@dataclass(frozen=True)
class CheckRefit:
    """Phase 1: every worker can read the staged tensors (``entries`` of the file at ``path``,
    ``total`` bytes), and they are the trainer's (``digests``). Changes nothing; answered with
    the fewest entries any worker saw."""

    path: str
    total: int
    entries: tuple[Any, ...]
    timeout_s: float
    # The trainer's digest of each entry's bytes (``nemo_gen.core.digest``), in entries' order: a
    # shard whose bytes differ refuses, naming the first tensor. Empty: nothing to check.
    digests: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoadRefit:
    """Phase 2: load each ``(target, entries)`` group, then serve as ``version`` (from
    ``source``); ``in_flight`` (``refit.in_flight``): how running requests meet the new weights."""

    path: str
    total: int
    groups: tuple[Any, ...]
    version: int
    timeout_s: float
    source: str | None
    in_flight: InFlight


# -- vLLM's weight-sync protocol, one step at a time -----------------------------------------------


class SyncStep(str, enum.Enum):
    INIT = "init"  # set the transfer engine up (vLLM's init_info)
    START = "start"  # a session begins: requests held back or the batch frozen; no version claimed
    START_DRAFT = "start_draft"  # the same, loading into the speculative drafter
    UPDATE = "update"  # one chunk (vLLM's update_info)
    FINISH = "finish"  # the session ends: serve ``version``
    ABORT = "abort"  # the session ends without a new version
    SHUTDOWN = "shutdown"  # the transfer engine goes
    APPLY = "apply"  # start + one chunk + finish in one call


@dataclass(frozen=True)
class SyncInit:
    step: ClassVar[SyncStep] = SyncStep.INIT
    init_info: Mapping[str, Any]


@dataclass(frozen=True)
class SyncStart:
    step: ClassVar[SyncStep] = SyncStep.START
    in_flight: InFlight


@dataclass(frozen=True)
class SyncStartDraft:
    step: ClassVar[SyncStep] = SyncStep.START_DRAFT
    in_flight: InFlight


@dataclass(frozen=True)
class SyncUpdate:
    step: ClassVar[SyncStep] = SyncStep.UPDATE
    update_info: Mapping[str, Any]


@dataclass(frozen=True)
class SyncFinish:
    step: ClassVar[SyncStep] = SyncStep.FINISH
    version: int


@dataclass(frozen=True)
class SyncAbort:
    """``nothing_loaded``: no chunk reached the weights, so the shard may keep its old version."""

    step: ClassVar[SyncStep] = SyncStep.ABORT
    nothing_loaded: bool


@dataclass(frozen=True)
class SyncShutdown:
    step: ClassVar[SyncStep] = SyncStep.SHUTDOWN


@dataclass(frozen=True)
class SyncApply:
    step: ClassVar[SyncStep] = SyncStep.APPLY
    in_flight: InFlight
    update_info: Mapping[str, Any]
    target: WeightTarget
    version: int

    def __post_init__(self) -> None:  # as ``InFlight.mode``: the member, whatever spelling came
        object.__setattr__(self, "target", WeightTarget(self.target))


SyncPayload = Union[SyncInit, SyncStart, SyncStartDraft, SyncUpdate, SyncFinish, SyncAbort, SyncShutdown, SyncApply]
PAYLOADS: dict[SyncStep, type] = {p.step: p for p in SyncPayload.__args__}  # type: ignore[attr-defined]


@dataclass(frozen=True)
class SyncRequest:
    """One weight-sync step for one shard; its workers enforce ``timeout_s``."""

    payload: SyncPayload
    timeout_s: float

    def __post_init__(self) -> None:
        if type(self.payload) not in PAYLOADS.values():
            raise TypeError(f"not a weight-sync payload: {type(self.payload).__name__}")

    @property
    def step(self) -> SyncStep:
        return self.payload.step

    def chunk(self) -> Mapping[str, Any] | None:
        """The update this step carries (``update`` and ``apply``), else None."""
        return getattr(self.payload, "update_info", None) if self.step in (SyncStep.UPDATE, SyncStep.APPLY) else None


@dataclass(frozen=True)
class ApplyTimings:
    """Where a one-call apply's time went on the shard. ``entered_at`` / ``left_at``: the host's
    monotonic clock (``perf_counter`` is system-wide on Linux), so a caller on the same host can
    split its wait into the call's two legs."""

    actor_s: float
    engine_rpc_s: float
    worker_s: float
    entered_at: float
    left_at: float


@dataclass(frozen=True)
class SyncReply:
    """A weight-sync step's answer. ``layout_unknown``: the chunk was a layout's short form and
    this shard's workers do not hold that layout; nothing was touched, send the whole update."""

    layout_unknown: bool = False
    timings: ApplyTimings | None = None


# -- the engine's manifest ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineManifest:
    """What a refit of one target ("policy" or "draft") must provide, as the engine itself says
    (``expected_manifest``): each tensor's shape and dtype, the names that may be left out (tied
    output embeddings, and the drafter's tensors that are the policy's own), those shared ones
    alone, and whether the target exists at all (no drafter: ``available`` False)."""

    entries: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype)
    optional: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    available: bool = True

    @property
    def tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Name -> (shape, dtype), built on the reader's side."""
        return {name: (shape, dtype) for name, shape, dtype in self.entries}

    @classmethod
    def of(cls, answer: Mapping[str, Any]) -> "EngineManifest":
        """A worker's answer (``nemo_gen_expected_manifest``) as the wire's message."""
        return cls(tuple((n, tuple(shape), str(dtype)) for n, (shape, dtype) in answer["tensors"].items()),
                   tuple(answer.get("optional", ())), tuple(answer.get("shared", ())),
                   bool(answer.get("available", True)))


# -- LoRA adapters (``nemo_gen.fleet.adapters`` -> ``nemo_gen.shard.adapters``) -------------------------


@dataclass(frozen=True)
class AdapterModules:
    """Ask what the engine can adapt (module leaves, max rank) and which adapter ids it holds."""


@dataclass(frozen=True)
class AdapterLoad:
    """Build one adapter from the tensors staged at ``path`` and register it under ``engine_id``,
    after removing ``evict``; answers the ids held afterwards."""

    path: str
    total: int
    entries: tuple[tuple[str, tuple[int, ...], str, int], ...]
    config: Mapping[str, Any]
    engine_id: int
    evict: tuple[int, ...] = ()


@dataclass(frozen=True)
class AdapterRemove:
    """Drop these engine ids; answers the ids held afterwards."""

    engine_ids: tuple[int, ...]


@dataclass(frozen=True)
class AdapterState:
    """A shard's answer to an adapter call: the engine ids its engine holds afterwards and, for
    ``AdapterModules``, what it can adapt (module leaves, max rank, adapter slots)."""

    held: tuple[int, ...]
    supported: tuple[str, ...] = ()
    max_rank: int = 0
    capacity: int = 0


AdapterCall = Union[AdapterModules, AdapterLoad, AdapterRemove]
RefitMessage = Union[CheckRefit, LoadRefit, SyncRequest, AdapterModules, AdapterLoad, AdapterRemove]


@dataclass(frozen=True)
class ChannelAddress:
    """Where a driver on the shard's node reaches its ``weight_sync`` without Ray
    (``nemo_gen.shard.control_channel``): the socket, its key, and the node's IP to tell whether
    the driver is on that node."""

    address: str
    key: bytes
    node_ip: str


# The fields that carry vLLM's own payloads, as vLLM defines them: the only mappings on the wire.
VLLM_OWNED: frozenset[tuple[type, str]] = frozenset({
    (SyncInit, "init_info"), (SyncUpdate, "update_info"), (SyncApply, "update_info"), (AdapterLoad, "config"),
})


# -- the fleet record (``nemo_gen.fleet.record``: a detached actor that outlives every shard) -------


@dataclass(frozen=True)
class SlotRecord:
    """One slot's entry in the fleet record: its restart count and, once retired, why."""

    slot: int
    restarts: int = 0
    retired: str | None = None


@dataclass(frozen=True)
class FleetRecordState:
    """The fleet record's contents: the version the fleet serves, the checkpoint it came from
    (None for weights that came from a live trainer), and the slots' entries."""

    fleet: str
    weight_version: int | None = None
    weight_source: str | None = None
    slots: tuple[SlotRecord, ...] = ()

    def slot(self, slot: int) -> SlotRecord | None:
        return next((s for s in self.slots if s.slot == slot), None)

    def with_slot(self, entry: SlotRecord) -> "FleetRecordState":
        kept = tuple(s for s in self.slots if s.slot != entry.slot)
        return dataclasses.replace(self, slots=tuple(sorted(kept + (entry,), key=lambda s: s.slot)))
