"""The trajectory gateway (issue 33, items 3-4) over fake shards (tests/fakes.py) behind the real app
and router, the official openai client in front: sessions, their recorded turns and token
sequence, placement by open sessions, a shard lost mid-session, an edited history, the limits and
their refusals, and ``fleet.session()`` from Python. The engines' side: tests/e2e/test_gateway.py."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.fakes import FakeDriver, fake_fleet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _settings(make_settings, name, **extra):
    return make_settings(fleet__name=name, fleet__num_shards=2, health__probe_interval_s=60,
                         health__auto_recover=False, server__port=0, server__tool_call_parser="hermes",
                         generation__max_new_tokens=5, generation__vllm_cfg__skip_tokenizer_init=True,
                         generation__vllm_cfg__max_model_len=1024, **extra)


@pytest.fixture
def served(make_settings):
    from nemo_gen.server import start_server

    driver = FakeDriver()
    fleet = fake_fleet(_settings(make_settings, "fake-gateway"), driver)
    handle = start_server(fleet)
    yield fleet, handle, driver
    handle.stop()
    fleet.shutdown()
    driver.close()


def _open(url: str) -> dict:
    r = httpx.post(f"{url}/nemo_gen/sessions")
    assert r.status_code == 200, r.text
    return r.json()


def _client(created: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=created["url"], api_key="unused", max_retries=0)


def _masked(traj: dict, seg: int = 0) -> list[int]:
    s = traj["segments"][seg]
    return [t for t, m in zip(s["token_ids"], s["loss_mask"]) if m]


def _agent(client, turns: int, first: str = "Weather in Paris?") -> list:
    messages, outs = [{"role": "user", "content": first}], []
    for k in range(turns):
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                             extra_body={"return_token_ids": True})
        outs.append(out)
        messages += [{"role": "assistant", "content": out.choices[0].message.content},
                     {"role": "user", "content": f"and turn {k + 2}?"}]
    return outs


def test_a_session_records_every_turn_on_the_sampled_ids(served):
    fleet, handle, _ = served
    created = _open(handle.url)
    assert created["base_url"] == f"/nemo_gen/sessions/{created['id']}/v1"
    outs = _agent(_client(created), 3)
    traj = httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").json()
    assert len(traj["turns"]) == 3 and len(traj["segments"]) == 1
    for out, turn in zip(outs, traj["turns"]):
        assert turn["token_ids"] == out.choices[0].token_ids and turn["prompt_token_ids"] == out.prompt_token_ids
        assert out.nemo_gen["session"]["turn"] == turn["index"] and turn["new_segment_reason"] is None
        assert turn["shard"] == created["shard"]  # it stays on its shard
    assert _masked(traj) == [t for turn in traj["turns"] for t in turn["token_ids"]]
    assert sum(traj["loss_mask"]) == traj["completion_tokens"] == sum(o.usage.completion_tokens for o in outs)
    for prev, turn in zip(traj["turns"], traj["turns"][1:]):
        assert turn["prompt_token_ids"][:len(prev["prompt_token_ids"]) + len(prev["token_ids"])] == \
            prev["prompt_token_ids"] + prev["token_ids"]
    assert traj["turns"][1]["request"]["first_message"] == 2
    assert [m["role"] for m in traj["turns"][1]["request"]["messages"]] == ["user"]  # only the new ones kept
    # DELETE ends it (the trajectory one last time), then it is gone
    gone = httpx.delete(f"{handle.url}/nemo_gen/sessions/{created['id']}")
    assert gone.status_code == 200 and gone.json()["deleted"] and len(gone.json()["turns"]) == 3
    after = httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory")
    assert after.status_code == 404 and after.json()["error"]["param"] == "id"
    assert fleet.router.affinity.placement.counts() == {}


def test_new_sessions_spread_by_open_sessions_and_are_released(served):
    fleet, handle, _ = served
    opened = [_open(handle.url) for _ in range(4)]
    assert sorted(c["shard"] for c in opened) == [0, 0, 1, 1]
    httpx.delete(f"{handle.url}/nemo_gen/sessions/{opened[0]['id']}")
    assert _open(handle.url)["shard"] == opened[0]["shard"]  # the freed place is taken next


def test_a_dead_shard_s_session_moves_and_stays_recorded(served):
    fleet, handle, driver = served
    created = _open(handle.url)
    client = _client(created)
    messages = [{"role": "user", "content": "q"}]
    one = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    driver.set_dead(fleet.handle(created["shard"]).name)
    messages += [{"role": "assistant", "content": one.choices[0].message.content}, {"role": "user", "content": "r"}]
    two = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    traj = httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").json()
    assert [t["shard"] for t in traj["turns"]] == [created["shard"], 1 - created["shard"]]
    assert two.nemo_gen["shard"] == 1 - created["shard"] and len(traj["segments"]) == 1
    assert _masked(traj) == traj["turns"][0]["token_ids"] + traj["turns"][1]["token_ids"]
    assert fleet.router.affinity.placement.slot_of(created["id"]) == 1 - created["shard"]


def test_an_edited_history_starts_a_flagged_segment(served):
    _, handle, _ = served
    created = _open(handle.url)
    client = _client(created)
    messages = [{"role": "user", "content": "q"}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    edited = messages + [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "r"}]
    out = client.chat.completions.create(model="tiny", messages=edited, max_tokens=4)
    assert out.nemo_gen["session"]["segment"] == 1 and "messages[1]" in out.nemo_gen["session"]["new_segment_reason"]
    traj = httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").json()
    assert traj["token_ids"] is None and len(traj["segments"]) == 2
    assert [_masked(traj, i) for i in range(2)] == [t["token_ids"] for t in traj["turns"]]


def test_a_streamed_turn_is_recorded_from_the_stream(served):
    _, handle, _ = served
    created = _open(handle.url)
    client = _client(created)
    messages = [{"role": "user", "content": "q"}]
    ids, text = [], ""
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True,
                                                extra_body={"return_token_ids": True}):
        for choice in chunk.choices:
            ids += getattr(choice, "token_ids", None) or []
            text += choice.delta.content or ""
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "r"}]
    two = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                         extra_body={"return_token_ids": True})
    traj = httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").json()
    assert len(ids) == 4 and traj["turns"][0]["token_ids"] == ids and traj["turns"][0]["message"]["content"] == text
    assert len(traj["segments"]) == 1 and _masked(traj) == ids + two.choices[0].token_ids  # the stream's answer extends


def test_refusals_name_the_field_or_the_limit(served):
    _, handle, _ = served
    created = _open(handle.url)
    client = _client(created)
    ask = [{"role": "user", "content": "q"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=ask, max_tokens=4, n=2)
    assert err.value.body["param"] == "n"
    nowhere = openai.OpenAI(base_url=f"{handle.url}/nemo_gen/sessions/sess-none/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        nowhere.chat.completions.create(model="tiny", messages=ask, max_tokens=4)
    bad = httpx.post(f"{handle.url}/nemo_gen/sessions", json={"ttl": 5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ttl"
    traj = httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").json()
    assert traj["turns"] == []  # refused turns are not recorded


def test_a_session_turn_takes_the_lora_adapter_its_model_names(served, monkeypatch):
    """``model`` naming an adapter reaches the fleet as ``adapter=`` on a session as on the chat
    route (this fake fleet started without LoRA, so the fleet refuses it by name), streamed or
    not; an unknown name is a 404 naming it; nothing is recorded."""
    fleet, handle, _ = served
    created = _open(handle.url)
    client = _client(created)
    ask = [{"role": "user", "content": "q"}]
    monkeypatch.setattr(fleet, "adapter_versions", lambda: {"policy-a": 3}, raising=False)
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError, match="started without LoRA") as info:
            client.chat.completions.create(model="policy-a", messages=ask, max_tokens=4, stream=stream)
        assert info.value.status_code == 400
    with pytest.raises(openai.NotFoundError, match="'policy-b' does not exist"):
        client.chat.completions.create(model="policy-b", messages=ask, max_tokens=4)
    traj = httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").json()
    assert traj["turns"] == []


def test_limits_sessions_bytes_and_ttl(make_settings):
    from nemo_gen.server import start_server

    driver = FakeDriver()
    fleet = fake_fleet(_settings(make_settings, "fake-gateway-limits", server__max_sessions=1,
                                 server__session_ttl_s=0.5, server__max_session_bytes=1024), driver)
    handle = start_server(fleet)
    try:
        created = _open(handle.url)
        full = httpx.post(f"{handle.url}/nemo_gen/sessions")
        assert full.status_code == 429 and "server.max_sessions=1" in full.json()["error"]["message"]
        client = _client(created)
        with pytest.raises(openai.APIStatusError) as err:
            _agent(client, 10)
        assert err.value.status_code == 413 and "server.max_session_bytes=1024" in err.value.message
        turns = len(httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").json()["turns"])
        assert turns >= 1
        time.sleep(0.7)
        assert httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").status_code == 404
        assert fleet.router.affinity.placement.counts() == {}  # expired: its shard released
        assert _open(handle.url)["id"] != created["id"]  # room again
    finally:
        handle.stop()
        fleet.shutdown()
        driver.close()


def test_fleet_session_gives_the_same_trajectory_from_python(served):
    fleet, _, driver = served
    with fleet.session() as s:
        assert fleet.router.affinity.placement.slot_of(s.id) is not None
        messages = [{"role": "user", "content": "q"}]
        r1 = s.chat(messages, max_new_tokens=4)
        messages += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "r"}]
        r2 = s.chat(messages, max_new_tokens=4)
        traj = s.trajectory().to_json()
        assert traj["turns"][1]["prompt_token_ids"][:len(r1.prompt_token_ids) + 4] == r1.prompt_token_ids + r1.token_ids
        assert _masked(traj) == r1.token_ids + r2.token_ids and len(traj["segments"]) == 1
        with pytest.raises(Exception, match="n="):
            s.chat(messages, n=2)
    assert fleet.router.affinity.placement.slot_of(s.id) is None  # closed: released
    with pytest.raises(Exception, match="closed"):
        s.chat(messages)


def test_a_session_lists_its_model_until_it_ends(served):
    _, handle, _ = served
    created = _open(handle.url)
    assert [m.id for m in _client(created).models.list().data] == ["tiny"]
    httpx.delete(f"{handle.url}/nemo_gen/sessions/{created['id']}")
    with pytest.raises(openai.NotFoundError):
        _client(created).models.list()
    assert httpx.delete(f"{handle.url}/nemo_gen/sessions/{created['id']}").status_code == 404


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _without_ids(message: dict) -> dict:
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls") or []]
    return {**message, "tool_calls": calls}


def _same_turns(a: dict, b: dict) -> list:
    keep = ("prompt_token_ids", "token_ids", "finish_reason", "segment", "new_segment_reason")
    return [({k: t[k] for k in keep}, _without_ids(t["message"])) for t in a["turns"]] == \
        [({k: t[k] for k in keep}, _without_ids(t["message"])) for t in b["turns"]]


def test_a_tool_call_turn_answers_python_as_it_answers_http(served, monkeypatch):
    """The engine samples a hermes tool call: ``fleet.session()`` gives the message (tool_calls
    split out by the server's parser) and the trajectory the gateway's HTTP route gives."""
    import json

    from tests import fakes

    fleet, handle, _ = served
    ids = list(fleet.router.tokenizer(CALL, add_special_tokens=False)["input_ids"])
    monkeypatch.setattr(fakes, "fake_token", lambda req, k, i: ids[i % len(ids)])
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    created = _open(handle.url)
    client = _client(created)
    http_msgs, py_msgs = list(ask), list(ask)
    with fleet.session() as s:
        for turn in range(2):
            out = client.chat.completions.create(model="tiny", messages=http_msgs, tools=TOOLS, max_tokens=len(ids))
            r = s.chat(py_msgs, tools=TOOLS, max_new_tokens=len(ids))
            http = out.choices[0].message.model_dump(exclude_none=True)
            (call,) = r.message["tool_calls"]
            assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather",
                                                                                              {"city": "Paris"})
            # the HTTP answer's JSON omits a None content; every other field the same
            assert _without_ids(r.message) == _without_ids({"content": None, **http})
            assert r.chat_finish_reason == out.choices[0].finish_reason == "tool_calls"
            assert r.text == CALL and r.finish_reason == "length"  # the engine's own, as fleet.generate gives them
            tool = {"role": "tool", "tool_call_id": call["id"], "content": '{"temp": 21}'}
            http_msgs += [out.choices[0].message.model_dump(exclude_none=True), tool]
            py_msgs += [r.message, tool]
        traj = s.trajectory().to_json()
    over_http = httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").json()
    assert len(traj["segments"]) == 1 and len(traj["turns"]) == 2  # the echoed call extends the record
    assert _same_turns(traj, over_http) and traj["token_ids"] == over_http["token_ids"]
    assert traj["loss_mask"] == over_http["loss_mask"] and _masked(traj) == ids + ids


def test_a_forced_tool_choice_reaches_the_fleet_as_the_same_grammar_from_python_and_http(served, monkeypatch):
    fleet, handle, _ = served
    seen = []
    real, real_async = fleet.generate, fleet.generate_async

    def spy(prompts, **kwargs):
        seen.append(kwargs)
        return real(prompts, **kwargs)

    async def spy_async(prompt, **kwargs):
        seen.append(kwargs)
        return await real_async(prompt, **kwargs)

    monkeypatch.setattr(fleet, "generate", spy)
    monkeypatch.setattr(fleet, "generate_async", spy_async)
    ask = [{"role": "user", "content": "q"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    created = _open(handle.url)
    for choice in ("required", named):
        seen.clear()
        _client(created).chat.completions.create(model="tiny", messages=ask, tools=TOOLS, tool_choice=choice,
                                                 max_tokens=4)
        with fleet.session() as s:
            s.chat(ask, tools=TOOLS, tool_choice=choice, max_new_tokens=4)
        over_http, from_python = (kw["structured_outputs"] for kw in seen)
        assert from_python == over_http and "get_weather" in from_python["structural_tag"]
        assert '"max_whitespace_cnt": 4' in from_python["structural_tag"]  # bounded, as the route's
    with fleet.session() as s:
        with pytest.raises(Exception, match="^parallel_tool_calls:"):  # vLLM's request model refuses it, named
            s.chat(ask, tools=TOOLS, parallel_tool_calls="sometimes", max_new_tokens=4)
        with pytest.raises(Exception, match="^tool_choice:"):
            s.chat(ask, tool_choice="required", max_new_tokens=4)  # no tools
        assert s.trajectory().to_json()["turns"] == []


def test_an_idle_server_sweeps_expired_sessions_and_releases_their_shards(make_settings):
    """No request after the sessions are opened: the gateway's sweep (every ttl/4 = 0.15 s here) takes them
    out — their bytes and their shard pin — and then stops until the next session opens."""
    from nemo_gen.server import start_server

    driver = FakeDriver()
    fleet = fake_fleet(_settings(make_settings, "fake-gateway-sweep", server__session_ttl_s=0.6), driver)
    handle = start_server(fleet)
    try:
        gateway = handle.server.config.app.app.state.gateway
        for _ in range(2):
            _open(handle.url)
        assert len(gateway.table) == 2 and sorted(fleet.router.affinity.placement.counts().values()) == [1, 1]
        deadline = time.monotonic() + 1.5  # ttl + a sweep interval, and slack for a loaded machine
        while (len(gateway.table) or not gateway._sweeper.done()) and time.monotonic() < deadline:
            time.sleep(0.05)  # no request meanwhile: only the sweep can take them out
        assert len(gateway.table) == 0 and fleet.router.affinity.placement.counts() == {}
        assert gateway._sweeper.done()  # nothing open: the sweep ended
        again = _open(handle.url)  # and the next session starts it again
        assert not gateway._sweeper.done() and fleet.router.affinity.placement.slot_of(again["id"]) is not None
    finally:
        handle.stop()
        fleet.shutdown()
        driver.close()


def test_metrics_label_the_session_routes_by_template_never_by_id(served):
    from prometheus_client.parser import text_string_to_metric_families

    from nemo_gen.server.metrics import ServerMetrics

    _, handle, _ = served
    sids = [_open(handle.url)["id"] for _ in range(2)]
    for sid in sids:
        _agent(_client({"url": f"{handle.url}/nemo_gen/sessions/{sid}/v1"}), 1)
        httpx.get(f"{handle.url}/nemo_gen/sessions/{sid}/trajectory")
        httpx.delete(f"{handle.url}/nemo_gen/sessions/{sid}")
    text = httpx.get(f"{handle.url}/metrics").text
    assert not any(sid in text for sid in sids)  # bounded: one series per route, not per session
    counts: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "nemo_gen_http_requests":
            for s in family.samples:
                if s.name.endswith("_total"):
                    counts[s.labels["route"], s.labels["code"]] = s.value
    assert counts[("/nemo_gen/sessions", "200")] == 2
    assert counts[("/nemo_gen/sessions/{id}/v1/chat/completions", "200")] == 2
    assert counts[("/nemo_gen/sessions/{id}/trajectory", "200")] == 2
    assert counts[("/nemo_gen/sessions/{id}", "200")] == 2
    assert not any(route == "other" for route, _ in counts)
    # a path that is none of the gateway's stays "other"
    assert [ServerMetrics.route(p) for p in ("/nemo_gen/sessions/s/v1/models", "/nemo_gen/sessions/s/v1/x",
                                             "/nemo_gen/sessions//trajectory", "/nemo_gen/sessionsX", "/tokenize")] == \
        ["/nemo_gen/sessions/{id}/v1/models", "other", "other", "other", "/tokenize"]


def test_a_short_plain_chat_is_prepared_on_the_loop_a_long_one_in_one_hop(make_settings, monkeypatch):
    """Without parsers, a turn whose chat is at most ON_LOOP_CHARS characters is prepared on the
    server's event loop (no thread hop), a longer one in one hop; both extend the one segment on
    the sampled ids."""
    from nemo_gen.server import gateway as gw, start_server

    from nemo_gen.server.tokens import Tokens

    hops = []
    run = Tokens.run

    async def counted(self, fn, *args):  # the hop to the tokenizing threads
        hops.append(getattr(fn, "__qualname__", ""))
        return await run(self, fn, *args)

    monkeypatch.setattr(Tokens, "run", counted)
    monkeypatch.setattr(gw, "ON_LOOP_CHARS", 60)
    driver = FakeDriver()
    fleet = fake_fleet(make_settings(fleet__name="fake-gateway-loop", fleet__num_shards=1, health__probe_interval_s=60,
                                     health__auto_recover=False, server__port=0, generation__max_new_tokens=5,
                                     generation__vllm_cfg__skip_tokenizer_init=True,
                                     generation__vllm_cfg__max_model_len=1024), driver)
    handle = start_server(fleet)
    try:
        created = _open(handle.url)
        client = _client(created)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                               extra_body={"return_token_ids": True})
        assert [h for h in hops if "prepare" in h] == []  # 17 characters: on the loop
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And in Lyon, Marseille, Toulouse and Bordeaux tomorrow?"}]
        second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                                extra_body={"return_token_ids": True})
        assert [h for h in hops if "prepare" in h] == ["Gateway._prepare.<locals>.prepare"]  # past 60: one hop
        traj = httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").json()
        assert len(traj["segments"]) == 1 and traj["turns"][1]["new_segment_reason"] is None
        assert _masked(traj) == first.choices[0].token_ids + second.choices[0].token_ids
        assert second.prompt_token_ids[:len(first.prompt_token_ids) + len(first.choices[0].token_ids)] == \
            first.prompt_token_ids + first.choices[0].token_ids
    finally:
        handle.stop()
        fleet.shutdown()
        driver.close()
