"""``GenerationFleet``: N vLLM shards on Ray behind one generate call — the facade.

It owns no logic of its own: it builds every part explicitly in ``__init__`` from the settings
and hands each the others it needs, by keyword; its verbs are one-line calls into a part (no
mixins, no part built on first use). Its HTTP server is not one of its parts: the process that
composes the fleet adds it (``nemo_gen.server.serve``). Each piece of state has one owner: ``members`` (``Membership`` over the
core ``SlotTable``: each slot's actor, ``health`` state and version, the spares, the losses
``recovery`` drains; the table is the ledger's one writer, and the parts get it, not the ledger), ``weights`` (``FleetWeights``: version, source, staged refit, refit lock),
``adapters`` (``FleetAdapters``) and ``background`` (``Background``: open or not, its threads).

The parts act through ``driver`` (``ShardDriver``, the one seam to Ray): ``router`` serves requests,
``refitter`` pushes weights, ``spares`` and ``recovery`` bring lost shards back (what to do is
``nemo_gen.core.planner``'s decision), ``monitor`` watches and probes, ``sleeper`` sleeps and
wakes the engines; ``session()`` opens a ``FleetSession`` (``fleet/session.py``); ``drain()`` and
``restart_shard()`` take a healthy shard out of service (``fleet/drain.py``).
No fleet module imports this one.
"""
from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Iterable, Sequence

from nemo_gen.chat.answers import ChatParsers
from nemo_gen.settings import policies
from nemo_gen.core.fleet_health import GenerationFleetHealth, ShardState
from nemo_gen.core.planner import Seed, attach_seeds
from nemo_gen.core.wire import FleetRecordState
from nemo_gen.core.manifest import RefitReport
from nemo_gen.core.results import Delta, GenerationResult
from nemo_gen.core.request_policy import honour
from nemo_gen.core.sampling import resolve_sampling
from nemo_gen.core.sleep import SleepLevel, SleepState
from nemo_gen.errors import ShardUnavailableError
from nemo_gen.fleet.adapters import AdapterReport, FleetAdapters
from nemo_gen.fleet.background import Background
from nemo_gen.fleet import drain as drains
from nemo_gen.fleet.cluster import RayConnection, cluster_resources, init_ray, shutdown_ray
from nemo_gen.fleet.driver import ProgressFn, ShardDriver, shard_driver
from nemo_gen.fleet.members import Membership, claimed_slots
from nemo_gen.fleet.monitor import DeathWatch, FleetMonitor, Prober
from nemo_gen.host.processes import reap
from nemo_gen.fleet.record import RecordWriter, create_record, find_record, remove_record
from nemo_gen.fleet.recovery import Recovery
from nemo_gen.fleet.refit import Refitter
from nemo_gen.fleet.resolve import ResolvedGeneration, load_tokenizer, resolve_generation
from nemo_gen.fleet.router import Prompt, Router
from nemo_gen.fleet.session import FleetSession
from nemo_gen.fleet.sleep import FleetSleep, SleepReport
from nemo_gen.fleet.handles import ShardHandle
from nemo_gen.fleet.spares import SparePool
from nemo_gen.fleet.status import ShardStatus, fleet_metrics, fleet_status
from nemo_gen.fleet.weight_sync import FleetWeightSyncClient
from nemo_gen.fleet.weights import FleetWeights
from nemo_gen.settings import NemoGenSettings

__all__ = ["GenerationFleet", "ShardStatus"]


class GenerationFleet:
    """A running fleet. Build it with ``GenerationFleet.launch(settings)``; use as a context
    manager, or call ``shutdown()`` (idempotent)."""

    def __init__(self, resolved: ResolvedGeneration, shards: Sequence[ShardHandle],
                 ray_connection: RayConnection | None = None, tokenizer=None, attached: bool = False,
                 spares: Sequence[ShardHandle] = (), watch: bool = True, record: Any = None,
                 recorded: FleetRecordState | None = None, driver: ShardDriver | None = None):
        self.resolved = resolved
        self.settings = s = resolved.settings
        self.driver = driver or shard_driver(s)
        self._ray = ray_connection
        self._tokenizer = tokenizer or load_tokenizer(resolved.tokenizer_dir)
        self._session_parsers: ChatParsers | None = None  # built by the first session()
        self.health = GenerationFleetHealth(shard_count=s.fleet.num_shards, policy=policies.health_policy(s))
        self.members = Membership(health=self.health, slots=shards, spares=spares, first_spare_seq=len(resolved.spares))
        # eval: engines loaded the checkpoint (version 0). train: dummy weights, STALE until the
        # first refit — nothing re-admits a shard but a refit.
        version, source, seeds = (0 if s.is_eval() else None), None, []
        if attached:
            version, source, seeds = attach_seeds(s.fleet.num_shards, {h.index: h.info for h in shards}, recorded)
        elif not s.is_eval():
            seeds = [Seed(h.index, ShardState.STALE, "dummy weights", 0) for h in shards]
        self.members.table.seed(seeds, version)
        self.weights = FleetWeights(version=version, source=source, staging_dir=s.refit.staging_dir, fleet_name=s.fleet.name,
                                    record=RecordWriter(record, s.fleet.control_timeout_s, key=(s.ray.namespace, s.fleet.name)))
        self.background = Background(s.fleet.name)
        self.monitor: FleetMonitor | None = None
        self.watches = DeathWatch(driver=self.driver, interval_s=s.health.watch_interval_s)
        gen_cfg = resolved.generation_config
        parts: dict[str, Any] = dict(slots=self.members.table, members=self.members, driver=self.driver)  # (each part takes all three)
        self.refitter = Refitter(**parts, weights=self.weights, generation_config=gen_cfg, bucket_bytes=s.refit.bucket_bytes, digest=s.refit.digest)
        self.adapters = FleetAdapters(self.refitter, self.driver, self.weights, s)  # (loads adapters into newcomers)
        self.spares = SparePool(members=self.members, driver=self.driver, refitter=self.refitter, background=self.background,
                                template=(resolved.spares or resolved.shards)[0], fleet_name=s.fleet.name,
                                num_slots=s.fleet.num_shards, wanted=lambda: self.settings.fleet.spares,
                                watches=self.watches, reap_timeout_s=s.health.reap_timeout_s)
        self.recovery = Recovery(**parts, weights=self.weights, refitter=self.refitter, spares=self.spares,
                                 background=self.background, specs=resolved.shards, fleet_name=s.fleet.name,
                                 reap_timeout_s=s.health.reap_timeout_s, backoff=policies.backoff_policy(s),
                                 auto_recover=lambda: self.settings.health.auto_recover, watches=self.watches)
        self.router = Router(**parts, tokenizer=self._tokenizer, max_model_len=int(resolved.max_model_len or 0),
                             limits=policies.request_limits(s), decode_text=bool(gen_cfg["vllm_cfg"].get("skip_tokenizer_init")),
                             serving_version=lambda: self.weights.version, fleet_name=s.fleet.name, session_slack=s.fleet.session_affinity_slack,
                             vocab_size=resolved.vocab_size, digest_of=self.weights.digests.of)
        self.refitter.roll_in_waves(s, self.router.affinity.placement.active)  # refit.rollout: nemo_gen.fleet.rolling
        self.sleeper = FleetSleep(**parts, weights=self.weights, refitter=self.refitter, enabled=s.generation.colocated.enabled, fleet_name=s.fleet.name)
        tokens = list(self._tokenizer("ping", add_special_tokens=True)["input_ids"]) or [0]
        self.prober = Prober(**parts, sampling=resolve_sampling(gen_cfg, {"max_new_tokens": 1, "temperature": 0.0}),
                             tokens=tokens, timeout_s=s.health.probe_timeout_s, warmup_s=s.health.warmup_grace_s)
        if watch and s.health.enabled:
            self._start_monitor()
        self.http: Any = None  # its own HTTP server, when the process composed one (nemo_gen.server.serve)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def launch(cls, settings: NemoGenSettings | None = None, progress: ProgressFn | None = None) -> "GenerationFleet":
        """Configure the environment, start/attach Ray, resolve, and start every shard."""
        settings = settings or NemoGenSettings.load()
        conn, driver = _connect(settings)
        try:
            resolved = resolve_generation(settings, cluster_resources())
            started = driver.launch_all(resolved.shards + resolved.spares, progress)
            # Its first call waits for a new actor's process to start, bounded as a shard's placement.
            record = create_record(settings.fleet.name, settings.ray.namespace, 0 if settings.is_eval() else None,
                                   settings.fleet.placement_timeout_s + settings.fleet.control_timeout_s)
        except BaseException:
            if conn.owned:
                shutdown_ray(conn)
            raise
        shards = [h for h in started if h.info.slot is not None]
        return cls(resolved, shards, ray_connection=conn if conn.owned else None, record=record, driver=driver,
                   spares=[h for h in started if h.info.slot is None])

    @classmethod
    def attach(cls, settings: NemoGenSettings, watch: bool = True) -> "GenerationFleet":
        """Connect to a fleet that is already running (its detached, named shard actors on the
        Ray cluster at ``ray.address``). Shards at the newest weight version serve; any that lag
        behind stay STALE until the next refit. ``detach()`` leaves the fleet running."""
        conn, driver = _connect(settings)
        resolved = resolve_generation(settings, cluster=None)
        actors = driver.find(settings.fleet.name, settings.ray.namespace)
        slots = claimed_slots(actors, settings.fleet.num_shards)
        record, recorded = find_record(settings.fleet.name, settings.ray.namespace, settings.fleet.control_timeout_s)
        if not slots and record is None:
            if conn.owned:
                shutdown_ray(conn)
            raise ShardUnavailableError(
                f"no fleet named {settings.fleet.name!r} is running in Ray namespace "
                f"{settings.ray.namespace!r} at {conn.address} (start one with `nemo-gen fleet up`)"
            )
        return cls(resolved, list(slots.values()), ray_connection=conn if conn.owned else None, attached=True,
                   spares=[h for h in actors if h.index is None], watch=watch, record=record, recorded=recorded,
                   driver=driver)

    def detach(self) -> None:
        """Disconnect from an attached fleet without stopping it (spares being started are waited
        for and left running: they are the fleet's); this process's staging file is removed."""
        self._close_background(detached=True)
        self.weights.close()
        shutdown_ray(self._ray)

    def __enter__(self) -> "GenerationFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], session_id: str | Sequence[str | None] | None = None,
                 timeout_s: float | None = None, adapter: str | None = None, **sampling: Any) -> list[GenerationResult]:
        """One ``GenerationResult`` per prompt (a string, token ids or chat messages), in order; ``n`` samples
        each; sampling keywords are the generation config's. ``session_id`` (one, or one per prompt) keeps a
        conversation on its last turn's shard. ``timeout_s`` (default ``fleet.request_timeout_s``): see
        ``Router.generate``. ``adapter``: that LoRA adapter's newest version. One result per prompt."""
        self.background.check_open()
        with self.adapters.selected(adapter, self._sampling(sampling)) as (chosen, p):
            return chosen.stamp(self.router.generate(prompts, p, session_id, timeout_s))

    async def generate_async(self, prompt: Prompt, session_id: str | None = None, timeout_s: float | None = None,
                             adapter: str | None = None, **sampling: Any) -> GenerationResult:
        """The per-request awaitable for async RL loops; cancelling it aborts the request on its
        engine; past ``timeout_s`` (default ``fleet.request_timeout_s``): ``RequestTimeout``."""
        self.background.check_open()
        with self.adapters.selected(adapter, self._sampling(sampling)) as (chosen, p):
            return chosen.stamp(await self.router.generate_async(prompt, p, session_id, timeout_s))

    def generate_stream(self, prompt: Prompt, session_id: str | None = None, timeout_s: float | None = None,
                        adapter: str | None = None, **sampling: Any) -> AsyncIterator[Delta | GenerationResult]:
        """``Delta``s as generated, then the result; ``timeout_s``: the longest wait between two."""
        self.background.check_open()
        return self.adapters.stream(adapter, self._sampling(sampling),
                                    lambda p: self.router.generate_stream(prompt, p, session_id, timeout_s))

    def _sampling(self, sampling: dict[str, Any]) -> dict[str, Any]:
        """Sampling keywords, once the call's min_version / max_staleness are ones the fleet honours."""
        return resolve_sampling(self.resolved.generation_config, honour(sampling, self.weight_version, policies.in_flight(self.settings)))

    # -- weights -----------------------------------------------------------------------------
    @property
    def http_url(self) -> str | None:
        """The fleet's OpenAI-compatible server (``generation.vllm_cfg.expose_http_server``, started
        by ``nemo_gen.server.serve`` where the process is composed); None without one."""
        return self.http.url if getattr(self, "http", None) else None

    @property
    def weight_version(self) -> int | None:
        return self.weights.version

    def refit(self, source: Any, version: int | None = None, in_flight: str | None = None) -> RefitReport:
        """Push new weights into every shard that holds an engine (``nemo_gen.fleet.refit``; a wave at a time
        with ``refit.rollout: waves``): ``source`` a checkpoint directory, a ``WeightSource``, or live tensors;
        ``version`` default previous + 1; ``in_flight`` ``drain`` | ``abort`` | ``keep`` (default ``refit.in_flight``).
        A bad manifest: ``RefitError``, nothing changed; a shard failing while loading is quarantined."""
        self.background.check_open()
        with self.adapters.full_refit(mode := policies.in_flight(self.settings, in_flight)):
            report = self.refitter.refit(source, version, mode)
        self.recovery.drain()  # (a spare that failed it is replaced now, monitor or not)
        return report

    def weight_sync_client(self, version: int | None = None, draft: bool = False,
                           in_flight: str | None = None) -> FleetWeightSyncClient:
        """This fleet as a ``VLLMWeightSyncClient``: hand it to one of vLLM's trainer engines
        (``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)``) and
        ``send_weights()`` refits every shard through the engines' ``refit.backend``, with the
        fleet's versions, checks and quarantine; see ``nemo_gen.fleet.weight_sync``. ``draft``:
        the updates go to the speculative drafter (names without the ``draft.`` prefix)."""
        self.background.check_open()
        return FleetWeightSyncClient(self.refitter, self.resolved.generation_config, self.settings.refit.backend,
                                     self.background.check_open, version, draft,
                                     policies.in_flight(self.settings, in_flight), quantize=self.settings.refit.quantize)

    # -- membership and recovery -------------------------------------------------------------

    @property
    def shards(self) -> list[ShardHandle]:
        return self.members.slots()

    def handle(self, slot: int) -> ShardHandle | None:
        """The actor serving ``slot`` now (it changes when the shard is replaced)."""
        return self.members.handle(slot)

    def replenish_spares(self) -> None:
        """Start spares in the background until ``fleet.spares`` are up (or coming up)."""
        self.spares.replenish()

    def probe_once(self) -> list[dict[str, Any]]:
        """One probe round over the serving shards, here (the heal flow's; no monitor runs there)."""
        return self.prober.probe_round(self.settings.health.unhealthy_threshold)

    def _start_monitor(self) -> None:
        h, stats = self.settings.health, not self.resolved.shards[0].engine_kwargs.get("disable_log_stats", True)
        self.monitor = FleetMonitor(prober=self.prober, watches=self.watches, probe_interval_s=h.probe_interval_s,
                                    name=self.settings.fleet.name, stats=stats)
        self.recovery.start_watching()
        self.watches.start(self.members.members())
        self.monitor.start()

    @property
    def closed(self) -> bool:
        return self.background.closed

    def _close_background(self, detached: bool = False) -> None:
        if getattr(self, "http", None):  # (a fleet whose server could not start has none)
            self.http.stop()
        self.background.close(detached)
        self.members.table.close()
        if self.monitor is not None:
            self.monitor.stop()
        self.background.join()

    # -- adapters, sessions, sleep (each a part's verbs: FleetAdapters, FleetSession, FleetSleep) ---

    def refit_adapter(self, name: str, source: Any, version: int | None = None) -> AdapterReport:
        """Load LoRA adapter ``name`` into every shard as ``version`` (default its previous + 1).
        ``source``: a PEFT directory, or live tensors ``{"config": peft_config, "tensors": {name:
        tensor}}`` (staged in shared memory: no disk). Checked against the base model first — a bad
        adapter is an ``AdapterError`` naming it, nothing changed; each load gets a fresh engine id,
        so no request after it reaches an older version; running requests are not paused."""
        self.background.check_open()
        return self.adapters.refit(name, source, version)

    def adapter_versions(self) -> dict[str, int]:
        """The adapters served now: name -> the version a request for it gets."""
        return self.adapters.registry.names() if self.adapters.enabled else {}

    def session(self, session_id: str | None = None) -> FleetSession:
        """A new recorded session (``nemo_gen.fleet.session``), placed on the serving shard with the
        fewest open sessions; ``close()`` it (or use it as a context manager) to release the shard."""
        self.background.check_open()
        sid = session_id or f"sess-{secrets.token_hex(12)}"
        if self._session_parsers is None:  # the server's parsers (server.*), built once per fleet
            self._session_parsers = ChatParsers.from_settings(self.settings.server, self._tokenizer)
        self.router.open_session(sid)
        return FleetSession(sid, self._tokenizer, fleet=self, on_close=self.router.close_session,
                            parsers=self._session_parsers)

    def sleep(self, level: int | SleepLevel = 1) -> SleepReport:
        """Every engine sleeps at ``level`` (1: weights to CPU memory, KV cache dropped; 2: both
        dropped, refit before generating again) once its running requests finished; until woken
        the fleet refuses requests (``FleetAsleep``). Needs ``generation.colocated.enabled``."""
        self.background.check_open()
        return self.sleeper.sleep(level)

    def wake(self, tags: Iterable[str] | None = None) -> SleepReport:
        """Bring ``tags`` back (``["weights"]``, ``["kv_cache"]``; None: both). A no-op when awake."""
        self.background.check_open()
        return self.sleeper.wake(tags)

    @property
    def sleep_state(self) -> SleepState:
        return self.sleeper.state

    def drain(self, shard: int, reason: str = "drained by the operator",
              wait_s: float = drains.MOVE_WAIT_S) -> dict[str, Any]:
        """Shard ``shard`` leaves service now; its requests go on elsewhere with their tokens,
        uncounted. ``DrainRefused`` (nothing changed) for an unknown, non-serving or last serving shard."""
        self.background.check_open()
        return drains.drain_shard(self, shard, reason, wait_s)

    def restart_shard(self, shard: int, wait_s: float = drains.MOVE_WAIT_S) -> dict[str, Any]:
        """A planned restart: ``drain(shard)``, then the shard replaced (a spare, or a new engine
        refit to the fleet's version); a shard that does not serve is restarted at once.
        Returns the drain's report with the restart's (``Recovery.restart_shard``) under ``restart``."""
        self.background.check_open()
        return drains.restart_shard(self, shard, wait_s)

    # -- status and shutdown -----------------------------------------------------------------

    def status(self) -> list[ShardStatus]:
        """Per shard: index, ledger state, weight version, actor and engine PIDs; then the spares."""
        return fleet_status(self.members.table.ledger, self.members, self.driver, self.recovery.orphans, live=not self.closed)

    def metrics(self) -> dict[str, float]:
        """The fleet's own series (NeMo-RL's ledger names, plus version, re-routing and refits)."""
        return fleet_metrics(self.members.table.ledger, self.weights.version, self.router.rerouted, self.refitter.totals)

    def vllm_metrics(self) -> dict[int, list[dict[str, Any]]]:
        """Per serving slot, vLLM's stats of its engine now: a call to each (/metrics: monitor.vllm_stats)."""
        return {s: self.driver.vllm_metrics(self.members.handle(s)) for s in self.health.serving_shards()}

    def shutdown(self, reap_timeout_s: float | None = None) -> list[int]:
        """Stop every shard and spare, waiting for their engine processes to exit (``reap_timeout_s``,
        default ``health.reap_timeout_s``); idempotent. Returns the PIDs a clean stop left to kill."""
        if self.closed:
            return []
        self._close_background()
        handles = self.members.slots() + self.members.spares()
        pids: set[int] = {h.actor_pid for h in handles if h.actor_pid}
        # In parallel: a clean engine stop takes ~4 s per shard here.
        with ThreadPoolExecutor(max_workers=max(1, len(handles))) as pool:
            for stopped in pool.map(self.driver.stop, handles):
                pids.update(stopped)
        killed = reap(pids, self.settings.health.reap_timeout_s if reap_timeout_s is None else reap_timeout_s)
        self.weights.close()
        remove_record(self.weights.record.actor)
        shutdown_ray(self._ray)
        return killed


def _connect(settings: NemoGenSettings) -> tuple[RayConnection, ShardDriver]:
    """The environment (before Ray: the raylet inherits it), Ray, and the driver."""
    from nemo_gen.environment import configure_environment

    configure_environment(settings)
    return init_ray(settings.ray), shard_driver(settings)
