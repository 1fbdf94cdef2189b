"""Front-end CPU per output token of a plain vLLM `LLM` (the tiny model, CPU): text decoding and logprobs on and off.

Run from the project root: VLLM_CPU_KVCACHE_SPACE=4 PYTHONPATH=$PWD .venv/bin/python bench/results/2026-12-06/vllm-front-end-arms.py
(B prompts x T tokens, R rounds; PROF=ARM profiles one arm)."""
import os, sys, time, json, gc, cProfile, pstats, io
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from nemo_gen.tiny_model import make_tiny_model
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind

def main():
    model = make_tiny_model("/tmp/fe/tiny", max_position_embeddings=1024)
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_num_seqs=512, max_model_len=512,
              max_num_batched_tokens=16384, seed=0)
    B, T = int(os.environ.get("B", 512)), int(os.environ.get("T", 64))
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 500 + 3 for j in range(32)]) for i in range(B)]
    def run(label, **kw):
        p = SamplingParams(max_tokens=T, ignore_eos=True, temperature=0, **kw)
        p.output_kind = RequestOutputKind.FINAL_ONLY
        gc.collect(); gc.freeze()
        c0, w0 = time.process_time(), time.perf_counter()
        prof = cProfile.Profile() if os.environ.get("PROF") == label else None
        if prof: prof.enable()
        outs = llm.generate(prompts, p, use_tqdm=False)
        if prof: prof.disable()
        c, w = time.process_time() - c0, time.perf_counter() - w0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"arm": label, "tokens": n, "front_cpu_s": round(c, 3), "wall_s": round(w, 3),
                          "us_per_token": round(1e6 * c / n, 2)}), flush=True)
        if prof:
            s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[:6000])
    arms = {"detok+lp0": dict(logprobs=0), "detok": dict(), "nodetok+lp0": dict(detokenize=False, logprobs=0),
            "nodetok": dict(detokenize=False), "nodetok+lp0+flat": dict(detokenize=False, logprobs=0, flat_logprobs=True), "detok+lp0+flat": dict(logprobs=0, flat_logprobs=True)}
    run("warm", detokenize=False)
    for r in range(int(os.environ.get("R", 2))):
        for k, kw in arms.items():
            run(k, **kw)

if __name__ == '__main__':
    main()
