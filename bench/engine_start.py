"""One-shard CPU fleet launched with each fleet.engine_core_start, timed, alternating.

Run: ``.venv/bin/python bench/engine_start.py forkserver,spawn,forkserver,spawn``. Prints, for each
launch, its wall time, the engine's load time (``load_s``), the method the shard used, the
EngineCore's parent (the forkserver, or the actor itself when spawned) and the greedy tokens (the
same for both). On 2026-12-03, on this 2-core machine, it gave a launch of 37.5 s (forkserver, the
first and cold), 34.5 s (spawn), 26.3 s (forkserver) and 33.4 s (spawn); load_s was 23.0 / 33.1 /
15.9 / 31.7 s. Results go to /tmp/fs/out.json.
"""
import sys, time, json, psutil, ray
from nemo_gen import GenerationFleet
from nemo_gen.settings import NemoGenSettings
from nemo_gen.tiny_model import make_tiny_model
from nemo_gen.environment import configure_environment
import os
os.makedirs("/tmp/fs", exist_ok=True)
model = make_tiny_model("/tmp/fs/tiny")
configure_environment(NemoGenSettings.load())
ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="fs", log_to_driver=False)
order = sys.argv[1].split(",")
out = []
for i, method in enumerate(order):
    s = NemoGenSettings.load(overrides={"home": "/tmp/fs/home", "model.path": str(model), "fleet.device": "cpu",
        "ray.namespace": "fs", "fleet.name": f"fs{i}", "fleet.num_shards": 1, "generation.max_new_tokens": 8,
        "generation.vllm_cfg.max_model_len": 256, "fleet.engine_core_start": method})
    t0 = time.monotonic()
    fleet = GenerationFleet.launch(s)
    dt = time.monotonic() - t0
    st = fleet.status()[0]
    parents = {p: psutil.Process(p).ppid() for p in st.engine_pids}
    r = fleet.generate(["Hello there"], temperature=0)
    info = fleet.shards[0].info
    out.append({"method": method, "launch_s": round(dt, 1), "used": info.get("engine_core_start"), "actor": st.actor_pid,
                "parents": parents, "tokens": r[0].token_ids, "load_s": info.get("load_s")})
    print(out[-1], flush=True)
    fleet.shutdown()
json.dump(out, open("/tmp/fs/out.json", "w"))
ray.shutdown()
