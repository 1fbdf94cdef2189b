"""The colocated layout on a real CUDA fleet (``generation.colocated.enabled``): engines that sleep
and wake with vLLM's sleep mode, refit in NeMo-RL's order, and NeMo-RL's own IPC/ZMQ sender.

Needs CUDA and vLLM's CUDA build (skipped elsewhere; CI has no GPU). On the GPU host::

    python -m pytest tests/gpu/test_colocated_gpu.py -v

One 1-shard fleet for the module (its own Ray cluster) on tiny model A; the reference for "what
weights B generate" is a bare engine that loaded B (``reference_engine.py``'s ``fresh_b``). This
process plays NeMo-RL's colocated policy worker: it streams weights to the engine through
``stream_weights_via_ipc_zmq``'s protocol (CUDA IPC handles of packed buffers over ZMQ). The tests
run in file order; each leaves the fleet asleep or serving as it says.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.helpers import wait_until

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, my name is"]
TOKENS = 16
UTIL = 0.3  # the engine's share: what sleep must give back
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def fresh_b(models, prompt_ids, tmp_path_factory):
    """Greedy tokens of a fresh engine on weights B (run before the fleet starts: the GPU is free)."""
    out = tmp_path_factory.mktemp("reference") / "reference.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "reference_engine.py"), str(out), str(models[1]), str(models[0]),
                           json.dumps(prompt_ids), str(TOKENS), "0.1"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())["fresh_b"]


@pytest.fixture(scope="module")
def fleet(models, fresh_b, tmp_path_factory):
    from nemo_gen import GenerationFleet
    from nemo_gen.settings import NemoGenSettings

    settings = NemoGenSettings.load(overrides={
        "home": str(tmp_path_factory.mktemp("colocated-home")),
        "model.path": str(models[0]),
        "fleet.name": "gpu-colocated",
        "fleet.device": "gpu",
        "fleet.num_shards": 1,
        "fleet.engine_start_timeout_s": 400,
        "ray.namespace": "nemo_gen_gpu_colocated",
        "generation.colocated.enabled": True,
        "generation.max_new_tokens": TOKENS,
        "generation.vllm_cfg.precision": "bfloat16",
        "generation.vllm_cfg.enforce_eager": True,
        "generation.vllm_cfg.max_model_len": 256,
        "generation.vllm_cfg.gpu_memory_utilization": UTIL,
        "health.probe_interval_s": 1.0,
        "health.probe_timeout_s": 20.0,
        "health.restart_backoff_s": 0.2,
        "health.reap_timeout_s": 15.0,
    })
    f = GenerationFleet.launch(settings)
    yield f
    f.shutdown()


def greedy(fleet, prompt_ids) -> list[list[int]]:
    out = []
    for ids in prompt_ids:
        (r,) = fleet.generate([ids], temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
        assert r.ok, r.error
        out.append(r.token_ids)
    return out


def held_bytes(fleet) -> int:
    """GPU memory held by the shard's processes (NVML, per process)."""
    from nemo_gen.host import gpu_memory

    (s,) = fleet.status()
    pids = {s.actor_pid, *s.engine_pids}
    return sum(p.used_bytes or 0 for p in gpu_memory.gpu_processes() if p.pid in pids)


def test_sleep_level_1_releases_90_percent_of_the_engines_gpu_memory(fleet, prompt_ids):
    fleet.initial_tokens = greedy(fleet, prompt_ids)
    awake = held_bytes(fleet)
    assert awake > 0.5 * UTIL * torch.cuda.get_device_properties(0).total_memory
    report = fleet.sleep(1)
    assert not report.failed and fleet.status()[0].sleep == "asleep (level 1)"
    asleep = wait_until(lambda: (b := held_bytes(fleet)) <= 0.1 * awake and b, 60, "the memory released") or 0
    print(f"\nsleep level 1: {awake / 2**30:.2f} GiB -> {asleep / 2**30:.2f} GiB in {report.seconds[0]:.2f} s")
    t = fleet.wake().seconds[0]
    assert greedy(fleet, prompt_ids) == fleet.initial_tokens  # level 1 keeps the weights
    print(f"wake: {t:.2f} s")


def nemo_rl_stream(policy: torch.nn.Module, buffer_size_bytes: int, done: dict) -> None:
    """NeMo-RL's ``stream_weights_via_ipc_zmq_impl``, as its colocated policy worker runs it."""
    import zmq
    from torch.multiprocessing.reductions import reduce_tensor

    from nemo_gen.core.ipc_zmq import aligned

    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    for option in (zmq.SNDTIMEO, zmq.RCVTIMEO):
        sock.setsockopt(option, 120_000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc:///tmp/GPU-{torch.cuda.get_device_properties(0).uuid}.sock")
    half = buffer_size_bytes // 2
    buffers = [torch.empty(aligned(half), dtype=torch.uint8, device="cuda") for _ in range(2)]
    current, used, names, await_recv = 0, 0, [], False

    def send(buffer, names, used, await_recv):
        torch.cuda.current_stream().synchronize()
        handle = reduce_tensor(buffer.detach())[1:]
        if await_recv:
            sock.recv()
        sock.send_pyobj((handle, list(names), used))

    try:
        for name, tensor in policy.state_dict().items():
            nbytes = tensor.numel() * tensor.element_size()
            assert aligned(nbytes) <= half, "the test's buffer fits every tensor of the tiny model"
            if used + aligned(nbytes) > half:
                send(buffers[current], names, used, await_recv)
                await_recv, current, used, names = True, 1 - current, 0, []
            buffers[current][used:used + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
            names.append(name)
            used += aligned(nbytes)
        if names:
            send(buffers[current], names, used, await_recv)
            await_recv = True
        if await_recv:
            sock.recv()
        sock.send_pyobj("complete")  # IPCProtocol.COMPLETE's value (the enum needs nemo_rl installed)
        sock.recv()
        done["ok"] = True
    except BaseException as exc:
        done["error"] = exc
    finally:
        sock.close()
        context.term()


def test_a_nemo_rl_ipc_zmq_sender_refits_the_fleet_through_vllm_generation(fleet, models, prompt_ids):
    from transformers import AutoModelForCausalLM

    from nemo_gen.generation.vllm import VllmGeneration

    gen = VllmGeneration(fleet=fleet)
    policy = AutoModelForCausalLM.from_pretrained(str(models[0]), dtype=torch.bfloat16).cuda()
    gen.prepare_refit_info({k: (v.shape, v.dtype) for k, v in policy.state_dict().items()})
    assert gen.finish_generation()  # asleep, as after a rollout
    assert gen.prepare_for_generation(tags=["weights"])
    done: dict = {}
    sender = threading.Thread(target=nemo_rl_stream, args=(policy, 64 * 2**20, done))
    sender.start()  # launched first, as refit_policy_generation does
    import ray

    results = ray.get(gen.update_weights_via_ipc_zmq())
    sender.join(120)
    assert done.get("ok"), done.get("error")
    assert results == [True]
    assert gen.prepare_for_generation(tags=["kv_cache"])
    assert greedy(fleet, prompt_ids) == fleet.initial_tokens  # weights A again, through NeMo-RL's wire
    del policy
    torch.cuda.empty_cache()


def test_wake_weights_refit_wake_kv_cache_gives_a_fresh_engines_tokens(fleet, models, prompt_ids, fresh_b):
    fleet.sleep(1)
    fleet.wake(["weights"])
    report = fleet.refit(str(models[1]))
    assert all(s.ok for s in report.shards)
    assert fleet.sleep_state.resident == {"weights"}
    fleet.wake(["kv_cache"])
    assert greedy(fleet, prompt_ids) == fresh_b


def test_sigkill_while_asleep_recovers_to_a_sleeping_shard_at_the_fleets_version(fleet, prompt_ids, fresh_b):
    from nemo_gen.core.fleet_health import ShardState

    version = fleet.weight_version
    fleet.sleep(1)
    (before,) = fleet.status()
    os.kill(before.actor_pid, signal.SIGKILL)
    wait_until(lambda: fleet.handle(0).name != before.name and fleet.health.state_of(0) is ShardState.HEALTHY,
               300, "slot 0 replaced")
    (after,) = fleet.status()
    assert after.sleep == "asleep (level 1)" and after.weight_version == version
    assert wait_until(lambda: held_bytes(fleet) <= 0.2 * UTIL * torch.cuda.get_device_properties(0).total_memory,
                      60, "the newcomer asleep")
    fleet.wake()
    assert greedy(fleet, prompt_ids) == fresh_b
