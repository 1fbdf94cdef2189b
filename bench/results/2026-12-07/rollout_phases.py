"""Where a rollout step's time goes, from the py-spy raw records of `python -m bench rollout
--profile-batch` (bench/lib/pyspy.py: 3 s at 200 Hz, idle samples left out, one file a process).

    python3 rollout_phases.py STEP_MS RAW [RAW ...]

Each sample goes to the phase of the outermost marker frame on its stack (PHASES, in order), and,
within it, to the owner of its innermost frame that is nemo_gen's or vLLM's (nemo_gen: any
`nemo_gen/` file). Shares are of the record's wall time (3 s x 200 Hz per thread), so a phase's
share x STEP_MS (the batch's ms per engine step) is the ms of each step that thread spent in it.
"""

from __future__ import annotations

import collections
import sys

DURATION_S, RATE_HZ = 3.0, 200
PHASES = [  # (marker in a frame's text, phase name): the first marker found from the outermost frame wins
    ("Scheduler.schedule ", "core: schedule"),
    ("Scheduler.update_from_output ", "core: update_from_output"),
    ("UniProcExecutor.execute_model ", "core: execute_model (prepare inputs, launch)"),
    ("UniProcExecutor.sample_tokens ", "core: sample_tokens"),
    ("AsyncOutputFuture.result ", "core: wait for the step's output"),
    ("MsgpackEncoder.", "core: msgpack encode outputs"),
    ("process_output_sockets (vllm/v1/engine/core.py", "core: output socket thread"),
    ("process_input_sockets", "core: input socket thread"),
    ("MsgpackDecoder.decode ", "front: msgpack decode outputs"),
    ("StatLoggerManager.record ", "front: stats"),
    ("PrometheusStatLogger.record ", "front: stats"),
    ("get_output ", "front: wait for the core's outputs"),
    ("LogprobsProcessor.update_from_output ", "front: logprob objects"),
    ("OutputProcessor._update_stats_from_output ", "front: stats"),
    ("IterationStats.update_from_output ", "front: stats"),
    ("make_request_output ", "front: request outputs"),
    ("OutputProcessor.process_outputs ", "front: process_outputs (rest)"),
    ("_run_to_completion ", "nemo_gen: sync step loop (rest: results at the end)"),
    ("AsyncEngine._one ", "nemo_gen: async per-request loop (a wake-up per step)"),
    ("output_handler ", "front: AsyncLLM output handler (rest)"),
]


def owner(frames: list[str]) -> str:
    for f in reversed(frames):
        if "nemo_gen/" in f:
            return "nemo_gen"
        if "vllm/" in f:
            return "vllm"
    return "other"


def phases(path: str) -> tuple[dict, dict]:
    by_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    own: collections.Counter = collections.Counter()
    for line in open(path):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else "?"
        body = frames[1:]
        phase = next((name for marker, name in PHASES for f in body if marker in f), "other")
        by_thread[thread][phase] += int(n)
        own[owner(body)] += int(n)
    return by_thread, own


def main() -> None:
    step_ms = float(sys.argv[1])
    wall = DURATION_S * RATE_HZ
    for path in sys.argv[2:]:
        by_thread, own = phases(path)
        print(f"== {path}   (share of wall; ms of a {step_ms:.1f} ms step)")
        for thread, c in sorted(by_thread.items(), key=lambda kv: -sum(kv[1].values())):
            total = sum(c.values())
            print(f"  {thread}: active {total / wall:.2f} ({total / wall * step_ms:.1f} ms)")
            for phase, k in c.most_common():
                if k / wall >= 0.01:
                    print(f"    {phase:<48} {k / wall:5.2f}  {k / wall * step_ms:5.1f} ms")
        total = sum(own.values())
        print("  innermost owner: " + ", ".join(f"{o} {k / total:.2f}" for o, k in own.most_common()))


if __name__ == "__main__":
    main()
