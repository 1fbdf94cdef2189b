"""``GenerationFleet``: N vLLM shards on Ray behind one generate call.

The fleet owns the driver-side view: the health ledger (who may serve), the least-loaded
selector, the tokenizer (prompts are tokenized once, on the driver, so a too-long prompt is
answered with an error before it costs a round trip), and the shard handles. Requests on a
shard that dies are re-routed to the survivors; every result says which shard and weight
version produced it.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import psutil
import ray

from nemo_gen.core.fleet_health import FleetHealthPolicy, GenerationFleetHealth, HealthyShardSelector, ShardState
from nemo_gen.core.retry import describe, is_retriable
from nemo_gen.core.results import GenerationRequest, GenerationResult, too_long_error
from nemo_gen.core.sampling import resolve_sampling
from nemo_gen.errors import NemoGenError, RequestError, ShardDiedError, ShardUnavailableError
from nemo_gen.fleet.cluster import RayConnection, cluster_resources, init_ray, shutdown_ray
from nemo_gen.fleet.resolve import ResolvedGeneration, load_tokenizer, resolve_generation
from nemo_gen.fleet.shard import ShardHandle, ShardSpec, call_shard, launch_shard, stop_shard
from nemo_gen.settings import NemoGenSettings

if TYPE_CHECKING:  # pragma: no cover
    from nemo_gen.core.refit import RefitReport

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]
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
    ):
        self.resolved = resolved
        self.settings = resolved.settings
        self._shards: dict[int, ShardHandle] = {h.index: h for h in shards}
        self._ray = ray_connection
        self._tokenizer = tokenizer or load_tokenizer(resolved.tokenizer_dir)
        h = self.settings.health
        self.health = GenerationFleetHealth(
            shard_count=max(h.index for h in shards) + 1,
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
        if attached:
            # The shards remember what they hold; the fleet's version is the newest of them.
            versions = {h.index: h.info.get("weight_version") for h in shards}
            known = [v for v in versions.values() if v is not None]
            self.weight_version = max(known) if known else None
            for index in range(self.health.shard_count):
                if versions.get(index, "missing") == "missing":
                    self.health.mark_dead(index, "shard actor not found when attaching")
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
            shards = launch_shards(resolved.shards, progress)
        except BaseException:
            if conn.owned:
                shutdown_ray(conn)
            raise
        return cls(resolved, shards, ray_connection=conn if conn.owned else None)

    @classmethod
    def attach(cls, settings: NemoGenSettings) -> "GenerationFleet":
        """Connect to a fleet that is already running (its detached, named shard actors on the
        Ray cluster at ``ray.address``). Shards at the newest weight version serve; any that lag
        behind stay STALE until the next refit. ``detach()`` leaves the fleet running."""
        from nemo_gen.environment import configure_environment
        from nemo_gen.fleet.shard import find_shard

        configure_environment(settings)
        conn = init_ray(settings.ray)
        resolved = resolve_generation(settings, cluster=None)
        handles = [find_shard(spec) for spec in resolved.shards]
        found = [h for h in handles if h is not None]
        if not found:
            if conn.owned:
                shutdown_ray(conn)
            raise ShardUnavailableError(
                f"no fleet named {settings.fleet.name!r} is running in Ray namespace "
                f"{settings.ray.namespace!r} at {conn.address} (start one with `nemo-gen fleet up`)"
            )
        fleet = cls(resolved, found, ray_connection=conn if conn.owned else None, attached=True)
        return fleet

    def detach(self) -> None:
        """Disconnect from an attached fleet without stopping it (the staging file this
        process wrote is removed: the shards only read it during a refit)."""
        self._closed = True
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
        config's (max_new_tokens, temperature, top_p, top_k, stop_strings, stop_token_ids)."""
        self._check_open()
        params = self._sampling(sampling)
        requests, results = self._requests(prompts)
        pending = requests
        while pending:
            assignment = self._assign(pending)
            refs = {shard: self._shards[shard].actor.generate.remote(batch, params) for shard, batch in assignment.items()}
            pending = []
            try:
                for shard, ref in refs.items():
                    batch = assignment[shard]
                    try:
                        out = ray.get(ref, timeout=self.settings.fleet.request_timeout_s)
                    except Exception as exc:
                        if not is_retriable(exc):
                            raise
                        # The shard or its engine is gone or wedged: condemn it, re-route its work.
                        self._condemn(shard, exc)
                        pending.extend(batch)
                        continue
                    self.health.report_success(shard)
                    for req, raw in zip(batch, out["results"]):
                        results[req.index] = self._result(req, raw, out["shard"], out["weight_version"])
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
        while True:
            shard = self._pick()
            try:
                out = await self._shards[shard].actor.generate.remote([req], params)
            except Exception as exc:
                if not is_retriable(exc):
                    raise
                self._condemn(shard, exc)
                continue
            finally:
                self.selector.release(shard)
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

    def _condemn(self, shard: int, exc: BaseException) -> None:
        log.warning("shard %d failed: %s; re-routing its requests", shard, exc)
        # A dead actor or engine is certain, not a streak: straight to DEAD.
        self.health.mark_dead(shard, describe(exc).splitlines()[0])

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

    # -- status and shutdown -----------------------------------------------------------------

    @property
    def shards(self) -> list[ShardHandle]:
        return [self._shards[i] for i in sorted(self._shards)]

    def status(self) -> list[ShardStatus]:
        """Per shard: index, ledger state, weight version, actor and engine PIDs."""
        out = []
        for snap in self.health.snapshot():
            handle = self._shards.get(snap.dp_shard_idx)
            info = dict(handle.info) if handle else {}
            if handle and not self._closed and snap.state != ShardState.RETIRED:
                try:
                    info = call_shard(handle, "info", timeout_s=10)
                    handle.info = info
                except ShardDiedError as exc:
                    self._condemn(snap.dp_shard_idx, exc)
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
                    last_error=snap.last_error,
                )
            )
        return out

    def shutdown(self, reap_timeout_s: float = 30.0) -> list[int]:
        """Stop every shard and wait until its engine processes have exited. Idempotent.
        Returns the PIDs that had to be killed after a clean stop failed to end them."""
        if self._closed:
            return []
        self._closed = True
        pids: set[int] = {h.actor_pid for h in self.shards if h.actor_pid}
        # In parallel: a clean engine stop takes ~4 s per shard here.
        with ThreadPoolExecutor(max_workers=max(1, len(self.shards))) as pool:
            for stopped in pool.map(stop_shard, self.shards):
                pids.update(stopped)
        killed = reap(pids, reap_timeout_s)
        if self._staging is not None:
            self._staging.close()
        shutdown_ray(self._ray)
        return killed

    def _check_open(self) -> None:
        if self._closed:
            raise NemoGenError("the fleet has been shut down")


def reap(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until ``pids`` (processes this fleet started) have exited; SIGKILL stragglers at the
    deadline. Polls — a single sample right after a kill can still see a dying process."""
    alive = [p for p in _procs(pids)]
    gone, alive = psutil.wait_procs(alive, timeout=timeout_s)
    killed = []
    for proc in alive:
        try:
            proc.kill()
            killed.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    if killed:
        log.warning("killed engine processes that outlived their shard: %s", killed)
    return killed


def _procs(pids: Iterable[int]) -> list[psutil.Process]:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return procs
