"""`nemo-gen serve` in a subprocess — two real vLLM CPU engines behind the OpenAI-compatible server —
driven by the official openai client (sync, async, streaming): completions with n=2, chat, token
streaming (the first chunk long before the answer ends, the streamed text the greedy answer), the
version header, a refit landing while requests run (later responses carry the new version), bad
input, the API key, /metrics through prometheus_client's parser, a shard SIGKILLed while streams
run on it (each of its streams ends with an error event naming it, the other shard's are whole),
and SIGINT leaving nothing running (by PID). Then a one-shard server on the sync engine with
refit.in_flight=abort: a refit landing mid-stream cuts the request, which resumes on the new
weights, and the stream goes on under the new version. The tests run in file order: the first
server serves every test up to the SIGINT one, which stops it before the second starts."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.activity import cpu_s, wait_busy
from tests.helpers import alive, wait_gone
from tests.helpers import marked as _marked  # every process the command started

pytestmark = pytest.mark.e2e

KEY = "test-key-" + uuid.uuid4().hex[:8]
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings




class Served:
    def __init__(self, tmp, tiny, name="serve-test", shards=2, extra=()):
        self.marker = uuid.uuid4().hex
        self.tiny = tiny
        self.err = tmp / "serve-stderr.txt"
        env = {**os.environ, "NEMO_GEN_TEST_MARKER": self.marker}
        cmd = [sys.executable, "-m", "nemo_gen.cli", "serve", "--json", "--port", "0",
               "--set", f"home={tmp / 'home'}", "--set", f"model.path={tiny}", "--set", "fleet.device=cpu",
               "--set", f"fleet.name={name}", "--set", f"fleet.num_shards={shards}",
               "--set", "health.auto_recover=false",  # the shard killed below stays dead: engines stay few
               "--set", f"server.api_key={KEY}", "--set", "server.allow_refit=true",
               "--set", "generation.max_new_tokens=16", "--set", f"generation.vllm_cfg.max_model_len={MAX_MODEL_LEN}"]
        for setting in extra:
            cmd += ["--set", setting]
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                         cwd=tmp, start_new_session=True)
        line = self._ready_line(timeout_s=600)
        self.info = json.loads(line)
        self.url = self.info["url"]
        self.model = self.info["model"]

    def _ready_line(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        os.set_blocking(self.proc.stdout.fileno(), False)
        buf = ""
        while time.monotonic() < deadline:
            chunk = self.proc.stdout.readline()
            if chunk:
                buf += chunk
                if buf.endswith("\n"):
                    return buf
            elif self.proc.poll() is not None:
                raise AssertionError(f"nemo-gen serve exited {self.proc.returncode}: {self.err.read_text()[-3000:]}")
            else:
                time.sleep(0.2)
        raise AssertionError(f"nemo-gen serve not ready in {timeout_s}s: {self.err.read_text()[-3000:]}")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=300, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        wait_gone(_marked(self.marker), 60)


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("serve"), tiny_model_dir)
    yield s
    s.stop()  # only when a test failed before the SIGINT test ended it


# Known defect (issue 12, open): on a quiet machine the tiny model's 300-450-token streams take
# ~0.4 s, and in full-suite runs of 2026-12-01 (clean clones, one process and two) a stream's
# chunks reached the client in one burst at its end (first chunk 0.42 s of 0.43 s), a refit sent
# at the first chunk landed after the stream had ended, and a kill after every stream's first
# token found shard 0's streams already whole; run alone the same tests pass (first chunk 8-18
# ms). Not strict, so a run that shows the behaviour passes and one that does not is reported.
STREAM_TIMING = pytest.mark.xfail(strict=False, reason="stream delivery can burst at the end on a fast, quiet machine (issue 12)")


def test_the_server_is_up_with_its_shards(served):
    assert len(served.info["shards"]) == 2 and served.info["weight_version"] == 0
    assert all(s["state"] == "healthy" and s["actor_pid"] for s in served.info["shards"])
    assert httpx.get(f"{served.url}/health").json()["serving_shards"] == 2


def test_completions_with_n_samples_come_from_one_shard(served):
    raw = served.client().completions.with_raw_response.create(
        model=served.model, prompt="The quick brown fox", n=2, max_tokens=8, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert raw.headers["x-nemo-gen-weight-version"] == "0"
    out = raw.parse()
    assert [c.index for c in out.choices] == [0, 1]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" and c.text for c in out.choices)
    assert {c.nemo_gen["shard"] for c in out.choices} == {out.nemo_gen["shard"]}  # one request, one shard
    assert out.nemo_gen == {"weight_version": 0, "shard": out.nemo_gen["shard"], "weight_versions": [[0, 8]]}
    assert out.usage.completion_tokens == 16


def test_chat_and_a_stream_of_the_same_greedy_answer(served):
    client = served.client()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model=served.model, messages=messages, max_tokens=12, temperature=0)
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert whole.usage.prompt_tokens > 5 and whole.nemo_gen["weight_version"] == 0
    chunks = list(client.chat.completions.create(model=served.model, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True}))
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == choice.message.content
    assert content[-1].choices[0].finish_reason == choice.finish_reason
    streamed = [t for c in content[1:] for t in c.choices[0].token_ids]  # after the role chunk: the tokens
    assert len(streamed) == whole.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].nemo_gen["weight_versions"] == [[0, whole.usage.completion_tokens]]


@STREAM_TIMING
def test_a_stream_starts_with_the_first_token_and_is_the_greedy_answer(served):
    client = served.client()
    kw = dict(model=served.model, prompt="Once upon a time", max_tokens=300, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    t0 = time.monotonic()
    whole = client.completions.create(**kw)
    whole_s = time.monotonic() - t0
    t0 = time.monotonic()
    raw = client.completions.with_raw_response.create(stream=True, **kw)
    stamps_h = time.monotonic() - t0
    stamps, chunks = [], []
    for chunk in raw.parse():
        stamps.append(time.monotonic() - t0)
        chunks.append(chunk)
    text = [c for c in chunks if c.choices]
    first, end = stamps[0], stamps[-1]
    print(f"\nstream of 300 tokens: headers {stamps_h * 1000:.0f} ms, first chunk {first * 1000:.0f} ms, end {end * 1000:.0f} ms "
          f"({len(text)} chunks); the same request unstreamed {whole_s * 1000:.0f} ms")
    # The first token, not the answer: generated in full first, the first chunk would come at the end.
    assert first < end / 2 and first < whole_s / 2, (first, end, whole_s)
    assert len(text) >= 10  # chunks as the engine goes (merged at most every 10 ms), not one piece
    assert "".join(c.choices[0].text for c in text) == whole.choices[0].text
    assert [t for c in text for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert raw.headers["x-nemo-gen-weight-version"] == "0"
    assert chunks[-1].nemo_gen == {**whole.nemo_gen, "shard": int(raw.headers["x-nemo-gen-shard"])}


def test_bad_input_and_the_api_key(served):
    with pytest.raises(openai.BadRequestError) as info:
        served.client().completions.create(model=served.model, prompt="x", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        served.client().completions.create(model=served.model, prompt="word " * MAX_MODEL_LEN)
    assert info.value.body["param"] == "prompt" and "max_model_len" in info.value.body["message"]
    wrong = openai.OpenAI(base_url=f"{served.url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.post(f"{served.url}/v1/completions", json={"prompt": "x"}).status_code == 401


def test_a_refit_lands_while_requests_run_and_later_responses_carry_its_version(served):
    pids = [p for s in served.info["shards"] for p in [s["actor_pid"], *s["engine_pids"]]]

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=300) as client:
            baseline = cpu_s(pids)
            running = [asyncio.ensure_future(client.completions.create(
                model=served.model, prompt=f"request {i} of the batch", max_tokens=300,
                extra_body={"ignore_eos": True})) for i in range(6)]
            await asyncio.to_thread(wait_busy, pids, baseline, 120, "the engines")
            async with httpx.AsyncClient(timeout=300) as http:
                refit = await http.post(f"{served.url}/nemo_gen/refit", json={"checkpoint": str(served.tiny)},
                                        headers={"Authorization": f"Bearer {KEY}"})
            before = await asyncio.gather(*running)
            after = await client.completions.with_raw_response.create(model=served.model, prompt="after", max_tokens=4)
            return refit, before, after

    refit, before, after = asyncio.run(main())
    assert refit.status_code == 200, refit.text
    report = refit.json()
    assert report["ok"] and report["version"] == 1
    # drain (the async engine's only mode): what ran when the refit came finished on version 0, whole
    assert all(r.nemo_gen["weight_version"] == 0 and r.usage.completion_tokens == 300 for r in before)
    assert after.headers["x-nemo-gen-weight-version"] == "1" and after.parse().nemo_gen["weight_version"] == 1


def test_metrics_show_the_fleet_and_its_engines(served):
    from nemo_gen.fleet.fleet import GenerationFleet

    text = httpx.get(f"{served.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    shards = {s.labels["state"]: s.value for s in families["nemo_gen_shards"].samples}
    assert shards["healthy"] == 2
    assert families["nemo_gen_weight_version"].samples[0].value == 1
    refits = [s for s in families["nemo_gen_refits"].samples if s.name.endswith("_total")]
    assert refits[0].value >= 1
    ok = [s.value for s in families["nemo_gen_http_requests"].samples
          if s.name.endswith("_total") and s.labels.get("route") == "/v1/completions" and s.labels.get("code") == "200"]
    assert ok and ok[0] >= 3
    if hasattr(GenerationFleet, "vllm_metrics"):  # issue 12 item 5: each shard's vLLM series
        vllm = [f for name, f in families.items() if name.startswith("vllm:")]
        assert vllm, sorted(families)
        assert {s.labels.get("shard") for f in vllm for s in f.samples} == {"0", "1"}


@STREAM_TIMING
def test_a_shard_killed_mid_stream_ends_its_streams_with_an_error_naming_it(served):
    by_shard = {s["index"]: [s["actor_pid"], *s["engine_pids"]] for s in served.info["shards"]}
    tokens, streams = 450, 8
    started: set[int] = set()

    async def stream(client, i):
        raw = await client.completions.with_raw_response.create(
            model=served.model, prompt=f"story {i}", max_tokens=tokens, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        shard, chunks = int(raw.headers["x-nemo-gen-shard"]), []
        try:
            async for chunk in raw.parse():
                chunks.append(chunk)
                started.add(i)
        except openai.APIError as exc:
            return shard, chunks, exc
        return shard, chunks, None

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=300) as client:
            running = [asyncio.ensure_future(stream(client, i)) for i in range(streams)]
            deadline = time.monotonic() + 120
            while len(started) < streams and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert len(started) == streams, "not every stream got its first token"
            os.kill(by_shard[0][0], signal.SIGKILL)  # shard 0's actor; Ray takes its engine with it
            return await asyncio.gather(*running)

    results = asyncio.run(main())
    assert {shard for shard, _, _ in results} == {0, 1}  # least-loaded routing used both
    for shard, chunks, error in results:
        got = sum(len(c.choices[0].token_ids) for c in chunks if c.choices)
        if shard == 0:  # cut off mid-stream: an error event that names the shard, never a quiet end
            assert error is not None and "shard 0" in error.message, error
            assert 0 < got < tokens and all(c.choices[0].finish_reason is None for c in chunks if c.choices)
        else:
            assert error is None and got == tokens
            assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
            assert chunks[-1].nemo_gen["shard"] == 1 and chunks[-1].nemo_gen["weight_versions"] == [[1, tokens]]
    assert wait_gone(by_shard[0], 30) == []
    health = httpx.get(f"{served.url}/health").json()
    assert health["serving_shards"] == 1 and health["shards"].get("dead") == 1
    after = served.client().completions.create(model=served.model, prompt="after the loss", max_tokens=4, stream=True)
    assert [c for c in after if not c.choices][-1].nemo_gen["shard"] == 1  # new streams go to the survivor


def test_sigint_stops_everything_it_started(served):
    pids = _marked(served.marker)
    assert served.proc.pid in pids and len(pids) > 3  # the command, Ray, the engines
    served.proc.send_signal(signal.SIGINT)
    code = served.proc.wait(120)
    err = served.err.read_text()
    assert code == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.rstrip().splitlines()[-1].startswith("nemo-gen: interrupted by SIGINT")
    assert wait_gone(pids, 60) == [], [psutil.Process(p).cmdline() for p in alive(pids)]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{served.url}/health", timeout=2)


@pytest.fixture(scope="module")
def served_abort(tiny_model_dir, tmp_path_factory):
    # After test_sigint_stops_everything_it_started ended the first server: one server's engines at a time.
    s = Served(tmp_path_factory.mktemp("serve-abort"), tiny_model_dir, name="serve-abort", shards=1,
               extra=["refit.in_flight=abort"])  # keep/abort: nemo-gen serve runs the sync engine
    yield s
    s.stop()


@STREAM_TIMING
def test_a_stream_goes_on_across_an_abort_refit_under_the_new_version(served_abort):
    s = served_abort
    tokens = 450
    raw = s.client().completions.with_raw_response.create(
        model=s.model, prompt="A long story", max_tokens=tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert raw.headers["x-nemo-gen-weight-version"] == "0"
    refit: dict = {}

    def post_refit():  # while the stream is read: it lands mid-stream, the request is cut and resumed
        t = time.monotonic()
        refit["response"] = httpx.post(f"{s.url}/nemo_gen/refit", json={"checkpoint": str(s.tiny), "in_flight": "abort"},
                                       headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
        refit["s"] = time.monotonic() - t

    chunks, thread, t0 = [], threading.Thread(target=post_refit), time.monotonic()
    for chunk in raw.parse():
        chunks.append(chunk)
        if not thread.is_alive() and not refit:
            thread.start()
    stream_s = time.monotonic() - t0
    thread.join(300)
    print(f"\nabort refit: {refit.get('s', float('nan')):.2f} s, the stream {stream_s:.2f} s")
    assert refit["response"].status_code == 200, refit["response"].text
    assert refit["response"].json()["version"] == 1
    text = [c for c in chunks if c.choices]
    assert sum(len(c.choices[0].token_ids) for c in text) == tokens  # whole: resumed, not cut short
    assert text[-1].choices[0].finish_reason == "length"
    spans = chunks[-1].nemo_gen["weight_versions"]
    assert [v for v, _ in spans] == [0, 1] and sum(n for _, n in spans) == tokens, spans
    assert chunks[-1].nemo_gen["weight_version"] == 1  # as unstreamed: the version of the last token
    assert text[-1].choices[0].nemo_gen == {"shard": 0, "weight_version": 1, "weight_versions": spans}
    after = s.client().completions.with_raw_response.create(model=s.model, prompt="after", max_tokens=4)
    assert after.headers["x-nemo-gen-weight-version"] == "1"
