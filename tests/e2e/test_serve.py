"""`nemo-gen serve` in a subprocess — two real vLLM CPU engines behind the OpenAI-compatible server —
driven by the official openai client (sync, async, streaming): completions with n=2, chat, token
streaming (the first chunk long before the answer ends, the streamed text the greedy answer), the
version header, a refit landing while requests run (later responses carry the new version), bad
input, the API key, /metrics through prometheus_client's parser, a shard SIGKILLed while streams
run on it (each of its streams ends with an error event naming it, the other shard's are whole),
and SIGINT leaving nothing running (by PID). Then a one-shard server on the sync engine with
refit.in_flight=abort: a refit landing mid-stream cuts the request, which resumes on the new
weights, and the stream goes on under the new version. The first server is shared by the tests up
to the SIGINT one (tests/helpers.py's ``SharedFleet``), checked on entry (running, both shards
serving); the versions a test expects are read when it starts, and the shard-loss and SIGINT
tests spend the server, so the tests pass in any order.

Mid-stream tests do not race the engine. This process is the client, and its reading can lag the
server by whole streams while the server sends every chunk on time (measured at the engine, the
shard's yield, the driver and the server's send, issue 12): with the server in a session of its own
the engines' CPU share came out of the client's (its threads waited on the run queue for 4.1 s of a
4.2 s round of streams), and a full collection of a full suite's heap (~720,000 objects) takes
~0.4 s, as long as a stream of the tiny model. So the server runs in this session (``Served``), the
collector leaves this module's heap alone (``gc.freeze``), and a test that needs "mid-stream" makes
it so: at a stream's first chunk it freezes the shard's engine processes (SIGSTOP, ``Frozen``) —
the actor, router and server run on, only generation stands still — reads what was already sent,
and acts (or checks) while the stream cannot end. A stream found already over (the client lagged)
is tried again, up to ATTEMPTS, never passed. Streams are as long as the context allows (ignore_eos)."""

from __future__ import annotations

import asyncio
import gc
import http.client
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
from tests.helpers import SharedFleet, alive, wait_gone
from tests.helpers import marked as _marked  # every process the command started

pytestmark = pytest.mark.e2e

KEY = "test-key-" + uuid.uuid4().hex[:8]
MAX_MODEL_LEN = 512  # the tiny model's max_position_embeddings
ATTEMPTS = 3  # a mid-stream test tries again only when its stream was over before the client saw it
QUIET_S = 0.5  # frozen engine, no new chunk for this long: the client has read what was sent
SETTLE_TIMEOUT_S = 30.0


@pytest.fixture(scope="module", autouse=True)
def no_full_collections():
    """This process's heap (a full suite's: vLLM, torch, Ray...) out of the collector's view while
    the module runs: a full collection over it stops the client reading for ~0.4 s."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


class Frozen:
    """The block runs with these engine processes (a shard's EngineCore and workers) stopped
    (SIGSTOP): the shard's generation stands still while its actor, the router and the server go on,
    so a stream that is unfinished when the block begins stays unfinished until it ends (SIGCONT)."""

    def __init__(self, pids):
        self.pids = list(pids)
        assert self.pids, "no engine processes to freeze"

    def _signal(self, sig) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "Frozen":
        self._signal(signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        self._signal(signal.SIGCONT)


def tokens_in(chunks) -> int:
    return sum(len(c.choices[0].token_ids) for c in chunks if c.choices)


def over(chunks) -> bool:
    """A choice of the stream has finished (its last chunk has come)."""
    return any(c.choices and c.choices[0].finish_reason for c in chunks)


class Reader(threading.Thread):
    """One stream's chunks, read on a thread of their own so that the test can wait on what has
    arrived (``wait_first``, ``settle``) while reading goes on."""

    def __init__(self, raw):
        super().__init__(daemon=True)
        self.raw, self.chunks, self.error, self.done = raw, [], None, False
        self.last_at = time.monotonic()
        self.cond = threading.Condition()
        self.start()

    def run(self) -> None:
        try:
            for chunk in self.raw.parse():
                with self.cond:
                    self.chunks.append(chunk)
                    self.last_at = time.monotonic()
                    self.cond.notify_all()
        except openai.APIError as exc:
            self.error = exc
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def tokens(self) -> int:
        with self.cond:
            return tokens_in(self.chunks)

    @property
    def finished(self) -> bool:
        with self.cond:
            return self.done or over(self.chunks)

    def wait_first(self, timeout_s: float = 120.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.chunks or self.done, timeout_s), "no first chunk"

    def settle(self) -> None:
        """Returns once the stream is over, or no chunk came for QUIET_S (its engine frozen: the
        client has read what the server sent)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        with self.cond:
            while not self.finished and time.monotonic() < deadline:
                quiet = time.monotonic() - self.last_at
                if quiet >= QUIET_S:
                    return
                self.cond.wait(QUIET_S - quiet)


def longest(client, model, prompt) -> int:
    """The most new tokens the context leaves after ``prompt``."""
    out = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    return MAX_MODEL_LEN - out.usage.prompt_tokens


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
            # A process group of its own (killpg), in this process's session: the kernel schedules
            # a session as one group (autogroup), so only inside this one does Ray's nice 15 for
            # its workers let the engines yield the CPU to the client. In a session of their own
            # they took the client's share: its threads waited on the run queue for 4.1 s of a
            # 4.2 s round of streams (0.1-0.3 s here).
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                         cwd=tmp, process_group=0)
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

    shutdown = stop  # as SharedFleet closes what it launched

    def version(self) -> int:
        """The fleet's weight version now (the tests before this one may have refitted it)."""
        return httpx.get(f"{self.url}/health").json()["nemo_gen"]["weight_version"]


def _serving_both(served: Served) -> None:
    assert served.proc.poll() is None, f"nemo-gen serve exited {served.proc.returncode}"
    health = httpx.get(f"{served.url}/health").json()
    assert health["serving_shards"] == 2, health


@pytest.fixture(scope="module")
def shared_server(tiny_model_dir, tmp_path_factory):
    shared = SharedFleet(lambda: Served(tmp_path_factory.mktemp("serve"), tiny_model_dir), check=_serving_both)
    yield shared
    shared.close()


@pytest.fixture
def served(shared_server):
    return shared_server.get()


def test_the_server_is_up_with_its_shards(served):
    assert len(served.info["shards"]) == 2 and served.info["weight_version"] == 0
    assert all(s["state"] == "healthy" and s["actor_pid"] for s in served.info["shards"])
    assert httpx.get(f"{served.url}/health").json()["serving_shards"] == 2


def test_completions_with_n_samples_come_from_one_shard(served):
    v = served.version()
    raw = served.client().completions.with_raw_response.create(
        model=served.model, prompt="The quick brown fox", n=2, max_tokens=8, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert raw.headers["x-nemo-gen-weight-version"] == str(v)
    out = raw.parse()
    assert [c.index for c in out.choices] == [0, 1]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" and c.text for c in out.choices)
    assert {c.nemo_gen["shard"] for c in out.choices} == {out.nemo_gen["shard"]}  # one request, one shard
    provenance = dict(out.nemo_gen)
    digests = provenance.pop("weight_digests")  # beside each span: None for launch weights, a refit's wd1 digest
    assert provenance == {"weight_version": v, "shard": out.nemo_gen["shard"], "weight_versions": [[v, 8]]}
    assert len(digests) == 1 and (digests[0] is None if v == 0 else digests[0].startswith("wd1:")), digests
    assert out.usage.completion_tokens == 16


def test_chat_and_a_stream_of_the_same_greedy_answer(served):
    client, v = served.client(), served.version()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model=served.model, messages=messages, max_tokens=12, temperature=0)
    (choice,) = whole.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert whole.usage.prompt_tokens > 5 and whole.nemo_gen["weight_version"] == v
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
    assert chunks[-1].nemo_gen["weight_versions"] == [[v, whole.usage.completion_tokens]]


def test_a_stream_starts_with_the_first_token_and_is_the_greedy_answer(served):
    client, v = served.client(), served.version()
    prompt = "Once upon a time"
    kw = dict(model=served.model, prompt=prompt, max_tokens=longest(client, served.model, prompt), temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**kw)
    engines = {s["index"]: s["engine_pids"] for s in served.info["shards"]}
    for attempt in range(1, ATTEMPTS + 1):
        t0 = time.monotonic()
        raw = client.completions.with_raw_response.create(stream=True, **kw)
        reader = Reader(raw)
        reader.wait_first()
        first_s = time.monotonic() - t0
        # The first chunk is here. The answer is not made yet: with the engine frozen it cannot be.
        with Frozen(engines[int(raw.headers["x-nemo-gen-shard"])]):
            reader.settle()
            at_freeze, over = reader.tokens(), reader.finished
        reader.join(300)
        print(f"\nattempt {attempt}: first chunk read at {first_s * 1000:.0f} ms, {at_freeze} of "
              f"{kw['max_tokens']} tokens when the engine was frozen, {time.monotonic() - t0:.2f} s in all")
        if not over:
            break
        # Over before the client read its first chunk: the client lagged (a server that sent the
        # answer only once made would fail every attempt)
    else:
        pytest.fail(f"in {ATTEMPTS} attempts the stream was over before its first chunk was read")
    assert reader.error is None, reader.error
    chunks = reader.chunks
    text = [c for c in chunks if c.choices]
    # Tokens came after the freeze: the client had the first ones while the engine still made the rest.
    assert 0 < at_freeze < len(whole.choices[0].token_ids)
    assert len(text) >= 10  # chunks as the engine goes (merged at most every 10 ms), not one piece
    assert "".join(c.choices[0].text for c in text) == whole.choices[0].text
    assert [t for c in text for t in c.choices[0].token_ids] == whole.choices[0].token_ids
    assert raw.headers["x-nemo-gen-weight-version"] == str(v)
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
    v = served.version()
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
    assert report["ok"] and report["version"] == v + 1
    # drain (the async engine's only mode): what ran when the refit came finished on the version before, whole
    assert all(r.nemo_gen["weight_version"] == v and r.usage.completion_tokens == 300 for r in before)
    assert after.headers["x-nemo-gen-weight-version"] == str(v + 1) and after.parse().nemo_gen["weight_version"] == v + 1


def test_metrics_show_the_fleet_and_its_engines(served):
    from nemo_gen.fleet.fleet import GenerationFleet

    # What the counters count, made here: a refit (to the same weights) and three completions.
    refit = httpx.post(f"{served.url}/nemo_gen/refit", json={"checkpoint": str(served.tiny)},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    assert refit.status_code == 200, refit.text
    for _ in range(3):
        served.client().completions.create(model=served.model, prompt="counted", max_tokens=2)
    text = httpx.get(f"{served.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    shards = {s.labels["state"]: s.value for s in families["nemo_gen_shards"].samples}
    assert shards["healthy"] == 2
    assert families["nemo_gen_weight_version"].samples[0].value == refit.json()["version"] == served.version()
    refits = [s for s in families["nemo_gen_refits"].samples if s.name.endswith("_total")]
    assert refits[0].value >= 1
    ok = [s.value for s in families["nemo_gen_http_requests"].samples
          if s.name.endswith("_total") and s.labels.get("route") == "/v1/completions" and s.labels.get("code") == "200"]
    assert ok and ok[0] >= 3
    if hasattr(GenerationFleet, "vllm_metrics"):  # issue 12 item 5: each shard's vLLM series
        vllm = [f for name, f in families.items() if name.startswith("vllm:")]
        assert vllm, sorted(families)
        assert {s.labels.get("shard") for f in vllm for s in f.samples} == {"0", "1"}


def test_a_shard_killed_mid_stream_moves_its_streams_to_the_survivor(shared_server, served):
    shared_server.spend()  # shard 0 stays dead (recovery off)
    v = served.version()
    shards = {s["index"]: s for s in served.info["shards"]}
    actor, engines = shards[0]["actor_pid"], shards[0]["engine_pids"]
    streams = 8
    tokens = longest(served.client(), served.model, "story 0")

    class Stream:
        def __init__(self):
            self.shard, self.chunks, self.error, self.done, self.last_at = None, [], None, False, time.monotonic()

        @property
        def finished(self) -> bool:
            return self.done or over(self.chunks)

        def tokens(self) -> int:
            return tokens_in(self.chunks)

    async def stream(client, i, into):
        raw = await client.completions.with_raw_response.create(
            model=served.model, prompt=f"story {i}", max_tokens=tokens, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        into.shard = int(raw.headers["x-nemo-gen-shard"])
        try:
            async for chunk in raw.parse():
                into.chunks.append(chunk)
                into.last_at = time.monotonic()
        except openai.APIError as exc:
            into.error = exc
        finally:
            into.done = True

    async def until(predicate, what, timeout_s=120.0):
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)

    async def round_(client):
        """8 streams; at every stream's first chunk shard 0 is frozen, and killed if one of its
        streams is unfinished. Returns the streams and whether the kill came (else shard 0 lives)."""
        state = [Stream() for _ in range(streams)]
        running = [asyncio.ensure_future(stream(client, i, state[i])) for i in range(streams)]
        await until(lambda: all(s.chunks or s.done for s in state), "every stream's first chunk")
        with Frozen(engines):
            mine = [s for s in state if s.shard == 0]
            # What shard 0 sent before the freeze is read: every stream of it over or quiet.
            await until(lambda: all(s.finished or time.monotonic() - s.last_at >= QUIET_S for s in mine),
                        "shard 0's streams to settle", SETTLE_TIMEOUT_S)
            cut = [s for s in mine if not s.finished]
            if cut:  # unfinished, and they stay so: their engine is stopped
                os.kill(actor, signal.SIGKILL)  # shard 0's actor; Ray takes its (stopped) engine with it
        await asyncio.gather(*running)
        return state, bool(cut)

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=300) as client:
            for attempt in range(1, ATTEMPTS + 1):
                state, killed = await round_(client)
                print(f"\nattempt {attempt}: at the freeze shard 0's streams had "
                      f"{[s.tokens() for s in state if s.shard == 0]} of {tokens} tokens; killed: {killed}")
                if killed:
                    return state
            pytest.fail(f"in {ATTEMPTS} attempts every stream of shard 0 was over before the client saw them all start")

    results = asyncio.run(main())
    assert {s.shard for s in results} == {0, 1}  # least-loaded routing used both
    moved = 0
    for s in results:
        # fleet.migration (on by default): a stream its shard's death cut goes on on the survivor from
        # the tokens it had sent: never an error, no token missing, none twice
        assert s.error is None, s.error
        assert s.tokens() == tokens, (s.shard, s.tokens())
        assert [c for c in s.chunks if c.choices][-1].choices[0].finish_reason == "length"
        final = s.chunks[-1].nemo_gen
        spans = final["weight_versions"]
        assert {version for version, _ in spans} == {v} and sum(n for _, n in spans) == tokens, spans
        if final.get("migrations"):
            (move,) = final["migrations"]
            assert s.shard == 0 and final["shard"] == 1 and move["from_shard"] == 0, final
            assert 0 < move["at_token"] < tokens, final
            moved += 1
        else:  # shard 1's, or one of shard 0's that was over before the freeze
            assert final["shard"] == s.shard and spans == [[v, tokens]], final
    assert moved >= 1
    assert wait_gone([actor, *engines], 30) == []
    health = httpx.get(f"{served.url}/health").json()
    assert health["serving_shards"] == 1 and health["shards"].get("dead") == 1
    after = served.client().completions.create(model=served.model, prompt="after the loss", max_tokens=4, stream=True)
    assert [c for c in after if not c.choices][-1].nemo_gen["shard"] == 1  # new streams go to the survivor


def test_sigint_stops_everything_it_started(shared_server):
    served = shared_server.take()  # after the shard-loss test, its server as that left it
    shared_server.spend()
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


@pytest.fixture
def served_abort(shared_server, tiny_model_dir, tmp_path_factory):
    # One server's engines at a time: the shared one is closed first (the next test to ask for it
    # gets a fresh one), and this one is stopped after its test.
    shared_server.close()
    s = Served(tmp_path_factory.mktemp("serve-abort"), tiny_model_dir, name="serve-abort", shards=1,
               extra=["refit.in_flight=abort"])  # keep/abort: nemo-gen serve runs the sync engine
    yield s
    s.stop()


def test_a_stream_goes_on_across_an_abort_refit_under_the_new_version(served_abort):
    s = served_abort
    client = s.client()
    (shard,) = s.info["shards"]
    prompt = "A long story"
    tokens = longest(client, s.model, prompt)
    host, port = s.url.removeprefix("http://").rsplit(":", 1)
    for attempt in range(1, ATTEMPTS + 1):
        before = int(client.completions.with_raw_response.create(model=s.model, prompt="x", max_tokens=1)
                     .headers["x-nemo-gen-weight-version"])
        t0 = time.monotonic()
        raw = client.completions.with_raw_response.create(
            model=s.model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        assert raw.headers["x-nemo-gen-weight-version"] == str(before)
        reader = Reader(raw)
        reader.wait_first()
        with Frozen(shard["engine_pids"]):
            reader.settle()
            at_freeze = reader.tokens()
            if reader.finished:  # the client lagged: the stream was over before it saw the first chunk
                reader.join(300)
                continue
            # Sent while the stream cannot end: the request is in the server's socket when the engine
            # resumes; from there it is the refit's few tenths of a second against the stream's rest.
            refit = http.client.HTTPConnection(host, int(port), timeout=300)
            refit.request("POST", "/nemo_gen/refit", json.dumps({"checkpoint": str(s.tiny), "in_flight": "abort"}),
                          {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        response = refit.getresponse()
        report = json.loads(response.read())
        refit_s = time.monotonic() - t0
        reader.join(300)
        spans = reader.chunks[-1].nemo_gen["weight_versions"] if reader.chunks else None
        print(f"\nattempt {attempt}: refit sent at {at_freeze} of {tokens} tokens, answered at {refit_s:.2f} s, "
              f"the stream over at {time.monotonic() - t0:.2f} s, its versions {spans}")
        assert response.status == 200, report
        assert report["version"] == before + 1
        if spans is not None and len(spans) > 1:
            break
        # The refit landed after the stream's last token: the server's own race, which a refit
        # that waited for the stream would lose every attempt.
    else:
        pytest.fail(f"in {ATTEMPTS} attempts no refit landed mid-stream")
    assert reader.error is None, reader.error
    chunks = reader.chunks
    text = [c for c in chunks if c.choices]
    assert sum(len(c.choices[0].token_ids) for c in text) == tokens  # whole: resumed, not cut short
    assert text[-1].choices[0].finish_reason == "length"
    assert [v for v, _ in spans] == [before, before + 1] and sum(n for _, n in spans) == tokens, spans
    assert spans[0][1] >= at_freeze  # the cut came after what the client had when it sent the refit
    assert chunks[-1].nemo_gen["weight_version"] == before + 1  # as unstreamed: the version of the last token
    provenance = dict(text[-1].choices[0].nemo_gen)
    digests = provenance.pop("weight_digests")  # one per span: the refit's weights are digested
    assert provenance == {"shard": 0, "weight_version": before + 1, "weight_versions": spans}
    assert len(digests) == len(spans) and digests[-1].startswith("wd1:"), digests
    after = client.completions.with_raw_response.create(model=s.model, prompt="after", max_tokens=4)
    assert after.headers["x-nemo-gen-weight-version"] == str(before + 1)
