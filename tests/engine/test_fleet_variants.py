"""Fleet shapes beyond the default: tensor parallel, vLLM's async engine, training mode."""

from __future__ import annotations

import asyncio
import gc
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import ray

from nemo_gen import GenerationFleet
from nemo_gen.errors import ShardUnavailableError
from tests.helpers import shutdown_all, wait_gone

pytestmark = pytest.mark.engine

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, my name is", "A fleet of engines"]


def _pids(fleet):
    return [p for s in fleet.status() for p in [s.actor_pid, *s.engine_pids] if p]


@pytest.fixture(scope="module")
def async_and_train(ray_cluster, make_settings):
    """Two one-shard fleets started side by side: an async-engine one (eval) and a training
    one (dummy weights, waiting for its first refit), whose EngineCore is spawned as vLLM does
    in a Ray actor (fleet.engine_core_start=spawn; the default forks it from a forkserver)."""
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(
            GenerationFleet.launch,
            make_settings(fleet__name="async", fleet__num_shards=1, generation__vllm_cfg__async_engine=True),
        )
        t = pool.submit(
            GenerationFleet.launch, make_settings(fleet__name="train", fleet__num_shards=1, fleet__mode="train",
                                                   fleet__engine_niceness=5, fleet__engine_core_start="spawn")
        )
        fleets = {"async": a.result(), "train": t.result()}
    yield fleets
    shutdown_all(fleets.values())


def test_async_engine_serves_many_requests_concurrently(async_and_train):
    fleet = async_and_train["async"]
    assert fleet.status()[0].state == "healthy"

    async def burst(n):
        return await asyncio.gather(*(fleet.generate_async(p, temperature=0, max_new_tokens=16) for p in PROMPTS * n))

    asyncio.run(burst(1))  # warm-up: the first batch after start is slow
    one = asyncio.run(burst(1))
    many = asyncio.run(burst(4))
    assert all(r.ok and r.shard == 0 for r in many)
    assert [r.token_ids for r in many[:4]] == [r.token_ids for r in one]
    # Batched through the same engine path as a synchronous call.
    assert [r.token_ids for r in fleet.generate(PROMPTS, temperature=0)] == [r.token_ids for r in one]

    # Concurrency, by order of completion rather than by the clock: four 200-token requests go
    # to the one engine, then a 1-token one. Served one at a time, the last sent finishes last;
    # served together (continuous batching), it finishes after one step, long before the others.
    async def race():
        finished = []

        async def request(tag, prompt, tokens):
            result = await fleet.generate_async(prompt, temperature=0, max_new_tokens=tokens, ignore_eos=True)
            finished.append(tag)
            return result

        longs = [asyncio.ensure_future(request(f"long-{i}", p, 200)) for i, p in enumerate(PROMPTS)]
        short = asyncio.ensure_future(request("short", PROMPTS[0], 1))
        return await asyncio.gather(*longs, short), finished

    results, finished = asyncio.run(race())
    assert [len(r.token_ids) for r in results] == [200, 200, 200, 200, 1] and all(r.shard == 0 for r in results)
    assert finished[0] == "short", finished


def test_train_mode_waits_for_its_first_refit(async_and_train):
    fleet = async_and_train["train"]
    assert fleet.resolved.generation_config["vllm_cfg"]["load_format"] == "dummy"
    (status,) = fleet.status()
    assert status.state == "stale" and status.weight_version is None
    with pytest.raises(ShardUnavailableError, match="fleet.mode=train and has not been refit yet"):
        fleet.generate(PROMPTS)


def test_shard_processes_run_at_their_niceness_with_the_heap_frozen(async_and_train):
    """fleet.engine_niceness (0 by default, where Ray starts workers at 15) reaches the actor and
    every engine process it forks; once its engine is up, the actor's heap is exempt from the
    garbage collector's scans (vLLM's own serving practice), on the sync and the async engine."""
    for name, nice in (("async", 0), ("train", 5)):
        fleet = async_and_train[name]
        assert fleet.settings.fleet.engine_niceness == nice
        (status,) = fleet.status()
        assert {pid: psutil.Process(pid).nice() for pid in [status.actor_pid, *status.engine_pids]} == \
            dict.fromkeys([status.actor_pid, *status.engine_pids], nice), name
        frozen = ray.get(fleet.shards[0].actor.__ray_call__.remote(lambda actor: gc.get_freeze_count()), timeout=30)
        assert frozen > 10_000, (name, frozen)  # vLLM, torch and Ray's objects: ~660k on CPU


def test_the_engine_core_is_forked_by_the_shards_forkserver_or_spawned_as_set(async_and_train):
    """forkserver (the default): the EngineCore's parent is the server the actor started, not the
    actor, and the server is none of the engine's processes (its exit is not the engine's).
    spawn: the actor's own child."""
    for name, method in (("async", "forkserver"), ("train", "spawn")):
        fleet = async_and_train[name]
        (status,) = fleet.status()
        assert fleet.settings.fleet.engine_core_start == method
        assert fleet.shards[0].info.engine_core_start == method, name
        engine = set(status.engine_pids)
        (core,) = [p for p in engine if psutil.Process(p).ppid() not in engine]  # the EngineCore
        assert "EngineCore" in psutil.Process(core).name(), name  # named as vLLM names it (ps, operators)
        parent = psutil.Process(core).parent()
        if method == "spawn":
            assert parent.pid == status.actor_pid, name
        else:
            assert parent.pid != status.actor_pid and parent.ppid() == status.actor_pid, name
            assert parent.pid not in engine


def test_tensor_parallel_2_shard_matches_tp1_greedy(ray_cluster, make_settings, async_and_train):
    reference = async_and_train["async"].generate(PROMPTS, temperature=0)
    settings = make_settings(fleet__name="tp2", fleet__num_shards=1, generation__vllm_cfg__tensor_parallel_size=2)
    spec = None
    with GenerationFleet.launch(settings) as fleet:
        spec = fleet.resolved.shards[0]
        assert spec.engine_env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
        assert spec.engine_kwargs["distributed_executor_backend"] == "mp"
        assert len(spec.bundles) == 2
        results = fleet.generate(PROMPTS, temperature=0)
        pids = _pids(fleet)
        actor = fleet.status()[0].actor_pid
        helpers = [c.pid for c in psutil.Process(actor).children(recursive=True) if c.pid not in pids]
        assert helpers  # the forkserver (and multiprocessing's resource tracker) go with the shard too
        assert len(fleet.status()[0].engine_pids) >= 3  # EngineCore + one worker per rank
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert wait_gone(pids + helpers, 30) == []
