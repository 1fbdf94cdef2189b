"""The child of ``test_orphan_gpu.py`` (and ``bench/gpu_recovery.py``'s orphan step): a fleet in a
Ray cluster of its own whose raylet runs with ``RAY_process_group_cleanup_enabled=0`` (set by
the parent: the raylet reads it when it starts), so a SIGKILLed shard actor leaves its EngineCore
running on the GPU.

    python orphan_run.py WORKDIR

Talks to its parent in lines on stdout/stdin: prints ``ORPHANS {json}`` once the fleet reports
the orphan (with what NVML says it holds), then waits for a line on stdin (the parent kills the
orphan by PID meanwhile), then prints ``RESULT {json}`` (what the fleet reports after) and shuts
the fleet down.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from tests.helpers import wait_until


def main(work: Path) -> None:
    from nemo_gen import GenerationFleet
    from nemo_gen.host import gpu_memory
    from nemo_gen.settings import NemoGenSettings
    from nemo_gen.tiny_model import make_tiny_model

    assert os.environ.get("RAY_process_group_cleanup_enabled") == "0", "the parent sets the raylet's cleanup off"
    settings = NemoGenSettings.load(overrides={
        "home": str(work / "home"), "model.path": str(make_tiny_model(work / "tiny")), "fleet.name": "orphan",
        "fleet.device": "gpu", "fleet.num_shards": 1, "fleet.shards_per_gpu": 2,
        "generation.vllm_cfg.precision": "bfloat16", "generation.vllm_cfg.enforce_eager": True,
        "generation.vllm_cfg.max_model_len": 256, "generation.vllm_cfg.gpu_memory_utilization": 0.15,
        "health.probe_interval_s": 1.0, "health.probe_timeout_s": 20.0, "health.restart_backoff_s": 0.0,
        "health.restart_jitter": 0.0, "health.reap_timeout_s": 5.0, "ray.namespace": "nemo_gen_orphan",
    })
    fleet = GenerationFleet.launch(settings)
    try:
        victim = fleet.status()[0]
        os.kill(victim.actor_pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: fleet.status()[0].orphans, 120, "the orphan reported", poll_s=0.2)
        reported_s = time.monotonic() - killed
        orphans = fleet.status()[0].orphans
        held = gpu_memory.used_by_pids([o["pid"] for o in orphans])
        print("ORPHANS " + json.dumps({"actor_pid": victim.actor_pid, "engine_pids": victim.engine_pids,
                                       "reported_s": reported_s, "orphans": orphans,
                                       "nvml_bytes": {str(p): b for p, b in held.items()}}, default=str), flush=True)
        sys.stdin.readline()  # the parent has killed them
        wait_until(lambda: not fleet.status()[0].orphans, 30, "the orphan gone from the report", poll_s=0.2)
        wait_until(lambda: fleet.health.state_of(0).value == "healthy", 240, "a replacement serving", poll_s=0.2)
        results = fleet.generate([[1, 5, 6, 7]], temperature=0, max_new_tokens=4)
        print("RESULT " + json.dumps({"orphans_after": fleet.status()[0].orphans,
                                      "state": fleet.health.state_of(0).value,
                                      "serves": all(r.ok for r in results)}, default=str), flush=True)
    finally:
        fleet.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
