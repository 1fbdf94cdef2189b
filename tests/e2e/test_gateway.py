"""The trajectory gateway (issue 33, items 3-4) with the official openai client against a real CPU
fleet of two vLLM engines (the tiny random-weight model with room for rendered tools) behind
``nemo_gen.server``, in this process:

- a 3-turn tool-using agent (plain Python: the openai client and one real tool function, its
  calls forced by ``tool_choice="required"`` so the random model makes them) through a session:
  the trajectory's masked tokens are the sampled ids turn by turn, the mask's sum is the
  completion tokens, each turn's prompt starts with the previous turns' ids — though the chat
  template re-serialises each tool call (keys sorted) unlike what the engine sampled;
- the same agent from Python (``fleet.session()``): its answers carry the parsed calls, as the
  route's do, and its trajectory holds the sampled ids;
- the session's shard SIGKILLed (its actor, by PID) between two turns: the session goes on on the
  other shard, prefilled from the full token prompt, and its trajectory is complete.

Runs under the engine lock: ``flock /tmp/nemo_gen_engine.lock ... pytest tests/e2e/test_gateway.py``.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import jsonschema
import openai
import pytest

from nemo_gen import GenerationFleet
from tests.e2e.test_agentic import TOOLS, WEATHER, long_model  # noqa: F401 (a fixture)

pytestmark = pytest.mark.e2e


def get_weather(city: str, unit: str) -> str:
    """The agent's one real tool."""
    degrees = {"Paris": 21, "Oslo": 4}[city]
    return f"{city}: {degrees if unit == 'C' else round(degrees * 9 / 5 + 32)} {unit}, clear"


@pytest.fixture(scope="module")
def served(ray_cluster, make_settings, long_model):  # noqa: F811
    from nemo_gen.server import start_server

    settings = make_settings(fleet__name="gateway", fleet__num_shards=2, server__port=0, model__path=str(long_model),
                             generation__vllm_cfg__max_model_len=2048, server__tool_call_parser="hermes",
                             health__probe_interval_s=5, health__auto_recover=False)
    fleet = GenerationFleet.launch(settings)
    handle = start_server(fleet)
    try:
        yield fleet, handle, settings
    finally:
        handle.stop()
        fleet.shutdown()


def _session(url: str) -> dict:
    r = httpx.post(f"{url}/nemo_gen/sessions")
    assert r.status_code == 200, r.text
    return r.json()


def _turn(client, model, messages, choice):
    return client.chat.completions.create(model=model, messages=messages, tools=[TOOLS[0]], tool_choice=choice,
                                          parallel_tool_calls=False, max_tokens=120, temperature=0.7, seed=5,
                                          extra_body={"return_token_ids": True})


def _run_agent(client, model, turns, between=None):
    """The agent: ask, run each call it gets, answer plainly at the last turn."""
    messages = [{"role": "user", "content": "Weather in Paris, then Oslo?"}]
    outs = []
    for k in range(turns):
        if between is not None and k:
            between(k)
        out = _turn(client, model, messages, "required" if k < turns - 1 else "none")
        outs.append(out)
        msg = out.choices[0].message
        if msg.tool_calls:
            (call,) = msg.tool_calls
            args = json.loads(call.function.arguments)
            jsonschema.validate(args, WEATHER)
            messages += [{"role": "assistant", "content": msg.content,
                          "tool_calls": [{"id": call.id, "type": "function",
                                          "function": {"name": call.function.name,
                                                       "arguments": call.function.arguments}}]},
                         {"role": "tool", "tool_call_id": call.id, "content": get_weather(**args)}]
        else:
            messages += [{"role": "assistant", "content": msg.content}, {"role": "user", "content": "Thanks."}]
    return outs


def _check(traj, outs):
    assert len(traj["turns"]) == len(outs) and len(traj["segments"]) == 1
    masked = [t for t, m in zip(traj["token_ids"], traj["loss_mask"]) if m]
    at = 0
    for out, turn in zip(outs, traj["turns"]):
        sampled = out.choices[0].token_ids
        assert turn["token_ids"] == sampled and turn["prompt_token_ids"] == out.prompt_token_ids
        assert masked[at:at + len(sampled)] == sampled  # turn by turn
        at += len(sampled)
        assert turn["new_segment_reason"] is None
    assert at == len(masked)
    assert sum(traj["loss_mask"]) == traj["completion_tokens"] == sum(o.usage.completion_tokens for o in outs)
    for prev, turn in zip(traj["turns"], traj["turns"][1:]):
        before = prev["prompt_token_ids"] + prev["token_ids"]
        assert turn["prompt_token_ids"][:len(before)] == before


def test_a_three_turn_tool_agent_is_recorded_on_the_sampled_ids(served):
    fleet, handle, settings = served
    created = _session(handle.url)
    client = openai.OpenAI(base_url=created["url"], api_key="unused", max_retries=0, timeout=300)
    outs = _run_agent(client, settings.model_name(), 3)
    assert [o.choices[0].finish_reason for o in outs][:2] == ["tool_calls", "tool_calls"]
    traj = httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").json()
    _check(traj, outs)
    assert {t["shard"] for t in traj["turns"]} == {created["shard"]}
    assert all(t["weight_version"] == 0 for t in traj["turns"])
    # the template's own re-rendering of the first call (keys sorted) is not what was sampled: kept out
    tokenizer = fleet._tokenizer  # the driver's copy
    call_text = tokenizer.decode(traj["turns"][0]["token_ids"], skip_special_tokens=True).strip()
    conversation = traj["turns"][0]["request"]["messages"] + [traj["turns"][0]["message"]]
    for m in conversation:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    rerendered = tokenizer.apply_chat_template(conversation, tools=[TOOLS[0]], tokenize=False)
    assert "<tool_call>" in call_text and call_text not in rerendered
    assert httpx.delete(f"{handle.url}/nemo_gen/sessions/{created['id']}").status_code == 200
    assert fleet.router.affinity.placement.counts() == {}


def test_a_streamed_turn_is_recorded_as_sampled(served):
    fleet, handle, settings = served
    created = _session(handle.url)
    client = openai.OpenAI(base_url=created["url"], api_key="unused", max_retries=0, timeout=300)
    (first,) = _run_agent(client, settings.model_name(), 1)  # one plain answer ("none" at the last turn)
    messages = [{"role": "user", "content": "Weather in Paris, then Oslo?"},
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Thanks."}]
    ids, text = [], ""
    for chunk in client.chat.completions.create(model=settings.model_name(), messages=messages, max_tokens=40,
                                                tools=[TOOLS[0]], tool_choice="none", temperature=0.7, seed=5, stream=True,
                                                extra_body={"return_token_ids": True}):
        for choice in chunk.choices:
            ids += getattr(choice, "token_ids", None) or []
            text += choice.delta.content or ""
    traj = httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").json()
    assert len(traj["segments"]) == 1 and traj["turns"][1]["token_ids"] == ids and ids
    assert traj["turns"][1]["message"]["content"] == text
    masked = [t for t, m in zip(traj["token_ids"], traj["loss_mask"]) if m]
    assert masked == first.choices[0].token_ids + ids
    assert traj["turns"][1]["prompt_token_ids"][:len(first.prompt_token_ids) + len(first.choices[0].token_ids)] == \
        first.prompt_token_ids + first.choices[0].token_ids
    httpx.delete(f"{handle.url}/nemo_gen/sessions/{created['id']}")


def test_a_session_survives_its_shard_sigkilled_mid_session(served):
    fleet, handle, settings = served
    created = _session(handle.url)
    home = created["shard"]
    actor = fleet.handle(home).actor_pid
    client = openai.OpenAI(base_url=created["url"], api_key="unused", max_retries=0, timeout=300)

    def kill(k):
        if k == 1:
            os.kill(actor, signal.SIGKILL)
            time.sleep(0.5)

    outs = _run_agent(client, settings.model_name(), 3, between=kill)
    traj = httpx.get(f"{handle.url}/nemo_gen/sessions/{created['id']}/trajectory").json()
    _check(traj, outs)
    assert [t["shard"] for t in traj["turns"]] == [home, 1 - home, 1 - home]
    assert fleet.router.affinity.placement.slot_of(created["id"]) == 1 - home


def test_a_python_session_gets_the_tool_calls_the_route_gives(served):
    """``fleet.session()`` (no HTTP): the same agent, its calls forced; each answer's message
    carries the parsed call (its arguments valid against the schema), sent back as is, and the
    trajectory holds the sampled ids turn by turn as the gateway's does."""
    fleet, _, _ = served
    messages = [{"role": "user", "content": "Weather in Paris, then Oslo?"}]
    results = []
    with fleet.session() as s:
        for choice in ("required", "required", "none"):
            r = s.chat(messages, tools=[TOOLS[0]], tool_choice=choice, parallel_tool_calls=False, max_new_tokens=120,
                       temperature=0.7, seed=5)
            assert r.ok, r.error
            results.append(r)
            messages.append(r.message)
            if choice == "required":
                (call,) = r.message["tool_calls"]
                args = json.loads(call["function"]["arguments"])
                jsonschema.validate(args, WEATHER)
                assert r.chat_finish_reason == "tool_calls"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": get_weather(**args)})
            else:
                assert "tool_calls" not in r.message
        traj = s.trajectory().to_json()
    assert len(traj["segments"]) == 1 and [t["new_segment_reason"] for t in traj["turns"]] == [None] * 3
    masked = [t for t, m in zip(traj["token_ids"], traj["loss_mask"]) if m]
    assert masked == [t for r in results for t in r.token_ids]
    for prev, turn in zip(traj["turns"], traj["turns"][1:]):
        before = prev["prompt_token_ids"] + prev["token_ids"]
        assert turn["prompt_token_ids"][:len(before)] == before
    assert fleet.router.affinity.placement.slot_of(s.id) is None  # closed: released
