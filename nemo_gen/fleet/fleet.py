"""``GenerationFleet``: N vLLM shards on Ray behind one generate call.

The fleet owns the driver-side view: the health ledger (who may serve), the least-loaded
selector, the tokenizer (prompts are tokenized once, on the driver, so a too-long prompt is
answered with an error before it costs a round trip), and the shard handles. Requests on a
shard that dies are re-routed to the survivors; every result says which shard and weight
version produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import ray

from nemo_gen.core.fleet_health import (
    SERVING_STATES,
    FleetHealthPolicy,
    GenerationFleetHealth,
    HealthyShardSelector,
    ShardState,
)
from nemo_gen.core.retry import describe, is_retriable
from nemo_gen.core.results import GenerationRequest, GenerationResult, too_long_error
from nemo_gen.core.sampling import resolve_sampling
from nemo_gen.errors import NemoGenError, RequestError, ShardDiedError, ShardUnavailableError
from nemo_gen.fleet.cluster import RayConnection, cluster_resources, init_ray, shutdown_ray
from nemo_gen.fleet.resolve import ResolvedGeneration, load_tokenizer, resolve_generation
from nemo_gen.fleet.processes import alive as _alive
from nemo_gen.fleet.record import create_record, find_record, remove_record
from nemo_gen.fleet.processes import reap
from nemo_gen.fleet.shard import ShardHandle, ShardSpec, call_shard, launch_shard, stop_shard
from nemo_gen.settings import NemoGenSettings

if TYPE_CHECKING:  # pragma: no cover
    from nemo_gen.core.refit import RefitReport
    from nemo_gen.fleet.weight_sync import FleetWeightSyncClient

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]
# How often a waiting generate call looks at the ledger (a shard condemned meanwhile).
_POLL_S = 0.1
# progress(shard_index, event, detail): "loading" | "ready" | "failed"
ProgressFn = Callable[[int, str, dict[str, Any]], None]


@dataclass
class ShardStatus:
    index: int
    state: str
    weight_version: int | None
    actor_pid: int | None
    engine_pids: list[int] = field(default_factory=list)
    node_id: str | None = None
    restarts: int = 0
    last_error: str | None = None
    name: str | None = None  # the Ray actor serving the slot (a replacement or promoted spare)
    # Processes a dead actor of this slot left running (RAY_process_group_cleanup_enabled=0).
    orphans: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def launch_shards(specs: Iterable[ShardSpec], progress: ProgressFn | None = None) -> list[ShardHandle]:
    """Start shards in parallel. If any fails, the others are stopped and the first error raised."""
    specs = list(specs)

    def one(spec: ShardSpec) -> ShardHandle:
        if progress:
            progress(spec.index, "loading", {})
        t0 = time.monotonic()
        try:
            handle = launch_shard(spec)
        except Exception as exc:
            if progress:
                progress(spec.index, "failed", {"error": str(exc)})
            raise
        if progress:
            progress(spec.index, "ready", {**handle.info, "seconds": time.monotonic() - t0})
        return handle

    with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
        futures = [pool.submit(one, s) for s in specs]
        handles, errors = [], []
        for fut in futures:
            try:
                handles.append(fut.result())
            except Exception as exc:  # collected: one failure must not leak the others' engines
                errors.append(exc)
    if errors:
        for handle in handles:
            stop_shard(handle)
        raise errors[0]
    return handles


class GenerationFleet:
    """A running fleet. Build it with ``GenerationFleet.launch(settings)``; use as a context
    manager, or call ``shutdown()`` (idempotent)."""

    def __init__(
        self,
        resolved: ResolvedGeneration,
        shards: Sequence[ShardHandle],
        ray_connection: RayConnection | None = None,
        tokenizer=None,
        attached: bool = False,
        spares: Sequence[ShardHandle] = (),
        watch: bool = True,
        record: Any = None,
        recorded: dict[str, Any] | None = None,
    ):
        self.resolved = resolved
        self.settings = resolved.settings
        self._shards: dict[int, ShardHandle] = {h.index: h for h in shards}
        self._spares: dict[str, ShardHandle] = {h.name: h for h in spares}
        self._ray = ray_connection
        self._record = record  # the fleet's record actor (nemo_gen.fleet.record), when there is one
        self._tokenizer = tokenizer or load_tokenizer(resolved.tokenizer_dir)
        h = self.settings.health
        self.health = GenerationFleetHealth(
            shard_count=self.settings.fleet.num_shards,
            policy=FleetHealthPolicy(
                unhealthy_threshold=h.unhealthy_threshold,
                healthy_threshold=h.healthy_threshold,
                max_restart_attempts_per_shard=h.max_restart_attempts_per_shard,
                min_healthy_shards=h.min_healthy_shards,
            ),
        )
        self.selector = HealthyShardSelector(self.health)
        # eval: engines loaded the checkpoint (version 0). train: dummy weights, STALE until the
        # first refit — nothing re-admits a shard but a refit.
        self.weight_version: int | None = 0 if self.settings.is_eval() else None
        self.weight_source: str | None = None  # the checkpoint the current version came from
        self.staged_refit = None  # the staging file's contents, while they are the current version
        self.refit_lock = threading.RLock()  # one refit (or catch-up) at a time: they share staging
        self.orphans: list[dict[str, Any]] = []  # processes left by dead shards (cleanup disabled)
        self._lock = threading.RLock()
        self._slot_locks: dict[int, threading.Lock] = {}
        self._closed_event = threading.Event()
        self._recovering_slots: set[int] = set()
        self._spares_starting = 0
        self._detached = False
        if attached:
            # The record says which version the fleet serves (it outlives every shard); without
            # one, the newest version any shard holds.
            versions = {h.index: h.info.get("weight_version") for h in shards}
            known = [v for v in versions.values() if v is not None]
            self.weight_version = max(known) if known else None
            self.weight_source = next(
                (h.info.get("weight_source") for h in shards if h.info.get("weight_version") == self.weight_version
                 and h.info.get("weight_source")),
                None,
            )
            if recorded is not None:
                self.weight_version = recorded.get("weight_version")
                self.weight_source = recorded.get("weight_source") or self.weight_source
            for index in range(self.health.shard_count):
                if index in self._shards:  # the budget spans every process that attaches
                    self.health.restore_restart_attempts(index, int(self._shards[index].info.get("restarts") or 0))
                if versions.get(index, "missing") == "missing":
                    self.health.mark_dead(index, "shard actor not found when attaching")
                elif self._shards[index].info.get("unresponsive"):
                    self.health.mark_dead(index, f"not answering when attaching: {self._shards[index].info['unresponsive']}")
                elif versions[index] is None or versions[index] != self.weight_version:
                    self.health.mark_loaded(index)
                else:
                    self.health.report_refit(index, versions[index])
        elif not self.settings.is_eval():
            for index in self._shards:
                self.health.mark_loaded(index)
        self._closed = False
        self._manifest_cache: dict[str, dict[str, Any]] = {}
        self._staging = None
        self._spare_seq = 1 + max(
            [int(n.rsplit("-", 1)[1]) for n in self._spares if n.rsplit("-", 1)[1].isdigit()]
            + [len(resolved.spares) - 1],
        )
        self._background = ThreadPoolExecutor(max_workers=4, thread_name_prefix="nemo-gen-recovery")
        self._monitor = None
        if watch and h.enabled:
            self._start_monitor()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def launch(
        cls, settings: NemoGenSettings | None = None, progress: ProgressFn | None = None
    ) -> "GenerationFleet":
        """Configure the environment, start/attach Ray, resolve, and start every shard."""
        from nemo_gen.environment import configure_environment

        settings = settings or NemoGenSettings.load()
        configure_environment(settings)  # before Ray: the raylet inherits it
        conn = init_ray(settings.ray)
        try:
            resolved = resolve_generation(settings, cluster_resources())
            started = launch_shards(resolved.shards + resolved.spares, progress)
            record = create_record(settings.fleet.name, settings.ray.namespace, 0 if settings.is_eval() else None)
        except BaseException:
            if conn.owned:
                shutdown_ray(conn)
            raise
        shards = [h for h in started if h.info.get("slot") is not None]
        spares = [h for h in started if h.info.get("slot") is None]
        return cls(resolved, shards, ray_connection=conn if conn.owned else None, spares=spares, record=record)

    @classmethod
    def attach(cls, settings: NemoGenSettings, watch: bool = True) -> "GenerationFleet":
        """Connect to a fleet that is already running (its detached, named shard actors on the
        Ray cluster at ``ray.address``). Shards at the newest weight version serve; any that lag
        behind stay STALE until the next refit. ``detach()`` leaves the fleet running."""
        from nemo_gen.environment import configure_environment
        from nemo_gen.fleet.shard import find_fleet_actors

        configure_environment(settings)
        conn = init_ray(settings.ray)
        resolved = resolve_generation(settings, cluster=None)
        actors = find_fleet_actors(settings.fleet.name, settings.ray.namespace)
        slots: dict[int, ShardHandle] = {}
        for h in sorted(actors, key=lambda h: -1 if h.info.get("weight_version") is None else h.info["weight_version"]):
            if h.index is not None and h.index < settings.fleet.num_shards:
                if h.index in slots:  # two claim a slot (a promotion cut short): newer weights win
                    log.warning("slot %d is claimed by %s and %s; using %s", h.index, slots[h.index].name, h.name, h.name)
                slots[h.index] = h
        found = list(slots.values())
        spares = [h for h in actors if h.index is None]
        record, recorded = find_record(settings.fleet.name, settings.ray.namespace)
        if not found and record is None:
            if conn.owned:
                shutdown_ray(conn)
            raise ShardUnavailableError(
                f"no fleet named {settings.fleet.name!r} is running in Ray namespace "
                f"{settings.ray.namespace!r} at {conn.address} (start one with `nemo-gen fleet up`)"
            )
        return cls(
            resolved, found, ray_connection=conn if conn.owned else None, attached=True, spares=spares, watch=watch,
            record=record, recorded=recorded,
        )

    def detach(self) -> None:
        """Disconnect from an attached fleet without stopping it (the staging file this
        process wrote is removed: the shards only read it during a refit). Spares being started
        are waited for and left running: they belong to the fleet, not to this process."""
        self._detached = True
        self._close_background()
        if self._staging is not None:
            self._staging.close()
        shutdown_ray(self._ray)

    def __enter__(self) -> "GenerationFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- generation --------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return int(self.resolved.max_model_len or 0)

    def _requests(self, prompts: Sequence[Prompt]) -> tuple[list[GenerationRequest], dict[int, GenerationResult]]:
        """Tokenize on the driver; too-long and empty prompts become error results right away."""
        if isinstance(prompts, (str, bytes)):
            raise RequestError("prompts must be a list of strings or token-id lists, not one string")
        requests, rejected = [], {}
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids = self._tokenizer(prompt, add_special_tokens=True)["input_ids"]
                req = GenerationRequest(index=i, prompt_token_ids=list(ids), prompt=prompt)
            elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
                req = GenerationRequest(index=i, prompt_token_ids=list(prompt), prompt=None)
            else:
                raise RequestError(f"prompt {i} must be a string or a list of token ids", index=i)
            error = too_long_error(len(req.prompt_token_ids), self.max_model_len) if self.max_model_len else None
            if error:
                rejected[i] = GenerationResult.failed(req, error)
            else:
                requests.append(req)
        return requests, rejected

    def _sampling(self, overrides: dict[str, Any]) -> dict[str, Any]:
        return resolve_sampling(self.resolved.generation_config, overrides)

    def generate(self, prompts: Sequence[Prompt], **sampling: Any) -> list[GenerationResult]:
        """One ``GenerationResult`` per prompt, in order. Sampling keywords are the generation
        config's (max_new_tokens, temperature, top_p, top_k, stop_strings, stop_token_ids).

        A shard that dies (or is condemned by its probes) while it holds requests: they are
        sent again to the serving shards, and whatever it might still answer is dropped, so
        every prompt gets exactly one result."""
        self._check_open()
        params = self._sampling(sampling)
        requests, results = self._requests(prompts)
        pending = requests
        deadline_s = self.settings.fleet.request_timeout_s
        while pending:
            assignment = self._assign(pending)
            inflight = {}  # ref -> (shard, actor name, batch, deadline)
            for shard, batch in assignment.items():
                handle = self._shards[shard]
                ref = handle.actor.generate.remote(batch, params)
                inflight[ref] = (shard, handle.name, batch, time.monotonic() + deadline_s)
            pending = []
            try:
                while inflight:
                    ready, _ = ray.wait(list(inflight), num_returns=1, timeout=_POLL_S)
                    for ref in ready:
                        shard, name, batch, _ = inflight.pop(ref)
                        try:
                            out = ray.get(ref)
                        except Exception as exc:
                            if not is_retriable(exc):
                                raise
                            # The shard or its engine is gone: condemn it, re-route its work.
                            self._condemn(shard, name, exc)
                            pending.extend(batch)
                            continue
                        self.health.report_success(shard)
                        for req, raw in zip(batch, out["results"]):
                            results[req.index] = self._result(req, raw, out["shard"], out["weight_version"])
                    now = time.monotonic()
                    for ref, (shard, name, batch, deadline) in list(inflight.items()):
                        lost = not self.is_current(shard, name) or self.health.state_of(shard) not in SERVING_STATES
                        if lost or now > deadline:
                            # Condemned meanwhile (probes, death watch) or wedged: answer elsewhere.
                            del inflight[ref]
                            ray.cancel(ref)
                            if not lost:
                                self._condemn(shard, name, TimeoutError(f"no answer within fleet.request_timeout_s={deadline_s:g}s"))
                            pending.extend(batch)
            finally:
                for shard, batch in assignment.items():
                    for _ in batch:
                        self.selector.release(shard)
        return [results[i] for i in range(len(prompts))]

    async def generate_async(self, prompt: Prompt, **sampling: Any) -> GenerationResult:
        """The per-request awaitable for async RL loops; many may be in flight at once."""
        self._check_open()
        params = self._sampling(sampling)
        requests, rejected = self._requests([prompt])
        if rejected:
            return rejected[0]
        req = requests[0]
        deadline_s = self.settings.fleet.request_timeout_s
        while True:
            shard = self._pick()
            handle = self._shards[shard]
            try:
                future = asyncio.wrap_future(handle.actor.generate.remote([req], params).future())
                deadline = time.monotonic() + deadline_s
                while True:
                    done, _ = await asyncio.wait({future}, timeout=_POLL_S)
                    if done:
                        out = future.result()
                        break
                    if not self.is_current(shard, handle.name) or self.health.state_of(shard) not in SERVING_STATES:
                        future.cancel()
                        out = None
                        break
                    if time.monotonic() > deadline:
                        future.cancel()
                        raise TimeoutError(f"no answer within fleet.request_timeout_s={deadline_s:g}s")
            except Exception as exc:
                if not is_retriable(exc):
                    raise
                self._condemn(shard, handle.name, exc)
                continue
            finally:
                self.selector.release(shard)
            if out is None:
                continue  # the shard was condemned while it held the request: ask another
            self.health.report_success(shard)
            return self._result(req, out["results"][0], out["shard"], out["weight_version"])

    def _pick(self) -> int:
        if self.weight_version is None:
            raise ShardUnavailableError(
                f"fleet {self.settings.fleet.name!r} runs in fleet.mode=train and has not been refit "
                "yet: its engines hold dummy weights and serve nothing until the first refit"
            )
        try:
            shard = self.selector.next_shard()
        except ShardUnavailableError:
            self.health.raise_if_exhausted()
            raise
        self.selector.acquire(shard)
        return shard

    def _assign(self, requests: list[GenerationRequest]) -> dict[int, list[GenerationRequest]]:
        """Least-loaded routing, one request at a time, so a batch spreads over the shards."""
        assignment: dict[int, list[GenerationRequest]] = {}
        try:
            for req in requests:
                assignment.setdefault(self._pick(), []).append(req)
        except BaseException:
            for shard, batch in assignment.items():  # nothing was sent: give the slots back
                for _ in batch:
                    self.selector.release(shard)
            raise
        return assignment

    def _condemn(self, shard: int, name: str, exc: BaseException) -> None:
        """A call on the shard failed for an infra reason: a dead actor or engine is certain,
        not a streak — straight to DEAD (and recovery, when on)."""
        log.warning("shard %d failed: %s; re-routing its requests", shard, exc)
        self.shard_lost(shard, name, describe(exc).splitlines()[0])

    def _result(self, req: GenerationRequest, raw: dict[str, Any], shard: int, version: int | None) -> GenerationResult:
        if raw.get("error"):
            return GenerationResult.failed(req, raw["error"], shard=shard)
        text = raw.get("text")
        if not text and raw["token_ids"] and self.resolved.generation_config["vllm_cfg"].get("skip_tokenizer_init"):
            text = self._tokenizer.decode(raw["token_ids"], skip_special_tokens=True)
        return GenerationResult(
            index=req.index,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            text=text or "",
            token_ids=raw["token_ids"],
            logprobs=raw["logprobs"],
            finish_reason=raw["finish_reason"],
            shard=shard,
            weight_version=version,
        )

    # -- refit -------------------------------------------------------------------------------

    def refit(self, source: Any, version: int | None = None) -> "RefitReport":
        """Push new weights into every shard that holds an engine; see ``nemo_gen.fleet.refit``.

        ``source``: a checkpoint directory, a ``WeightSource``, or live tensors (an ``nn.Module``,
        a name->tensor mapping, or a callable returning one). ``version`` defaults to the
        previous + 1. Raises ``RefitError`` (nothing changed) for a bad manifest; a shard that
        fails while loading is quarantined and listed in the report."""
        from nemo_gen.fleet.refit import run_refit

        self._check_open()
        return run_refit(self, source, version)

    def weight_sync_client(self, version: int | None = None, draft: bool = False) -> "FleetWeightSyncClient":
        """This fleet as a ``VLLMWeightSyncClient``: hand it to one of vLLM's trainer engines
        (``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)``) and
        ``send_weights()`` refits every shard through the engines' ``refit.backend``, with the
        fleet's versions, checks and quarantine; see ``nemo_gen.fleet.weight_sync``. ``draft``:
        the updates go to the speculative drafter (names without the ``draft.`` prefix)."""
        from nemo_gen.fleet.weight_sync import FleetWeightSyncClient

        self._check_open()
        return FleetWeightSyncClient(self, version, draft=draft)

    @property
    def engine_dtype(self) -> str:
        """The dtype the engines compute in (refit stages floating tensors in it)."""
        return next(h.info["dtype"] for h in self.shards if h.info.get("dtype"))

    def staging(self):
        """The fleet's shared-memory staging file, created on first refit and reused."""
        if self._staging is None:
            from nemo_gen.refit.staging import SharedMemoryStaging

            self._staging = SharedMemoryStaging(self.settings.refit.staging_dir, self.settings.fleet.name)
        return self._staging

    # -- membership: slots, spares, loss and recovery --------------------------------------

    def handle(self, slot: int) -> ShardHandle | None:
        """The actor serving ``slot`` now (it changes when the shard is replaced)."""
        with self._lock:
            return self._shards.get(slot)

    def is_current(self, slot: int, name: str) -> bool:
        """Is actor ``name`` still the one serving ``slot``? (News about a replaced actor is old news.)"""
        handle = self.handle(slot)
        return handle is not None and handle.name == name

    def install(self, slot: int, handle: ShardHandle) -> None:
        """Make ``handle`` the actor serving ``slot`` and watch it."""
        handle.index = slot
        with self._lock:
            self._shards[slot] = handle
        if self._monitor is not None:
            self._monitor.watch(slot, handle)

    def slot_lock(self, slot: int) -> threading.Lock:
        """Serializes recovery of one slot (the monitor and a flow may both try)."""
        with self._lock:
            return self._slot_locks.setdefault(slot, threading.Lock())

    def spare_handles(self) -> list[ShardHandle]:
        with self._lock:
            return list(self._spares.values())

    def take_spare(self) -> ShardHandle | None:
        """A spare at the fleet's weight version, removed from the spare pool; None if none is."""
        with self._lock:
            spares = list(self._spares.values())
        for spare in spares:
            try:
                info = call_shard(spare, "info", timeout_s=10)
            except ShardDiedError as exc:
                self.drop_spare(spare.name, str(exc))
                continue
            if info.get("weight_version") != self.weight_version:
                continue  # still catching up
            with self._lock:
                if self._spares.pop(spare.name, None) is None:
                    continue  # taken by another recovery meanwhile
            spare.info = info
            return spare
        return None

    def drop_spare(self, name: str, reason: str) -> None:
        """Remove a spare that died or failed a refit, stop it, and start another."""
        with self._lock:
            handle = self._spares.pop(name, None)
        if handle is None:
            return
        log.warning("spare %s dropped: %s", name, reason)
        self._submit(self._stop_and_reap, handle)
        self.replenish_spares()

    def replenish_spares(self) -> None:
        """Start spares in the background until ``fleet.spares`` are up (or coming up)."""
        with self._lock:
            missing = self.settings.fleet.spares - len(self._spares) - self._spares_starting
            self._spares_starting += max(0, missing)
        for _ in range(max(0, missing)):
            self._submit(self._start_spare)

    def _start_spare(self) -> None:
        from nemo_gen.fleet.recovery import catch_up

        with self._lock:
            seq, self._spare_seq = self._spare_seq, self._spare_seq + 1
        template = (self.resolved.spares or self.resolved.shards)[0]
        spec = dataclasses.replace(
            template, index=self.settings.fleet.num_shards + seq, name=f"{self.settings.fleet.name}-spare-{seq}", spare=True
        )
        try:
            handle = launch_shard(spec)
            if self._closed and not self._detached:  # shut down meanwhile: it has no fleet
                stop_shard(handle)
                return
            catch_up(self, ("spare", handle.name), handle)
        except Exception as exc:
            log.warning("could not start spare %s: %s", spec.actor_name, describe(exc).splitlines()[0])
            return
        finally:
            with self._lock:
                self._spares_starting -= 1
        with self._lock:
            self._spares[handle.name] = handle
        if self._monitor is not None:
            self._monitor.watch(("spare", handle.name), handle)

    def shard_lost(self, key: Any, name: str, reason: str) -> None:
        """The death watch, a probe streak or a failed call says actor ``name`` is gone or
        wedged. A slot goes DEAD (its requests are re-routed) and, with
        ``health.auto_recover``, is restarted in the background; a spare is replaced."""
        if isinstance(key, tuple):
            self.drop_spare(key[1], reason)
            return
        if self._closed or not self.is_current(key, name):
            return
        self.health.mark_dead(key, reason)
        # Only a fleet that watches itself heals itself; an attached one (a flow's) leaves
        # recovery to the heal flow and its retry policy.
        if self._monitor is not None and self.settings.health.auto_recover:
            if self.health.state_of(key) is ShardState.DEAD:
                self.recover_in_background(key)

    def recover_in_background(self, slot: int):
        """Start ``recovery.recover`` for ``slot`` unless it is already running."""
        from nemo_gen.fleet.recovery import recover

        with self._lock:
            if self._closed or slot in self._recovering_slots:
                return None
            self._recovering_slots.add(slot)

        def run():
            try:
                return recover(self, slot)
            finally:
                with self._lock:
                    self._recovering_slots.discard(slot)

        return self._submit(run)

    def _submit(self, fn, *args):
        try:
            return self._background.submit(fn, *args)
        except RuntimeError:  # shutting down
            return None

    def _stop_and_reap(self, handle: ShardHandle) -> None:
        reap(stop_shard(handle) + ([handle.actor_pid] if handle.actor_pid else []), self.settings.health.reap_timeout_s)

    def _probe_request(self) -> tuple[dict[str, Any], list[int]]:
        """Sampling and prompt of a probe: one greedy token of a real generation."""
        tokens = list(self._tokenizer("ping", add_special_tokens=True)["input_ids"]) or [0]
        return resolve_sampling(self.resolved.generation_config, {"max_new_tokens": 1, "temperature": 0.0}), tokens

    def probe_once(self) -> list[dict[str, Any]]:
        """One probe round over the serving shards, in this thread (the heal flow's, where no
        monitor runs). A failing shard is probed up to ``health.unhealthy_threshold`` times in a
        row (NeMo-RL's streak); a dead actor or engine is condemned at once."""
        h = self.settings.health
        sampling, tokens = self._probe_request()
        out = []
        for slot in self.health.serving_shards():
            handle = self.handle(slot)
            answer: dict[str, Any] = {}
            for _ in range(h.unhealthy_threshold):
                try:
                    ref = handle.actor.probe.remote(sampling, tokens, h.probe_timeout_s)
                    answer = ray.get(ref, timeout=h.probe_timeout_s)
                except ray.exceptions.GetTimeoutError:
                    ray.cancel(ref)
                    answer = {"ok": False, "error": f"probe not answered within {h.probe_timeout_s:g}s"}
                except Exception as exc:
                    if not is_retriable(exc):
                        raise
                    answer = {"ok": False, "error": describe(exc).splitlines()[0]}
                    self.shard_lost(slot, handle.name, answer["error"])
                    break
                if answer.get("skipped"):
                    break
                self.health.record_probe(slot, bool(answer.get("ok")), answer.get("error"))
                if answer.get("ok") or self.health.state_of(slot) is ShardState.DEAD:
                    break
            out.append({"shard": slot, "ok": bool(answer.get("ok")), "error": answer.get("error"),
                        "state": self.health.state_of(slot).value})
        return out

    def _start_monitor(self) -> None:
        from nemo_gen.fleet.monitor import FleetMonitor

        sampling, probe_tokens = self._probe_request()
        self._monitor = FleetMonitor(self, sampling, probe_tokens)
        for slot, handle in list(self._shards.items()):
            self._monitor.watch(slot, handle)
        for name, handle in list(self._spares.items()):
            self._monitor.watch(("spare", name), handle)
        self._monitor.start()

    @property
    def monitor(self):
        return self._monitor

    @property
    def closed(self) -> bool:
        return self._closed

    def wait_closed(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; returns early (True) when the fleet is shut down."""
        return self._closed_event.wait(seconds)

    def _close_background(self) -> None:
        self._closed = True
        self._closed_event.set()
        if self._monitor is not None:
            self._monitor.stop()
        self._background.shutdown(wait=True, cancel_futures=True)

    # -- status and shutdown -----------------------------------------------------------------

    @property
    def shards(self) -> list[ShardHandle]:
        with self._lock:
            return [self._shards[i] for i in sorted(self._shards)]

    def status(self) -> list[ShardStatus]:
        """Per shard: index, ledger state, weight version, actor and engine PIDs; then the spares
        (state ``spare``)."""
        out = []
        for snap in self.health.snapshot():
            handle = self.handle(snap.dp_shard_idx)
            info = dict(handle.info) if handle else {}
            if handle and not self._closed and snap.state not in (ShardState.RETIRED, ShardState.DEAD):
                try:
                    info = call_shard(handle, "info", timeout_s=10)
                    handle.info = info
                except ShardDiedError as exc:
                    self._condemn(snap.dp_shard_idx, handle.name, exc)
            state = self.health.state_of(snap.dp_shard_idx)
            out.append(
                ShardStatus(
                    index=snap.dp_shard_idx,
                    state=str(state.value),
                    weight_version=info.get("weight_version"),
                    actor_pid=info.get("actor_pid"),
                    engine_pids=list(info.get("engine_pids", [])),
                    node_id=info.get("node_id"),
                    restarts=snap.restart_attempts,
                    last_error=snap.last_error or None,
                    name=handle.name if handle else None,
                    orphans=[o for o in self.orphans if o["shard"] == snap.dp_shard_idx and _alive(o["pid"])],
                )
            )
        for spare in self.spare_handles():
            info = dict(spare.info)
            if not self._closed:
                with contextlib.suppress(ShardDiedError):
                    info = call_shard(spare, "info", timeout_s=10)
            out.append(
                ShardStatus(
                    index=spare.index,
                    state="spare",
                    weight_version=info.get("weight_version"),
                    actor_pid=info.get("actor_pid"),
                    engine_pids=list(info.get("engine_pids", [])),
                    node_id=info.get("node_id"),
                    name=spare.name,
                )
            )
        return out

    def shutdown(self, reap_timeout_s: float = 30.0) -> list[int]:
        """Stop every shard and spare and wait until their engine processes have exited.
        Idempotent. Returns the PIDs that had to be killed after a clean stop failed to end them."""
        if self._closed:
            return []
        self._close_background()
        handles = self.shards + self.spare_handles()
        pids: set[int] = {h.actor_pid for h in handles if h.actor_pid}
        # In parallel: a clean engine stop takes ~4 s per shard here.
        with ThreadPoolExecutor(max_workers=max(1, len(handles))) as pool:
            for stopped in pool.map(stop_shard, handles):
                pids.update(stopped)
        killed = reap(pids, reap_timeout_s)
        remove_record(self._record)
        if self._staging is not None:
            self._staging.close()
        shutdown_ray(self._ray)
        return killed

    def record_weights(self, version: int, source: str | None) -> None:
        """A refit landed: the fleet serves ``version`` (from ``source``, when a checkpoint)."""
        self.weight_version = version
        self.weight_source = source
        if self._record is not None:
            try:
                ray.get(self._record.update.remote(weight_version=version, weight_source=source), timeout=30)
            except Exception as exc:  # the shards still know; a lost record costs only all-dead recovery
                log.warning("could not update the fleet record: %s", exc)

    def _check_open(self) -> None:
        if self._closed:
            raise NemoGenError("the fleet has been shut down")
