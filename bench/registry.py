"""Every benchmark, its target and where it runs: the one list ``python -m bench`` dispatches
over and bench/README.md mirrors (a unit test keeps the three in step). Helpers are programs the
benchmarks start in processes of their own; they are not benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str  # the module bench/<name>.py and the command ``python -m bench <name>``
    device: str  # "cpu": the 2-core machine, under the engine lock; "gpu": the lent GPU host; "none": pure logic
    target: str  # what it checks, as the docstring states it


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("control_plane", "none", "control-loop tick < 10 ms and routing < 20 us per request at 10,000 shards"),
    Benchmark("fleet_overhead", "cpu", "fleet / direct tokens/s >= 0.95; Prefect / plain pipeline wall <= 1.10"),
    Benchmark("serve", "cpu", "HTTP / library tokens/s >= 0.9 at the same concurrency; --vllm-serve: nemo-gen serve / vllm serve (same model, engine settings, client) output tokens/s >= 0.95 and median TTFT <= 1.1x at 16 and 64 streams"),
    Benchmark("sessions", "cpu", "affinity raises the prefix-cache hit rate; placement keeps it and throughput vs affinity, round-robin"),
    Benchmark("gateway", "cpu", "a recorded gateway session / /v1/chat/completions directly: time per turn <= 1.05"),
    Benchmark("overload", "cpu", "at 4x capacity, abusive clients mixed in: load shed with 503s, nothing lost or hung, no slot held, no engine death, goodput held, /health fast"),
    Benchmark("recovery", "cpu", "SIGKILL detected <= 1 s; full strength with a spare <= 2 s; no spare <= 1.2x a cold start"),
    Benchmark("migration", "cpu", "a 2-shard fleet, 32 requests of 512 tokens, one shard SIGKILLed at 75%: wasted tokens with migration <= 5% of without; time to the last result"),
    Benchmark("crash_resume", "cpu", "SIGKILLed and resumed `nemo-gen generate` output equals an uninterrupted run's"),
    Benchmark("refit", "cpu", "refit bandwidth >= 0.5 of memory copy; faster than an engine restart"),
    Benchmark("refit_call", "cpu", "a refit's fixed cost: direct control channel well under a Ray actor call"),
    Benchmark("refit_digest", "cpu", "the weight digest's cost (trainer and shard side) as a fraction of a refit's time, measured; results carry it"),
    Benchmark("refit_inflight", "cpu", "tokens/s kept under refits every few seconds, per in-flight mode (drain, keep, abort)"),
    Benchmark("rolling_refit", "cpu", "a 4-shard fleet under session load, a refit every few seconds: waves tokens/s during refits >= 0.95 of no refit, 0 aborts, against all in each in-flight mode (longest no-step stretch, aborts per refit, version spread per session)"),
    Benchmark("rl_step", "cpu", "an async GRPO step takes less wall time than a sync one (examples/grpo.py's loop)"),
    Benchmark("step_loop", "cpu", "the shard's batch step loop / vLLM's LLM.generate <= 1.05"),
    Benchmark("front_end", "cpu", "the shard actor's front-end work per batch close to a plain process's; a fleet batch's, text decoded by the router, below the engine's own text"),
    Benchmark("engine_start", "cpu", "engine launch: forkserver against spawn, same tokens, time per launch"),
    Benchmark("gpu_bench", "gpu", "refit >= 0.5 of copy bandwidth, launch and throughput near a bare vLLM, restart after SIGKILL"),
    Benchmark("gpu_recovery", "gpu", "SIGKILL -> full strength with a warm spare; no orphaned GPU memory"),
    Benchmark("refit_digest_gpu", "gpu", "the weight digest of a 16 GB nemo_gen_ipc refit, trainer and shard side, adds <= 0.3 of the refit's time"),
    Benchmark("sleep_wake_gpu", "gpu", "sleep level 1 frees >= 0.9 of a colocated 8B-shaped engine's GPU memory; wake(weights) + wake(kv_cache) gives the same greedy tokens; sleep + wake against a cold launch"),
    Benchmark("cuda_ipc_refit", "gpu", "CUDA-IPC bucketed refit bandwidth as a fraction of device copy"),
    Benchmark("lora_fp8_gpu", "gpu", "an adapter refit moves <= 1/10 of a full refit's bytes, faster; FP8 refit from bf16 gives a fresh FP8 engine's tokens; FP8 / bf16 tokens/s >= 1.3 at each rollout batch, both fleets up side by side"),
    Benchmark("fp8_gemm_gpu", "gpu", "the most FP8 can give over bf16 for a decode step's matrix multiplies, by batch (Llama-3-8B's shapes): step ratio >= 1.3 where lora_fp8_gpu's target is reachable"),
    Benchmark("rollout", "gpu", "fleet / bare vLLM (best settings) rollout tokens/s >= 0.9 at each batch, with logprobs; ms per step, GPU busy share, fraction of the roofline, py-spy profile by process"),
    Benchmark("mps_overlap", "gpu", "a trainer and a generator process on one GPU: the slowdown each costs the other, with and without CUDA MPS"),
)

# Programs the benchmarks run in their own processes (by path, with arguments of their own).
HELPERS: dict[str, str] = {
    "http_load": "closed-loop HTTP load, /health prober and abusive clients (overload)",
    "gpu_bare_vllm": "a bare vllm.LLM in a plain process (gpu_bench, front_end, step_loop)",
    "rollout_bare": "a bare vllm.LLM at vLLM's best rollout settings in a plain process (rollout)",
}


def find(name: str) -> Benchmark:
    for b in BENCHMARKS:
        if b.name == name:
            return b
    raise KeyError(name)
