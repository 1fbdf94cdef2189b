"""The fleet as a client of vLLM's weight-sync protocol (``VLLMWeightSyncClient``).

A trainer written against vLLM's refit API builds a trainer engine with a client and a
weight source, and calls ``send_weights()``; the engine drives ``init_weight_transfer_engine``
-> ``start_weight_update`` -> ``update_weights`` (chunks) -> ``finish_weight_update``. Given
``fleet.weight_sync_client()`` as that client, the trainer refits every shard of the fleet
through whichever backend the engines were started with (``refit.backend``): nemo_gen's
``nemo_gen_shm`` (any machine) or ``nemo_gen_ipc`` (a trainer on the engines' GPU), or vLLM's
``ipc`` / ``nccl``. nemo_gen's own trainer engines send their one chunk through
``apply_weight_update`` instead: the same protocol as one message per shard and one RPC into
its engine (three round trips are most of a colocated GPU refit's time).

The fleet's refit rules hold around the backend's bytes:
- one refit at a time (the fleet's refit lock, held from start to finish), versions only move
  forward, warm spares take every refit;
- every chunk's names and shapes are checked against the engine's own manifest before any
  shard sees it; a bad first chunk is refused with nothing changed (shards keep serving the old
  version), and so is a finish with no chunk;
- a shard that fails while loading, or a refit that ends without a tensor the model needs,
  never serves again with those weights: it is quarantined (recovery restarts it), the report
  says which and why, and the shards that succeeded serve the new version;
- NCCL: each shard's workers get their own ``rank_offset`` in the one group the trainer opens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from nemo_gen.core.members import Member
from nemo_gen.core.manifest import (
    OWN_BACKENDS,
    RefitError,
    RefitReport,
    TensorMeta,
    check_manifest,
    chunk_metas,
    layout_only,
    next_version,
    nccl_rank_offsets,
)
from nemo_gen.core.modes import WeightTarget
from nemo_gen.core.wire import (
    InFlight, SyncAbort, SyncApply, SyncFinish, SyncInit, SyncPayload, SyncRequest, SyncShutdown, SyncStart, SyncStartDraft,
    SyncUpdate,
)
from nemo_gen.fleet.refit import Refitter, metas_of
from nemo_gen.fleet.handles import ShardHandle

log = logging.getLogger(__name__)

# The workers enforce refit.timeout_s; these margins cover an actor that never answers (a
# chunk's broadcast takes longer than a control step).
_INIT_MARGIN_S = 30.0
_UPDATE_MARGIN_S = 60.0
_STEP_MARGIN_S = 10.0
_PER_RANK_LISTS = ("per-rank update lists address one multi-replica vLLM engine; a nemo_gen fleet takes one "
                   "update_info for all of its shards")


@dataclass
class _Session:
    target: WeightTarget
    version: int
    handles: dict[Member, ShardHandle]
    started: float
    lock: contextlib.ExitStack  # holds the fleet's refit lock from start to finish
    seen: dict[str, TensorMeta] = field(default_factory=dict)
    chunks: int = 0
    bytes: int = 0
    failed: dict[Member, str] = field(default_factory=dict)
    digest: str | None = None  # the trainer's, of a one-chunk update (every shard checked it)


class FleetWeightSyncClient:
    """``VLLMWeightSyncClient`` over every shard (and spare) of a fleet; see the module doc.
    ``version``: the version the next refit installs (default: the previous + 1). ``draft``:
    ``start_weight_update`` starts a draft update (vLLM's trainer engines only ever call that
    one; this is how they refit the speculative drafter). After each ``finish_weight_update``,
    ``report`` holds that refit's ``RefitReport``."""

    def __init__(self, refitter: Refitter, generation_config: dict[str, Any], backend: str,
                 check_open: Callable[[], None], version: int | None, draft: bool, in_flight: InFlight,
                 quantize: str = "engine"):
        self.refitter = refitter
        self.weights = refitter.weights
        self.digest = refitter.digest  # refit.digest: trainer engines send their digests, shards check them
        self._vllm_cfg = generation_config.get("vllm_cfg", {})
        self._backend = backend
        self._check_open = check_open
        self.in_flight = in_flight
        self.version = version
        self.draft = draft
        self.report: RefitReport | None = None
        # "fp8" under refit.quantize: trainer: trainer engines given this client quantize
        # (nemo_gen.vllm_ext.vllm_backend.trainer_source)
        self.quantize: str | None = "fp8" if quantize == "trainer" else None
        # shard label -> where its last one-call update went (seconds in the shard actor, in the
        # RPC into the engine, in the worker): the round trips' share of a refit, for benchmarks
        self.timings: dict[Any, dict[str, float]] = {}
        self._expected_metas: tuple[dict, dict[str, TensorMeta]] | None = None  # (manifest, as TensorMetas)
        self._checked: tuple | None = None  # the last whole chunk that passed: (info, layout, manifest, seen, bytes)
        self._init_info: dict[str, Any] | None = None  # the trainer's, once it set the backend up
        self._attached: set[str] = set()  # actor names the backend is set up on
        # actor name -> the layout number of the last update it loaded: it is sent that layout's
        # short form (``layout_only``) next time
        self._layouts: dict[str, Any] = {}
        self._driver = refitter.driver
        self._session: _Session | None = None

    # -- set-up ------------------------------------------------------------------------------

    def workers_per_shard(self) -> int:
        vc = self._vllm_cfg
        return int(vc.get("tensor_parallel_size", 1)) * int(vc.get("pipeline_parallel_size", 1))

    def _members(self) -> dict[Member, ShardHandle]:
        return self.refitter.refit_members()

    def nccl_world_size(self) -> int:
        """The NCCL group size a trainer must open (``NCCLTrainerInitInfo.world_size``): the
        trainer's one rank plus every worker of every shard and spare."""
        return 1 + self.workers_per_shard() * len(self._members())

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Set up the backend on every shard at once (NCCL rendezvous with the trainer). Shards
        that join later (replacements, promoted spares) are set up at the next start with the
        same info — except in an NCCL group, whose membership is fixed: they sit refits out."""
        members = self._members()
        per_shard = {k: dict(init_info) for k in members}
        if _is_group(init_info):  # NCCL: one group, each shard's workers after the last
            # (the trainer's ranks come first: rank_offset of them; vLLM's trainer engine has one)
            want = self.nccl_world_size() - 1 + int(init_info["rank_offset"])
            if init_info.get("world_size") != want:
                raise RefitError(
                    f"the NCCL group has world_size {init_info.get('world_size')}, but this fleet needs {want} "
                    f"(1 trainer rank + {len(members)} shard(s) x {self.workers_per_shard()} worker(s)); "
                    "use fleet.weight_sync_client().nccl_world_size()"
                )
            offsets = nccl_rank_offsets([self.workers_per_shard()] * len(members), first=init_info["rank_offset"])
            for key, offset in zip(members, offsets):
                per_shard[key]["rank_offset"] = offset
        errors = self._init(members, per_shard)
        if errors:
            raise RefitError(f"weight transfer could not be set up: {self._errors(errors)}")
        self._init_info = dict(init_info)

    def _init(self, members: dict[Member, ShardHandle], per_shard: dict[Member, dict]) -> dict[Member, str]:
        timeout = self._driver.timeouts.refit_s
        answers = self._driver.fan_out(members, {k: SyncRequest(SyncInit(per_shard[k]), timeout) for k in members},
                                       _INIT_MARGIN_S)
        for key, answer in answers.items():
            self._layouts.pop(members[key].name, None)  # a new transfer engine holds no layout
            if answer.ok:
                self._attached.add(members[key].name)
        return {k: a.error for k, a in answers.items() if not a.ok}

    def shutdown_weight_transfer_engine(self) -> None:
        timeout = self._driver.timeouts.refit_s
        errors = {k: a.error for k, a in self._driver.fan_out(
            self._members(), SyncRequest(SyncShutdown(), timeout), _STEP_MARGIN_S).items() if not a.ok}
        self._attached, self._init_info, self._layouts = set(), None, {}
        if errors:
            raise RefitError(f"weight transfer could not be shut down: {self._errors(errors)}")

    # -- one refit -----------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        self._start(WeightTarget.DRAFT if self.draft else WeightTarget.POLICY)

    def start_draft_weight_update(self) -> None:
        """The update that follows loads into the speculative drafter (names without 'draft.')."""
        self._start(WeightTarget.DRAFT)

    def _start(self, target: WeightTarget) -> None:
        with self._opened(target) as session:
            start = SyncStartDraft(self.in_flight) if target is WeightTarget.DRAFT else SyncStart(self.in_flight)
            failed = self._fan_out(session, start)
            # A shard that cannot start has loaded nothing: it sits this refit out.
            session.failed.update(failed)
            if len(session.failed) == len(session.handles):
                raise RefitError(f"no shard could start the weight update: {self._errors(session.failed)}")
            session.lock = session.lock.pop_all()  # held until finish or abort
        self._session = session

    @contextlib.contextmanager
    def _opened(self, target: WeightTarget):
        """A new session: the refit lock taken, its version chosen, the shards it reaches
        admitted — nothing sent to them yet. The lock is released when the block ends, unless
        the block moved it out of ``session.lock`` (``pop_all``)."""
        if self._session is not None:
            raise RefitError("a weight update is already in progress on this client: finish it first")
        self._check_open()
        if target is WeightTarget.DRAFT and not self.refitter.expected(WeightTarget.DRAFT).available:
            raise RefitError("a draft weight update, but the engines run no draft model "
                             "(generation.vllm_kwargs.speculative_config)")
        with contextlib.ExitStack() as lock:
            lock.enter_context(self.weights.refitting())
            self.refitter.ready_weights()
            version = next_version(self.weights.version, self.version)
            handles = self._admit(self._members())
            if not handles:
                raise RefitError("no shard can take this weight update (none is set up for the backend)")
            yield _Session(target, version, handles, time.perf_counter(), lock)

    def apply_weight_update(self, update_info: dict[str, Any], weight_version: str | int | None = None) -> RefitReport:
        """``start_weight_update`` + one ``update_weights(update_info)`` + ``finish_weight_update``
        as one call to each shard, and one RPC into its engine: a refit of one chunk (what
        nemo_gen's own trainer engines send) costs one round trip instead of three — at a
        colocated GPU refit's scale (tens of milliseconds), most of its time. The same checks,
        versions and report as the three steps, and one more guarantee: the chunk is checked
        whole (names, shapes, nothing the model needs left out) before any shard sees it, so a
        bad one changes nothing anywhere."""
        target = WeightTarget.DRAFT if self.draft else WeightTarget.POLICY
        if isinstance(update_info, list):
            raise RefitError(_PER_RANK_LISTS)
        with self._opened(target) as session:
            self._check_whole(session, update_info)
            session.chunks = 1
            version = self._final_version(session, weight_version)
            answers = self._send(session, update_info,
                                 lambda update: SyncApply(self.in_flight, update, target, version))
            for key, answer in answers.items():
                if answer.ok:
                    self.timings[key.label] = dataclasses.asdict(answer.value.timings)
                else:
                    session.failed[key] = f"refit to version {version} failed: {answer.error}"
            return self._complete(session, version)

    def _check_whole(self, session: _Session, update_info: dict[str, Any]) -> None:
        """A one-call update's chunk against the engine's manifest, with nothing the model needs
        left out. A trainer sends the same update info over and over (``nemo_gen_ipc``'s for an
        unchanged layout is the very same object, its ``layout`` number unchanged): checked once
        per layout and target, not per refit (450 tensors: ~1 ms of the client's time)."""
        exp = self.refitter.expected(session.target)
        layout = update_info.get("layout")
        cached = self._checked
        if (layout is not None and cached is not None and cached[0] is update_info and cached[1] == layout
                and cached[2] is exp):
            session.seen, session.bytes = dict(cached[3]), cached[4]
            return
        metas = chunk_metas(update_info, self.refitter.engine_dtype)
        if metas is None:
            return
        self._check_chunk(session, metas)
        missing = self._missing(session)
        if missing:
            raise RefitError(f"refit refused: the weight update leaves out {missing}")
        self._checked = (update_info, layout, exp, dict(session.seen), session.bytes)

    def update_weights(self, update_info: dict[str, Any] | list) -> None:
        session = self._require_session()
        if isinstance(update_info, list):
            self._abort(restore=session.chunks == 0)
            raise RefitError(_PER_RANK_LISTS)
        metas = chunk_metas(update_info, self.refitter.engine_dtype)
        try:
            if metas is not None:
                self._check_chunk(session, metas)
        except RefitError:
            loaded = session.chunks > 0
            self._abort(restore=not loaded, reason="a later chunk was refused" if loaded else None)
            raise
        session.chunks += 1
        for key, answer in self._send(session, update_info, SyncUpdate).items():
            if not answer.ok:
                session.failed[key] = f"refit to version {session.version} failed: {answer.error}"

    def finish_weight_update(self, weight_version: str | int | None = None) -> RefitReport:
        session = self._require_session()
        if session.chunks == 0:
            self._abort(restore=True)
            raise RefitError("the weight update carried no chunk: nothing was changed")
        try:
            version = self._final_version(session, weight_version)
            missing = self._missing(session)
            if missing:
                for key in session.handles:
                    session.failed.setdefault(key, f"the refit to version {version} ended without {missing}")
            ok = {k: h for k, h in session.handles.items() if k not in session.failed}
            for key, error in self._fan_out(session, SyncFinish(version), only=ok).items():
                session.failed[key] = f"refit to version {version} failed while finishing: {error}"
            self._fan_out(session, SyncAbort(nothing_loaded=False),
                          only={k: session.handles[k] for k in session.failed})
            return self._complete(session, version)
        finally:
            self._session = None
            session.lock.close()

    def _complete(self, session: _Session, version: int) -> RefitReport:
        """Settle every shard of an ended update (``session.failed``: those that must not serve
        it) and move the fleet's version when one took it."""
        report = RefitReport(version=version, bytes=session.bytes, tensors=len(session.seen), stage_seconds=0.0,
                             load_seconds=time.perf_counter() - session.started, digest=session.digest)
        for key in session.handles:
            self._settle(report, key, version, session.failed.get(key))
        if any(s.ok for s in report.shards):
            # No staged bytes: the staging file, if any, holds an older version.
            self.weights.landed(version, None, None, session.digest)
            self.refitter.count(report)
        self.report = report
        return report

    def abort_weight_update(self, reason: str = "the trainer abandoned the weight update") -> RefitReport | None:
        """End an update the trainer cannot finish (its broadcast failed, it was interrupted):
        the lock is released and requests flow again. With no chunk sent, every shard keeps its
        version; after one, shards may hold half-loaded weights and are quarantined. Call it from
        the thread that started the update (the fleet's refit lock is held by that thread)."""
        session = self._session
        if session is None:
            return None
        self.report = None
        self._abort(restore=session.chunks == 0, reason=reason)
        return self.report

    # -- helpers -------------------------------------------------------------------------------

    def _admit(self, handles: dict[Any, Any]) -> dict[Any, Any]:
        """The shards this refit reaches: all of them, once the backend is set up on newcomers."""
        if self._init_info is None:
            return handles
        new = {k: h for k, h in handles.items() if h.name not in self._attached}
        if new and _is_group(self._init_info):
            log.warning("shards %s joined after the NCCL group formed: they sit this refit out (STALE "
                        "until a checkpoint refit or a new group)", [k.label for k in new])
        elif new:
            for key, error in self._init(new, {k: dict(self._init_info) for k in new}).items():
                log.warning("shard %s: weight transfer could not be set up: %s", key.label, error)
        return {k: h for k, h in handles.items() if h.name in self._attached}

    def _require_session(self) -> _Session:
        if self._session is None:
            raise RefitError("no weight update in progress: call start_weight_update first")
        return self._session

    def _check_chunk(self, session: _Session, metas: list[TensorMeta]) -> None:
        exp = self.refitter.expected(session.target)
        what = "draft model" if session.target is WeightTarget.DRAFT else "model"
        again = sorted(m.name for m in metas if m.name in session.seen)
        if again:
            raise RefitError(f"refit refused: tensors sent twice in one update: {', '.join(again[:8])}")
        if self._expected_metas is None or self._expected_metas[0] is not exp:
            self._expected_metas = (exp, metas_of(exp))
        check_manifest(self._expected_metas[1], metas, optional=exp.optional, partial=True, what=what)
        shared = sorted(set(exp.shared) & {m.name for m in metas})
        if shared and self._backend not in OWN_BACKENDS:
            # our backends skip these on the workers; vLLM's would write through them.
            raise RefitError(f"refit refused: the drafter shares {', '.join(shared)} with the policy; "
                             "a draft update must not carry them")
        for m in metas:
            session.seen[m.name] = m
            session.bytes += m.nbytes

    def _final_version(self, session: _Session, label: str | int | None) -> int:
        """vLLM lets a trainer name the version at finish (a free-form label); a whole number
        newer than the fleet's becomes the version, anything else is logged and the session's
        version stands (the weights are loaded by now: refusing here would strand them)."""
        if label is None:
            return session.version
        try:
            return next_version(self.weights.version, int(label))
        except (TypeError, ValueError, RefitError) as exc:
            log.warning("weight version %r not used (%s); the refit installs version %d", label, exc, session.version)
            return session.version

    def _missing(self, session: _Session) -> str | None:
        full = session.target is WeightTarget.POLICY or self.refitter.draft_full
        if not full or not session.seen:
            return None
        exp = self.refitter.expected(session.target)
        missing = sorted(set(exp.tensors) - set(session.seen) - set(exp.optional))
        if not missing:
            return None
        return f"{len(missing)} tensor(s) the model needs: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")

    def _send(self, session: _Session, update_info: dict[str, Any],
              payload: Callable[[dict[str, Any]], SyncApply | SyncUpdate]) -> dict[Member, Any]:
        """Fan one chunk out (``payload`` wraps the update in its step: ``SyncApply`` or
        ``SyncUpdate``) to the session's shards still in the update; key -> Outcome. A shard whose last
        loaded update had this layout is sent the layout's short form. One that does not hold it
        after all (another client refit it since) answers so before touching anything, and is
        sent the whole update."""
        handles = {k: h for k, h in session.handles.items() if k not in session.failed}
        session.digest = update_info.get("digest") if session.chunks <= 1 else None
        short = layout_only(update_info)
        timeout = self._driver.timeouts.refit_s

        def request(key: Member, whole: bool = False) -> SyncRequest:
            held = not whole and short is not None and self._layouts.get(handles[key].name) == short["layout"]
            return SyncRequest(payload(short if held else update_info), timeout)

        answers = self._driver.fan_out(handles, {k: request(k) for k in handles}, _UPDATE_MARGIN_S)
        again = {k: handles[k] for k, a in answers.items() if a.ok and a.value.layout_unknown}
        if again:
            answers.update(self._driver.fan_out(again, {k: request(k, whole=True) for k in again}, _UPDATE_MARGIN_S))
        for key, answer in answers.items():
            if answer.ok and short is not None:
                self._layouts[handles[key].name] = short["layout"]
            else:  # its workers' views are unknown now: the next update goes whole
                self._layouts.pop(handles[key].name, None)
        return answers

    def _fan_out(self, session: _Session, payload: SyncPayload, only: dict | None = None) -> dict[Any, str]:
        """Run one protocol step on the session's shards at once; returns key -> error."""
        if only is None:  # every shard still in the update
            only = {k: h for k, h in session.handles.items() if k not in session.failed}
        timeout = self._driver.timeouts.refit_s
        # The workers enforce ``timeout``; the margin covers a frozen actor that never answers.
        margin = _UPDATE_MARGIN_S if isinstance(payload, SyncUpdate) else _STEP_MARGIN_S
        answers = self._driver.fan_out(only, SyncRequest(payload, timeout), margin)
        return {k: a.error for k, a in answers.items() if not a.ok}

    def _abort(self, restore: bool, reason: str | None = None) -> None:
        """End the session on every shard; ``restore``: nothing was loaded, shards keep serving
        the old version. Otherwise they may hold half-loaded weights and are quarantined."""
        session = self._session
        if session is None:
            return
        try:
            errors = self._fan_out(session, SyncAbort(nothing_loaded=restore), only=session.handles)
            if not restore or errors:
                report = RefitReport(version=session.version, bytes=session.bytes, tensors=len(session.seen),
                                     stage_seconds=0.0, load_seconds=time.perf_counter() - session.started)
                for key in session.handles:
                    if not restore or key in errors:
                        self._settle(report, key, session.version,
                                     session.failed.get(key) or errors.get(key) or reason or "weight update aborted")
                self.report = report
        finally:
            self._session = None
            session.lock.close()

    def _settle(self, report: RefitReport, member: Member, version: int, error: str | None) -> None:
        self.refitter.settle(report, member, version, error, report.load_seconds)

    @staticmethod
    def _errors(failed: Mapping[Member, str | None]) -> str:
        return "; ".join(f"shard {k.label}: {e}" for k, e in failed.items())


def _is_group(init_info: dict[str, Any]) -> bool:
    """A collective backend's init info (NCCL): every member joins one group at once."""
    return "rank_offset" in init_info
