"""Tool calls, token-in/token-out and their bad input on the server (issue 33, items 1-2), over fake
shards (tests/fakes.py) behind the real app and router, with a tool-call parser (vLLM's hermes) set:
refusals name their field; ``required`` / named / strict choices reach the fleet as the grammar
vLLM's parser makes (whitespace bounded); a tool-using conversation is rendered by the server and
sent as token ids; ``/tokenize`` / ``/detokenize``; and vLLM's parsers read calls out of answers,
whole and streamed, the same. The engines' side is tests/e2e/test_agentic.py's."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers import served_fake_fleet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(make_settings):
    settings = make_settings(fleet__name="fake-tools", fleet__num_shards=1, health__probe_interval_s=60,
                             health__auto_recover=False, server__port=0, server__tool_call_parser="hermes",
                             generation__max_new_tokens=6, generation__vllm_cfg__skip_tokenizer_init=True,
                             generation__vllm_cfg__max_model_len=1024)
    with served_fake_fleet(settings) as (fleet, handle):
        yield fleet, handle, settings


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served[1].url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def sent(served, monkeypatch):
    """What the server asked the fleet for: (prompt, keywords) per call."""
    fleet = served[0]
    calls = []
    real = fleet.generate_async

    async def spy(prompt, **kwargs):
        calls.append((prompt, kwargs))
        return await real(prompt, **kwargs)

    monkeypatch.setattr(fleet, "generate_async", spy)
    return calls


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}]}, "tools"),  # no name
    ({"tools": [{"type": "function"}]}, "tools"),  # no function
    ({"tools": "get_weather"}, "tools"),
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -5}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),  # vLLM lets 0 through; a stream has none
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "tools": []}]}, "messages[0].tools"),
])
def test_bad_tool_and_logprob_input_is_a_400_naming_the_field(served, kwargs, param):
    body = {"messages": ASK, **kwargs}
    answer = httpx.post(f"{served[1].url}/v1/chat/completions", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert "Traceback" not in error["message"]


def test_required_named_and_strict_choices_reach_the_fleet_as_the_parsers_grammar(served, client, sent):
    client.chat.completions.create(model=served[2].model_name(), messages=ASK, tools=TOOLS, tool_choice="required")
    tag = json.loads(sent[-1][1]["structured_outputs"]["structural_tag"])
    text = json.dumps(tag)
    assert '<tool_call>{\\"name\\": \\"get_weather\\"' in text and "get_time" in text
    # whitespace runs bounded (server.tool_call_whitespace), everywhere the grammar had none
    assert '"max_whitespace_cnt": null' not in text and '"max_whitespace_cnt": 4' in text
    client.chat.completions.create(model=served[2].model_name(), messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "get_time"}})
    text = sent[-1][1]["structured_outputs"]["structural_tag"]
    assert "get_time" in text and "get_weather" not in text
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    client.chat.completions.create(model=served[2].model_name(), messages=ASK, tools=strict, tool_choice="required")
    assert '"enum": ["Paris", "Oslo"]' in sent[-1][1]["structured_outputs"]["structural_tag"]
    # auto and none leave the model free; tools are rendered by the server: the fleet gets token ids
    client.chat.completions.create(model=served[2].model_name(), messages=ASK, tools=TOOLS, tool_choice="auto")
    prompt, kwargs = sent[-1]
    assert "structured_outputs" not in kwargs and all(isinstance(t, int) for t in prompt)
    # with a parser set a plain chat is rendered here too (the parser reads its ids), as the fleet renders it
    client.chat.completions.create(model=served[2].model_name(), messages=ASK)
    (request,), _ = served[0].router.requests([ASK])
    assert sent[-1][0] == request.prompt_token_ids


def test_logprob_fields_reach_the_fleet_as_its_keywords(served, client, sent):
    client.chat.completions.create(model=served[2].model_name(), messages=ASK, logprobs=True, top_logprobs=3,
                                   extra_body={"prompt_logprobs": 2})
    assert sent[-1][1]["logprobs"] == 3 and sent[-1][1]["prompt_logprobs"] == 2
    client.completions.create(model=served[2].model_name(), prompt="hi", logprobs=2)
    assert sent[-1][1]["logprobs"] == 2 and "prompt_logprobs" not in sent[-1][1]
    client.chat.completions.create(model=served[2].model_name(), messages=ASK, logprobs=True)
    assert "logprobs" not in sent[-1][1]  # the sampled token's: what the fleet always returns


def test_a_tool_conversation_renders_with_its_calls_and_tokenize_says_so(served, client, sent):
    tok = served[0].router.tokenizer
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    out = client.chat.completions.create(model=served[2].model_name(), messages=messages, tools=TOOLS,
                                         tool_choice="none", extra_body={"return_token_ids": True})
    text = tok.decode(out.prompt_token_ids)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<tools>" in text and "rain" in text
    tokenized = httpx.post(f"{served[1].url}/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert tokenized["tokens"] == out.prompt_token_ids == sent[-1][0]


def test_tokenize_and_detokenize_in_vllms_shapes(served):
    url, tok = served[1].url, served[0].router.tokenizer
    got = httpx.post(f"{url}/tokenize", json={"prompt": "hello there"}).json()
    assert got["tokens"] == tok("hello there")["input_ids"] and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == served[2].generation.vllm_cfg.max_model_len
    assert httpx.post(f"{url}/detokenize", json={"tokens": got["tokens"]}).json()["prompt"] == tok.decode(got["tokens"])
    for path, body, param in [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/tokenize", {"messages": "hi"}, "messages"), ("/tokenize", [], None)]:
        answer = httpx.post(f"{url}{path}", json=body)
        assert answer.status_code == 400, (path, body, answer.text)
        assert (answer.json()["error"]["param"] or "").startswith(param or ""), (path, body, answer.text)
    other = httpx.post(f"{url}/tokenize", json={"prompt": "x", "model": "other"})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"


def _turn(served, body):
    from nemo_gen.server.protocol import parse_chat
    from nemo_gen.server.tools import ChatTools

    call = parse_chat({"messages": ASK, **body})
    return ChatTools(served[2].server, served[0].router.tokenizer).turn(call.request, call.prompts[0])


def test_answers_are_split_by_vllms_parser_whole_and_streamed_alike(served):
    written = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    turn = _turn(served, {"tools": TOOLS})  # tool_choice auto
    message, finish = turn.message(written, [], "stop")
    (call,) = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert finish == "tool_calls" and message.content.strip() == "Let me look."
    stream = turn.stream(turn.render())
    name, args, content, finish = "", "", "", None
    tok = served[0].router.tokenizer
    ids = tok(written, add_special_tokens=False)["input_ids"]
    for i in range(0, len(ids), 3):  # three tokens a delta, as an engine step or two makes them
        piece = tok.decode(ids[:i + 3])[len(tok.decode(ids[:i])):]
        delta, f = stream.delta(piece, ids[i:i + 3], "stop" if i + 3 >= len(ids) else None)
        finish = f or finish
        if delta is None:
            continue
        content += delta.content or ""
        for d in delta.tool_calls:
            name += d.function.name or ""
            args += d.function.arguments or ""
    assert (name, json.loads(args), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")
    assert content.strip() == "Let me look."
    # tool_choice none: the same text is content, no call read
    none, finish = _turn(served, {"tools": TOOLS, "tool_choice": "none"}).message(written, [], "stop")
    assert not none.tool_calls and none.content == written and finish == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call(served):
    two = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
           '<tool_call>{"name": "get_time", "arguments": {"city": "Oslo"}}</tool_call>')
    assert len(_turn(served, {"tools": TOOLS}).message(two, [], "stop")[0].tool_calls) == 2
    (only,) = _turn(served, {"tools": TOOLS, "parallel_tool_calls": False}).message(two, [], "stop")[0].tool_calls
    assert only.function.name == "get_weather"


@pytest.mark.parametrize("key, value", [("tool_call_parser", "hermez"), ("reasoning_parser", "deepseek_r2"),
                                        ("tool_strict_level", "always"), ("tool_call_whitespace", -1)])
def test_unknown_parsers_are_refused_naming_the_setting(key, value):
    from nemo_gen.errors import ConfigError
    from nemo_gen.settings import NemoGenSettings

    with pytest.raises(ConfigError) as info:
        NemoGenSettings.load(overrides={f"server.{key}": value})
    assert f"server.{key}" in str(info.value)
    assert NemoGenSettings.load(overrides={"server.tool_call_parser": "hermes",
                                           "server.reasoning_parser": "deepseek_r1"}).server.tool_call_parser == "hermes"
