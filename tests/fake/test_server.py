"""The OpenAI-compatible server (nemo_gen.server) over a fleet of fake shards (tests/fakes.py): the
real app on real uvicorn on 127.0.0.1, the real router behind it, the official openai client in
front. Engines are tests/e2e/test_serve.py's; here every case takes milliseconds once the app is
imported (vLLM's protocol models: ~10 s, once)."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nemo_gen.errors import ConfigError
from tests.fakes import VOCAB, FakeDriver, fake_fleet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def driver():
    d = FakeDriver()
    yield d
    d.close()


@pytest.fixture(scope="module")
def served(make_settings, driver):
    from nemo_gen.server import start_server

    # skip_tokenizer_init: the router decodes the fake shards' tokens, so results have text.
    settings = make_settings(fleet__name="fake-serve", fleet__num_shards=2, health__probe_interval_s=60,
                             health__auto_recover=False, server__port=0, server__allow_refit=True,
                             generation__max_new_tokens=6, generation__vllm_cfg__skip_tokenizer_init=True)
    fleet = fake_fleet(settings, driver)
    handle = start_server(fleet)
    yield fleet, handle, settings
    handle.stop()
    fleet.shutdown()


@pytest.fixture
def client(served):
    _, handle, _ = served
    return openai.OpenAI(base_url=f"{handle.url}/v1", api_key="unused", max_retries=0)


def model_of(served) -> str:
    return served[2].model_name()


def expected_ids(prompt_ids, n=6, k=0):
    return [(sum(prompt_ids) + k + i) % VOCAB for i in range(n)]


def test_a_completion_says_what_produced_it(served, client):
    fleet, _, _ = served
    raw = client.completions.with_raw_response.create(model=model_of(served), prompt=[5, 6, 7], max_tokens=4,
                                                      extra_body={"return_token_ids": True})
    assert raw.headers["x-nemo-gen-weight-version"] == str(fleet.weight_version)
    out = raw.parse()
    (choice,) = out.choices
    assert choice.token_ids == expected_ids([5, 6, 7], 4) and choice.finish_reason == "length"
    assert choice.text == fleet.router.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert out.nemo_gen["weight_version"] == fleet.weight_version and out.nemo_gen["shard"] in (0, 1)
    assert out.nemo_gen["weight_versions"] == [[fleet.weight_version, 4]]
    assert raw.headers["x-nemo-gen-shard"] == str(out.nemo_gen["shard"])
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4 and out.usage.total_tokens == 7
    assert out.model == model_of(served)


def test_n_samples_and_several_prompts_are_numbered_prompt_major(served, client):
    out = client.completions.create(model=model_of(served), prompt=[[1, 2], [3, 4, 5]], n=2, max_tokens=3,
                                    extra_body={"return_token_ids": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in out.choices] == [
        expected_ids([1, 2], 3, 0), expected_ids([1, 2], 3, 1), expected_ids([3, 4, 5], 3, 0), expected_ids([3, 4, 5], 3, 1)]
    assert all(c.nemo_gen["shard"] in (0, 1) for c in out.choices)
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == 5


def test_logprobs_are_the_sampled_tokens_and_offsets_index_the_text(served, client):
    out = client.completions.create(model=model_of(served), prompt="hello", max_tokens=5, logprobs=0)
    (choice,) = out.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(list(top) == [tok] for top, tok in zip(lp.top_logprobs, lp.tokens))
    with pytest.raises(openai.BadRequestError) as info:  # OpenAI's bound on alternatives per token
        client.completions.create(model=model_of(served), prompt="hello", logprobs=21)
    assert info.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as info:  # the stream's deltas carry no alternatives
        client.completions.create(model=model_of(served), prompt="hello", logprobs=2, stream=True)
    assert info.value.body["param"] == "logprobs"


def test_chat_renders_the_messages_and_answers_as_the_assistant(served, client):
    fleet, _, _ = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model=model_of(served), messages=messages, n=2, max_tokens=4, logprobs=True)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.message.content for c in out.choices)
    assert out.choices[0].message.content != out.choices[1].message.content  # two samples of one group
    assert all(len(c.logprobs.content) == 4 for c in out.choices)
    rendered = fleet.router.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = fleet.router.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert out.usage.prompt_tokens == len(ids)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    again = client.chat.completions.create(model=model_of(served), messages=parts, max_tokens=4)
    alone = client.chat.completions.create(model=model_of(served), messages=[{"role": "user", "content": "Hi there"}],
                                           max_tokens=4)
    assert again.choices[0].message.content == alone.choices[0].message.content


def test_a_stream_is_the_same_answer_in_token_chunks(served, client):
    whole = client.completions.create(model=model_of(served), prompt="stream me", max_tokens=6)
    raw = client.completions.with_raw_response.create(model=model_of(served), prompt="stream me", max_tokens=6,
                                                      stream=True, stream_options={"include_usage": True})
    assert raw.headers["x-nemo-gen-weight-version"] == str(whole.nemo_gen["weight_version"])
    chunks = list(raw.parse())
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) == 6  # a fake shard makes one token per step: one chunk each
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * 5 + ["length"]
    shard = raw.headers["x-nemo-gen-shard"]
    last = text_chunks[-1].choices[0].nemo_gen  # the choice's own provenance, on its last chunk
    assert last == {**whole.choices[0].nemo_gen, "shard": int(shard)}
    final = chunks[-1]  # the response's, on the final chunk
    assert not final.choices and final.usage.completion_tokens == 6
    assert final.nemo_gen == {**whole.nemo_gen, "shard": int(shard)}

    chat = list(client.chat.completions.create(model=model_of(served), messages=[{"role": "user", "content": "x"}],
                                               max_tokens=3, n=2, stream=True))
    assert not chat[-1].choices and chat[-1].nemo_gen["weight_version"] is not None  # the final chunk
    by_choice = {i: [c.choices[0] for c in chat if c.choices and c.choices[0].index == i] for i in (0, 1)}
    for pieces in by_choice.values():
        assert pieces[0].delta.role == "assistant"
        assert pieces[-1].finish_reason == "length" and len(pieces) == 1 + 3


def test_a_session_stays_on_its_shard(served, client):
    first = client.completions.create(model=model_of(served), prompt="turn 1", max_tokens=2,
                                      extra_headers={"x-session-id": "conversation-7"})
    for turn in range(2, 6):
        nxt = client.completions.create(model=model_of(served), prompt=f"turn {turn}", max_tokens=2,
                                        extra_headers={"x-session-id": "conversation-7"})
        assert nxt.nemo_gen["shard"] == first.nemo_gen["shard"]
    by_user = [client.chat.completions.create(model=model_of(served), messages=[{"role": "user", "content": str(i)}],
                                              max_tokens=2, user="agent-3").nemo_gen["shard"] for i in range(4)]
    assert len(set(by_user)) == 1


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ({"extra_body": {"stop_token_ids": ["x"]}}, "stop_token_ids.0"),  # vLLM's model names the item
    ({"echo": True}, "echo"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * 2000}, "prompt"),  # longer than max_model_len
])
def test_bad_input_is_a_400_naming_the_field(served, client, kwargs, param):
    kwargs = {"prompt": "fine", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_of(served), **kwargs)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    assert "Traceback" not in info.value.body["message"]


@pytest.mark.parametrize("kwargs, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": -2, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true (vLLM's rule)
    ({"top_logprobs": 3, "logprobs": True, "stream": True}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    # tools ask for tool_choice auto, which needs server.tool_call_parser (unset here)
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
])
def test_bad_chat_input_is_a_400_naming_the_field(served, client, kwargs, param):
    kwargs = {"messages": [{"role": "user", "content": "fine"}], **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_of(served), **kwargs)
    assert info.value.body["param"] == param, info.value.body


def test_other_errors_are_openai_shaped(served, client):
    _, handle, _ = served
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="another-model", prompt="x")
    assert info.value.body["param"] == "model"
    r = httpx.post(f"{handle.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = httpx.get(f"{handle.url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404 and "x-nemo-gen-weight-version" in r.headers
    r = httpx.get(f"{handle.url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_models_health_and_metrics(served, client):
    fleet, handle, _ = served
    (model,) = client.models.list().data
    assert model.id == model_of(served)
    health = httpx.get(f"{handle.url}/health")
    assert health.status_code == 200 and health.json()["serving_shards"] == 2
    client.completions.create(model=model_of(served), prompt="count me", max_tokens=2)
    text = httpx.get(f"{handle.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    shards = {s.labels["state"]: s.value for s in families["nemo_gen_shards"].samples}
    assert shards["healthy"] == 2 and shards["dead"] == 0
    assert families["nemo_gen_weight_version"].samples[0].value == fleet.weight_version
    assert families["nemo_gen_rerouted_requests"].type == "counter"
    served_ok = [s for s in families["nemo_gen_http_requests"].samples
                 if s.name.endswith("_total") and s.labels == {"route": "/v1/completions", "code": "200"}]
    assert served_ok and served_ok[0].value >= 1


def test_a_refit_moves_the_version_of_later_responses(served, client):
    import torch

    fleet, handle, _ = served
    before = client.completions.with_raw_response.create(model=model_of(served), prompt="x", max_tokens=2)
    old = int(before.headers["x-nemo-gen-weight-version"])
    report = fleet.refit({"w": torch.ones(4, 4), "b": torch.zeros(4)})
    assert report.ok and report.version == old + 1
    after = client.completions.with_raw_response.create(model=model_of(served), prompt="x", max_tokens=2)
    assert after.headers["x-nemo-gen-weight-version"] == str(old + 1) and after.parse().nemo_gen["weight_version"] == old + 1
    # the refit route refuses what is not a checkpoint, naming the field
    r = httpx.post(f"{handle.url}/nemo_gen/refit", json={"checkpoint": "/nonexistent/ckpt"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "checkpoint", r.text
    r = httpx.post(f"{handle.url}/nemo_gen/refit", json={"checkpoint": "/x", "colour": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "colour"
    # in_flight is parsed into the RefitMode at the edge: a spelling it does not know is refused by name
    r = httpx.post(f"{handle.url}/nemo_gen/refit", json={"checkpoint": "/x", "in_flight": "later"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "in_flight", r.text
    assert "'drain', 'abort', 'keep'" in r.json()["error"]["message"], r.text


def test_the_async_client_serves_many_at_once(served):
    _, handle, _ = served

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0) as aclient:
            outs = await asyncio.gather(*(aclient.completions.create(model=model_of(served), prompt=[i + 1], max_tokens=3,
                                                                     extra_body={"return_token_ids": True})
                                          for i in range(32)))
        return outs

    outs = asyncio.run(main())
    assert [o.choices[0].token_ids for o in outs] == [expected_ids([i + 1], 3) for i in range(32)]
    assert {o.nemo_gen["shard"] for o in outs} == {0, 1}


def test_no_serving_shard_is_a_503(make_settings):
    from nemo_gen.server import start_server

    driver = FakeDriver()
    settings = make_settings(fleet__name="fake-503", fleet__num_shards=1, health__probe_interval_s=60,
                             health__auto_recover=False, server__port=0, fleet__request_timeout_s=0.5)
    fleet = fake_fleet(settings, driver)
    try:
        with start_server(fleet) as handle:
            client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="x", max_retries=0)
            driver.set_dead(fleet.handle(0).name)
            from tests.helpers import wait_until

            wait_until(lambda: fleet.health.serving_shards() == [], 5, "the shard condemned")
            with pytest.raises(openai.InternalServerError) as info:
                client.completions.create(model=settings.model_name(), prompt="x")
            assert info.value.status_code == 503 and "shard" in info.value.body["message"]
            assert httpx.get(f"{handle.url}/health").status_code == 503
    finally:
        fleet.shutdown()
        driver.close()


def test_the_api_key_is_required_when_set(make_settings):
    from nemo_gen.server import start_server

    driver = FakeDriver()
    settings = make_settings(fleet__name="fake-key", fleet__num_shards=1, health__probe_interval_s=60,
                             server__port=0, server__api_key="s3cret")
    fleet = fake_fleet(settings, driver)
    try:
        with start_server(fleet) as handle:
            for key in ("wrong", ""):
                client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key=key or "x", max_retries=0,
                                       default_headers={} if key else {"Authorization": ""})
                with pytest.raises(openai.AuthenticationError) as info:
                    client.completions.create(model=settings.model_name(), prompt="x")
                assert info.value.status_code == 401 and info.value.body["code"] == 401
            ok = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="s3cret", max_retries=0)
            assert ok.completions.create(model=settings.model_name(), prompt="x", max_tokens=2).choices
            assert httpx.get(f"{handle.url}/health").status_code == 200  # open: load balancers
            assert httpx.get(f"{handle.url}/metrics").status_code == 200  # open: scrapers
            assert httpx.post(f"{handle.url}/v1/completions", json={"prompt": "x"}).status_code == 401
    finally:
        fleet.shutdown()
        driver.close()


def test_a_taken_port_is_a_config_error_naming_it(served):
    from nemo_gen.server import start_server

    fleet, handle, settings = served
    with pytest.raises(ConfigError) as info:
        start_server(fleet, settings, port=handle.port)
    assert info.value.field == "server.port"


def test_without_migration_a_shard_lost_mid_stream_ends_the_stream_with_an_error_event_naming_it(make_settings):
    """fleet.migration off (on, the stream goes on: tests/unit/test_migration_fleet.py)."""
    from nemo_gen.server import start_server

    driver = FakeDriver()
    settings = make_settings(fleet__name="fake-midstream", fleet__num_shards=2, health__probe_interval_s=60,
                             health__auto_recover=False, server__port=0, fleet__migration__mode="off")
    fleet = fake_fleet(settings, driver)
    try:
        for handle in fleet.shards:
            driver.set_token_s(handle.name, 0.05)
        with start_server(fleet) as server:
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=30,
                              json={"prompt": [1, 2, 3], "max_tokens": 40, "stream": True}) as response:
                assert response.status_code == 200
                shard = int(response.headers["x-nemo-gen-shard"])
                lines = response.iter_lines()
                events = [next(line for line in lines if line)]
                driver.set_dead(fleet.handle(shard).name)
                events += [line for line in lines if line]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))
            assert f"shard {shard}" in error["error"]["message"] and error["nemo_gen"]["shard"] == shard
            text = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
            assert 1 <= len(text) < 40 and all(c["choices"][0].get("finish_reason") is None for c in text)
            # the official client raises it
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            stream = client.completions.create(model=settings.model_name(), prompt=[4, 5], max_tokens=40, stream=True)
            survivor = fleet.handle(1 - shard).name
            first = next(iter(stream))
            assert first.choices[0].text is not None
            driver.set_dead(survivor)
            with pytest.raises(openai.APIError) as info:
                list(stream)
            assert f"shard {1 - shard}" in str(info.value)
    finally:
        fleet.shutdown()
        driver.close()


def test_text_pieces_join_to_the_engines_text(served):
    from nemo_gen.server.responses import Detokenizer

    tok = served[0].router.tokenizer
    detok = Detokenizer(tok)
    ids = tok("Hello world, this is a test of pieces", add_special_tokens=False)["input_ids"]
    text = tok.decode(ids, skip_special_tokens=True)
    pieces = detok.pieces(ids, text)
    assert len(pieces) == len(ids) and "".join(pieces) == text
    cut = text[: len(text) // 2]  # a stop string cut the text: the pieces still join to it
    assert "".join(detok.pieces(ids, cut)) == cut and len(detok.pieces(ids, cut)) == len(ids)
    assert detok.pieces([], "") == []


def test_port_zero_picks_a_free_port(served):
    _, handle, _ = served
    assert handle.port > 0
    with socket.create_connection((handle.host, handle.port), timeout=2):
        pass


def test_vllm_snapshot_rows_become_prometheus_series_labelled_by_shard():
    from prometheus_client import CollectorRegistry, generate_latest

    from nemo_gen.server.metrics import families_from_rows, merge

    rows = [{"name": "vllm:num_requests_running", "labels": {"engine": "0"}, "kind": "gauge", "value": 2},
            {"name": "vllm:prefix_cache_hits", "labels": {"engine": "0"}, "kind": "counter", "value": 5},
            {"name": "vllm:time_to_first_token_seconds", "labels": {"engine": "0"}, "kind": "histogram",
             "count": 3, "sum": 0.5, "buckets": {"0.1": 1, "1.0": 3, "+Inf": 3}},
            {"name": "vllm:spec_decode_num_accepted_tokens_per_pos", "labels": {}, "kind": "vector", "values": [4, 1]}]
    families: dict = {}
    for shard in ("0", "1"):
        merge(families, families_from_rows(rows, {"shard": shard}))

    class Snapshot:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry()
    registry.register(Snapshot())
    parsed = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert parsed["vllm:num_requests_running"].type == "gauge"
    assert {s.labels["shard"] for s in parsed["vllm:num_requests_running"].samples} == {"0", "1"}
    assert [s.value for s in parsed["vllm:prefix_cache_hits"].samples if s.name.endswith("_total")] == [5, 5]
    ttft = parsed["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram" and {s.labels.get("le") for s in ttft.samples if s.name.endswith("_bucket")} == {
        "0.1", "1.0", "+Inf"}
    assert {s.labels["position"] for s in parsed["vllm:spec_decode_num_accepted_tokens_per_pos"].samples} == {"0", "1"}


def test_expose_http_server_is_a_setting_that_keeps_the_engines_tokenizer():
    from nemo_gen.core.generation_config import configure_generation_config
    from nemo_gen.settings import NemoGenSettings

    s = NemoGenSettings.load(overrides=["generation.vllm_cfg.expose_http_server=true", "fleet.mode=train"])
    assert s.generation.vllm_cfg.expose_http_server is True and s.not_used == []
    cfg = configure_generation_config(s.generation.to_generation_config(), _Tok(), is_eval=False)
    assert cfg["vllm_cfg"]["skip_tokenizer_init"] is False  # rule 8: the HTTP server detokenizes


class _Tok:
    pad_token_id, eos_token_id = 0, 1


def test_expose_http_starts_the_fleets_own_server_or_cleans_up(make_settings):
    """GenerationFleet with generation.vllm_cfg.expose_http_server: it serves itself at
    fleet.http_url (nemo_gen.server.expose_http), stops the server with the fleet, and a fleet
    whose server cannot start is shut down rather than left half up."""
    driver = FakeDriver()
    off = fake_fleet(make_settings(fleet__name="fake-off", fleet__num_shards=1, health__probe_interval_s=60), driver)
    assert off.http_url is None
    off.shutdown()
    settings = make_settings(fleet__name="fake-expose", fleet__num_shards=1, health__probe_interval_s=60,
                             generation__vllm_cfg__expose_http_server=True, server__port=0)
    fleet = fake_fleet(settings, driver)
    try:
        url = fleet.http_url
        assert url and httpx.get(f"{url}/health").status_code == 200
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            busy = make_settings(fleet__name="fake-taken", fleet__num_shards=1, health__probe_interval_s=60,
                                 generation__vllm_cfg__expose_http_server=True, server__port=taken.getsockname()[1])
            with pytest.raises(ConfigError, match="server.port"):
                fake_fleet(busy, driver)
            # the fleet that could not serve was shut down: its shard was stopped
            assert driver.shards["fake-taken-shard-0"].stopped
    finally:
        fleet.shutdown()
        driver.close()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)  # the server went with the fleet


def test_the_model_field_names_a_lora_adapter_or_is_a_404_naming_it(served, client, monkeypatch):
    """/v1/models lists the fleet's adapters; a request whose ``model`` is one reaches the fleet
    with ``adapter=`` (this fake fleet started without LoRA, so the fleet refuses it by name);
    any other name is a 404 naming it and what is served."""
    fleet, _, _ = served
    with pytest.raises(openai.NotFoundError, match="'other' does not exist; this server serves"):
        client.completions.create(model="other", prompt=[5], max_tokens=2)
    monkeypatch.setattr(fleet, "adapter_versions", lambda: {"policy-a": 3}, raising=False)
    models = client.models.list()
    assert [m.id for m in models.data] == [model_of(served), "policy-a"]
    assert models.data[1].parent == model_of(served)
    with pytest.raises(openai.APIStatusError, match="started without LoRA") as info:
        client.completions.create(model="policy-a", prompt=[5], max_tokens=2)
    assert info.value.status_code == 400
    with pytest.raises(openai.APIStatusError, match="started without LoRA"):
        client.chat.completions.create(model="policy-a", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       stream=True)
    with pytest.raises(openai.NotFoundError, match="'policy-b' does not exist; this server serves .*'policy-a'"):
        client.completions.create(model="policy-b", prompt=[5], max_tokens=2)


def test_the_heap_is_frozen_while_serving_without_a_full_collection_at_each_start(make_settings, monkeypatch):
    """The server takes the process's heap out of the collector's view while it serves and gives
    it back at stop; a start collects the young generations only: a full collection is a walk of
    the whole heap, paid again by every start in a process that starts servers one after another."""
    import gc

    from nemo_gen.server import start_server

    driver = FakeDriver()
    fleet = fake_fleet(make_settings(fleet__name="fake-gc", fleet__num_shards=1, health__probe_interval_s=60,
                                     server__port=0), driver)
    collected: list[int] = []  # the collections asked for (the interpreter's own may come too)
    collect = gc.collect

    def asked(generation=2):
        collected.append(generation)
        return collect(generation)

    try:
        with monkeypatch.context() as patch:
            patch.setattr(gc, "collect", asked)
            handle = start_server(fleet)
        with handle:
            assert gc.get_freeze_count() > 0
            assert httpx.get(f"{handle.url}/health").status_code == 200
        assert gc.get_freeze_count() == 0
    finally:
        fleet.shutdown()
        driver.close()
    assert collected == [0, 1], collected
