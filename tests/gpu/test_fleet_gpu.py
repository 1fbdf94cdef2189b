"""A real fleet of vLLM CUDA engines: 2 shards on one GPU (``fleet.shards_per_gpu=2``).

Needs CUDA and vLLM's CUDA build (skipped elsewhere: CI has no GPU). On the GPU host::

    python -m pytest tests/gpu -v

One fleet for the module (its own private Ray cluster), started with ``refit.backend:
nemo_gen_ipc`` so this process can act as a colocated trainer. The reference for "what these
weights generate" is a bare vLLM engine in a subprocess (``reference_engine.py``). Every
comparison of token ids is prompt by prompt, batch 1 (``[p, p]`` puts one copy on each shard),
so no batch shape can change bf16 numerics. The tests run in file order; each leaves the fleet
serving.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, my name is", "A fleet of engines"]
TOKENS = 16
SHARD_UTIL = 0.2  # each shard's share of the H200 (2 x 0.2, plus the reference engine's 0.1)
REF_UTIL = 0.1
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def reference(models, prompt_ids, tmp_path_factory):
    """Start the reference engine in the background; the test that needs it waits for it."""
    out = tmp_path_factory.mktemp("reference") / "reference.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "reference_engine.py"), str(out), str(models[1]), str(models[0]),
         json.dumps(prompt_ids), str(TOKENS), str(REF_UTIL)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    reader.start()

    def result(timeout_s: float = 400) -> dict:
        proc.wait(timeout=timeout_s)
        reader.join(10)
        assert proc.returncode == 0, "reference engine failed:\n" + "".join(log[-60:])
        return json.loads(out.read_text())

    yield result
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module")
def fleet(models, reference, tmp_path_factory):
    from nemo_gen import GenerationFleet
    from nemo_gen.settings import NemoGenSettings

    settings = NemoGenSettings.load(overrides={
        "home": str(tmp_path_factory.mktemp("gpu-home")),
        "model.path": str(models[0]),
        "fleet.name": "gpu-tests",
        "fleet.device": "gpu",
        "fleet.num_shards": 2,
        "fleet.shards_per_gpu": 2,
        "fleet.engine_start_timeout_s": 400,
        "ray.namespace": "nemo_gen_gpu_tests",
        "generation.max_new_tokens": TOKENS,
        "generation.vllm_cfg.precision": "bfloat16",
        "generation.vllm_cfg.enforce_eager": True,  # as the reference engine (compiled graphs differ in bits)
        "generation.vllm_cfg.max_model_len": 256,
        "generation.vllm_cfg.gpu_memory_utilization": SHARD_UTIL,
        "refit.backend": "nemo_gen_ipc",
        "health.probe_interval_s": 1.0,
        "health.probe_timeout_s": 20.0,
        "health.restart_backoff_s": 0.2,
        "health.reap_timeout_s": 15.0,
    })
    t0 = time.monotonic()
    f = GenerationFleet.launch(settings)
    f.launch_s = time.monotonic() - t0
    yield f
    f.shutdown()


def greedy_each(fleet, prompt_ids) -> dict[int, list[list[int]]]:
    """Per shard, the greedy tokens of every prompt, one request per shard at a time."""
    out: dict[int, list[list[int]]] = {}
    for ids in prompt_ids:
        for r in fleet.generate([ids, ids], temperature=0, max_new_tokens=TOKENS, ignore_eos=True):
            assert r.ok, r.error
            out.setdefault(r.shard, []).append(r.token_ids)
    assert sorted(out) == [0, 1], f"both shards should have answered: {sorted(out)}"
    return out


def test_two_shards_share_one_gpu_each_within_its_share(fleet):
    from nemo_gen.host import gpu_memory

    status = fleet.status()
    assert [s.state for s in status] == ["healthy", "healthy"] and status[0].actor_pid != status[1].actor_pid
    procs = gpu_memory.gpu_processes()
    (device,) = gpu_memory.devices()
    held = {}
    for s in status:
        mine = [p for p in procs if p.pid in (s.actor_pid, *s.engine_pids)]
        assert mine, f"NVML lists no process of shard {s.index} ({s.actor_pid}, {s.engine_pids}): {procs}"
        assert {p.gpu_uuid for p in mine} == {device.uuid}
        held[s.index] = sum(p.used_bytes or 0 for p in mine)
    for index, nbytes in held.items():  # vLLM keeps to its share (plus its CUDA context)
        assert 0.5 * SHARD_UTIL * device.total_bytes < nbytes <= (SHARD_UTIL + 0.02) * device.total_bytes, (index, nbytes)
    print(f"\nlaunch of 2 shards on one GPU: {fleet.launch_s:.1f} s; GPU memory per shard (GiB): "
          f"{ {i: round(b / 2**30, 1) for i, b in held.items()} }")


def test_greedy_is_deterministic_and_identical_on_both_shards(fleet, prompt_ids):
    first = greedy_each(fleet, prompt_ids)
    assert first[0] == first[1]
    assert all(len(t) == TOKENS for t in first[0])
    assert greedy_each(fleet, prompt_ids) == first  # run to run
    # a batch split over the shards: equal copies come back equal, from both shards
    batch = fleet.generate([prompt_ids[0]] * 8, temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    assert {r.shard for r in batch} == {0, 1} and len({tuple(r.token_ids) for r in batch}) == 1
    fleet.initial_tokens = first[0]


def test_both_load_paths_on_a_cuda_engine_match_a_fresh_engine(fleet, reference):
    """Checkpoint refit inside a bare CUDA engine, direct path and vLLM's reload, against what
    the fleet (weights A, loaded at start) and a fresh engine on B generate."""
    ref = reference()
    a, fresh_b = fleet.initial_tokens, ref["fresh_b"]
    assert fresh_b != a
    assert ref["path"] == "direct", ref["path"]
    assert ref["a_direct"] == a and ref["a_reload"] == a
    assert ref["b_reload"] == fresh_b and ref["b_direct_after_reload"] == fresh_b


def _ipc_trainer(fleet, model_dir, mutate=None):
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from nemo_gen.vllm_ext.vllm_backend import CudaIpcTrainerInitInfo

    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda()
    if mutate is not None:
        mutate(policy)
    client = fleet.weight_sync_client()
    engine = WeightTransferTrainerFactory.trainer_init(CudaIpcTrainerInitInfo(), client=client, source=ModuleSource(policy))
    return policy, client, engine


def test_a_bad_manifest_is_rejected_with_nothing_changed(fleet, models, prompt_ids, tmp_path):
    from safetensors.torch import load_file, save_file

    from nemo_gen.core.manifest import RefitError

    version = fleet.weight_version
    tensors = load_file(str(models[1] / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(7)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(RefitError) as info:
        fleet.refit(str(bad))
    assert "model.norm.weight" in str(info.value) and "model.layers.0.mlp.up_proj.weight" in str(info.value)

    def widen(policy):  # a trainer whose norm has the wrong size
        policy.model.norm.weight = torch.nn.Parameter(torch.ones(7, device="cuda", dtype=torch.bfloat16))

    _, client, engine = _ipc_trainer(fleet, models[1], mutate=widen)
    try:
        with pytest.raises(RefitError, match=r"model.norm.weight: shape \[7\]"):
            engine.send_weights()
    finally:
        engine.shutdown()
    assert client.report is None and fleet.weight_version == version
    assert {s.state for s in fleet.status()} == {"healthy"}
    assert greedy_each(fleet, prompt_ids)[0] == fleet.initial_tokens


def load_stats(fleet) -> list:
    import ray

    return [st for h in fleet.shards for st in ray.get(h.actor.call.remote("load_stats"), timeout=60)]


def test_refit_through_nemo_gen_ipc_matches_a_fresh_engine(fleet, models, prompt_ids, reference):
    fresh_b = reference()["fresh_b"]
    before = fleet.weight_version
    policy, client, engine = _ipc_trainer(fleet, models[1])
    try:
        engine.send_weights()
        report = client.report
        assert report.ok and report.version == before + 1 == fleet.weight_version, report
        got = greedy_each(fleet, prompt_ids)
        assert got[0] == fresh_b and got[1] == fresh_b
        assert {st.path for st in load_stats(fleet)} == {"direct"}
        # the first load of these tensors is recorded as a copy plan; the next ones replay it
        assert {st.plan for st in load_stats(fleet)} == {"recorded"}, load_stats(fleet)
        # an optimizer step writes the trainer's weights in place: the next refit sends the same
        # handles and the engines see the new values
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(-1.0)
        engine.send_weights()
        assert {st.plan for st in load_stats(fleet)} == {"replayed"}, load_stats(fleet)
        flipped = greedy_each(fleet, prompt_ids)
        assert flipped[0] == flipped[1] and flipped[0] != fresh_b
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(-1.0)
        engine.send_weights()
        assert {st.plan for st in load_stats(fleet)} == {"replayed"}
        assert greedy_each(fleet, prompt_ids)[0] == fresh_b
        print(f"\nnemo_gen_ipc refit of {report.bytes / 2**20:.1f} MiB: {report.load_seconds * 1e3:.1f} ms end to end")
    finally:
        engine.shutdown()


def test_refit_from_a_checkpoint_matches_a_fresh_engine(fleet, models, prompt_ids, reference):
    fresh_b = reference()["fresh_b"]
    assert fleet.refit(str(models[0])).ok
    assert greedy_each(fleet, prompt_ids)[0] == fleet.initial_tokens
    report = fleet.refit(str(models[1]))
    assert report.ok and {s.state for s in fleet.status()} == {"healthy"}
    got = greedy_each(fleet, prompt_ids)
    assert got[0] == fresh_b and got[1] == fresh_b


class GpuWatch:
    """Polls NVML from the moment of a kill: when the dead shard's processes stop holding GPU
    memory, and when a process that was not there before (the replacement) first holds some."""

    def __init__(self, dead: list[int], known: list[int]):
        self.dead, self.known = set(dead), set(known) | set(dead) | {os.getpid()}
        self.freed_at = self.new_at = None
        self.new_pids: set[int] = set()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        from nemo_gen.host import gpu_memory

        while not self._stop.is_set():
            procs = gpu_memory.gpu_processes()
            now = time.monotonic()
            if self.freed_at is None and not any(p.pid in self.dead for p in procs):
                self.freed_at = now
            new = {p.pid for p in procs if p.pid not in self.known}
            if new and self.new_at is None:
                self.new_at = now
            self.new_pids |= new
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join(5)


def _kill_mid_generation(fleet, prompt_ids, victim_pid, dead_pids):
    from nemo_gen.host import gpu_memory

    victim_name = fleet.handle(1).name
    others = [p for s in fleet.status() for p in (s.actor_pid, *s.engine_pids)]
    held_before = sum(gpu_memory.used_by_pids(dead_pids).values())
    assert held_before > 0, "the victim's processes hold no GPU memory before the kill"
    with ThreadPoolExecutor(1) as pool, GpuWatch(dead_pids, others) as watch:
        running = pool.submit(fleet.generate, prompt_ids * 8, temperature=0, max_new_tokens=200, ignore_eos=True)
        time.sleep(0.5)  # the batches are on the shards
        killed_at = time.monotonic()
        os.kill(victim_pid, signal.SIGKILL)
        results = running.result(timeout=120)
        wait_until(lambda: fleet.handle(1).name != victim_name and fleet.health.state_of(1).value == "healthy"
                   and all(s.weight_version == fleet.weight_version for s in fleet.health.snapshot()), 240,
                   f"shard 1 back; ledger {fleet.health.state_summary()}")
    assert len(results) == len(prompt_ids) * 8 and all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert [r.index for r in results] == list(range(len(results)))
    assert {r.weight_version for r in results} == {fleet.weight_version}
    assert all(len(r.token_ids) == 200 for r in results)
    assert watch.freed_at is not None, "the dead shard's GPU memory never came back"
    assert watch.new_at is not None and watch.new_pids, "no replacement ever held GPU memory"
    # the dead shard's memory was back before its replacement took any
    assert watch.freed_at <= watch.new_at, (watch.freed_at - killed_at, watch.new_at - killed_at)
    assert gpu_memory.used_by_pids(dead_pids) == {}
    new_status = fleet.status()[1]
    assert set(new_status.engine_pids) & watch.new_pids or new_status.actor_pid in watch.new_pids
    return {"held_gib": held_before / 2**30, "freed_s": watch.freed_at - killed_at,
            "replacement_on_gpu_s": watch.new_at - killed_at}


def test_sigkill_of_a_shard_actor_mid_generation_loses_nothing_and_frees_its_gpu_memory(fleet, prompt_ids, reference):
    fresh_b = reference()["fresh_b"]
    victim = fleet.status()[1]
    timings = _kill_mid_generation(fleet, prompt_ids, victim.actor_pid, [victim.actor_pid, *victim.engine_pids])
    assert timings["freed_s"] < 10, timings
    # the replacement caught up from the staged checkpoint (B) before it served
    assert greedy_each(fleet, prompt_ids)[1] == fresh_b
    print(f"\nSIGKILL actor: {timings}")


def test_sigkill_of_an_engine_core_mid_generation(fleet, prompt_ids):
    import psutil

    victim = fleet.status()[1]
    core = next((pid for pid in victim.engine_pids if "EngineCore" in " ".join(psutil.Process(pid).cmdline())
                 or "EngineCore" in psutil.Process(pid).name()), min(victim.engine_pids))
    timings = _kill_mid_generation(fleet, prompt_ids, core, [victim.actor_pid, *victim.engine_pids])
    assert timings["freed_s"] < 20, timings
    print(f"\nSIGKILL EngineCore: {timings}")
