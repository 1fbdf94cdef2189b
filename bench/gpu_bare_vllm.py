"""A bare ``vllm.LLM`` (no Ray, no nemo_gen): the baseline ``bench/gpu_bench.py`` compares a
fleet's launch and generation throughput with. Run by it as a subprocess::

    python -m bench.gpu_bare_vllm OUT.json MODEL UTIL MAX_MODEL_LEN PROMPTS.json MAX_TOKENS [LOGPROBS_MODE [serve]]

Writes the seconds of ``import vllm`` and of ``LLM(...)`` (the engine's own log lines, in the
caller's capture of this process's output, break the latter down), and the generation throughput
of the prompts (token ids) at temperature 0 with EOS ignored, best of two runs. ``LOGPROBS_MODE``
(vLLM's default when left out): the caller passes the fleet's, so that the two run one engine config.

With ``serve`` the engine stays up after OUT.json is written: each ``run`` line on stdin is one more
timed run of the same batch, answered on stdout as ``BARE {"seconds": ..., "tokens": ...,
"front_end": ...}`` (vLLM's own log lines share stdout; ``front_end``: ``front_end.FrontEndClock``'s
split of the run), until ``quit`` or the end of stdin. A ``freeze`` line freezes this process's
heap (vLLM's ``freeze_gc_heap``, as a shard actor does once its engine is up), answered
``BARE {}``. The caller interleaves these with the fleet's runs, so that both are measured in the
same minutes of the same GPU.

``BARE_ENGINE_KWARGS`` (a JSON file) replaces the engine arguments with those given (a fleet shard's
own, nemo_gen's worker extension and weight-transfer engine included): the same engine, outside
Ray and nemo_gen.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    out_path, model, util, max_len, prompts_path, max_tokens = sys.argv[1:7]
    engine_args = {"logprobs_mode": sys.argv[7]} if len(sys.argv) > 7 else {}
    serve = len(sys.argv) > 8 and sys.argv[8] == "serve"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    t0 = time.monotonic()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import_s = time.monotonic() - t0
    from nemo_gen.host.gpu_memory import engine_start_lock

    t1 = time.monotonic()
    with engine_start_lock() as lock:  # as a fleet's engine would, on a shared GPU
        t2 = time.monotonic()
        if os.environ.get("BARE_ENGINE_KWARGS"):  # a JSON file of a fleet shard's own engine arguments
            engine_args = json.load(open(os.environ["BARE_ENGINE_KWARGS"]))
            llm = LLM(**engine_args)
        else:
            llm = LLM(model=model, dtype="bfloat16", gpu_memory_utilization=float(util), max_model_len=int(max_len),
                      seed=0, disable_log_stats=True, **engine_args)
    llm_s = time.monotonic() - t2
    from bench.front_end import clock_of

    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.load(open(prompts_path))]
    sampling = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True, logprobs=0)
    llm.generate(prompts[:8], sampling, use_tqdm=False)  # warm-up, as the fleet's first batch is not timed either

    clock = clock_of(llm)

    def timed_run() -> dict:
        clock.reset()
        t = time.perf_counter()
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        return {"seconds": time.perf_counter() - t, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "front_end": clock.read()}

    runs = [timed_run() for _ in range(2)]
    best = min(runs, key=lambda r: r["seconds"])
    with open(out_path, "w") as f:
        json.dump({"vllm": vllm.__version__, "engine_args": engine_args, "import_s": import_s, "lock_wait_s": t2 - t1,
                   "llm_s": llm_s, "total_s": import_s + llm_s, "lock_waited_s": lock.waited_s, "runs": runs,
                   "tokens_per_s": best["tokens"] / best["seconds"]}, f)
    if serve:
        print("BARE READY", flush=True)
        for line in sys.stdin:
            if line.strip() == "freeze":
                from vllm.utils.gc_utils import freeze_gc_heap

                freeze_gc_heap()
                print("BARE {}", flush=True)
                continue
            if line.strip() != "run":
                break
            print("BARE " + json.dumps(timed_run()), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
