"""Agentic rollouts through the HTTP front (issue 33, items 1 and 2), with the official openai client
against one real vLLM CPU engine (the tiny random-weight model) behind ``nemo_gen.server``, in
this process so the answers can be set beside ``fleet.generate``'s:

- tool calls: ``tool_choice="required"`` and a named function are decoded under the tools' JSON
  schema (vLLM's structured outputs), so even a random model's call validates against it;
  ``auto`` through the named parser (``server.tool_call_parser: hermes``) finds a call the model
  wrote (here a regex constraint makes the random model write one); streamed tool-call deltas
  reassemble to the call the same request gets unstreamed (temperature 0); a conversation with
  the call and the tool's answer renders as the chat template says;
- token-in/token-out: ``/tokenize`` is the HF tokenizer's ids (a chat: its template's),
  ``/detokenize`` its text; ``return_token_ids`` is ``fleet.generate``'s prompt and sampled ids
  for the same prompt and seed; chat ``top_logprobs`` gives that many alternatives per token,
  completions ``logprobs`` too, and ``prompt_logprobs`` one entry per prompt token.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from nemo_gen import GenerationFleet

pytestmark = pytest.mark.e2e

# Short schemas: the tiny tokenizer spends a token on every few characters of the rendered tools.
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
# strict: the arguments follow the schema (OpenAI's flag; vLLM pins the schema in the call's grammar;
# without it the envelope is forced and the arguments are any JSON — server.tool_strict_level: parameter
# makes every tool strict).
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# What a Hermes-format model writes for a call; the regex makes the random model write it.
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "unit": "(C|F)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny model with room for rendered tools (the session's has 512 positions; these
    prompts alone take ~400 tokens of its small vocabulary)."""
    from nemo_gen.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("agentic") / "tiny", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def served(ray_cluster, make_settings, long_model):
    from nemo_gen.server import start_server

    settings = make_settings(fleet__name="agentic", fleet__num_shards=1, server__port=0, model__path=str(long_model),
                             generation__vllm_cfg__max_model_len=2048,
                             server__tool_call_parser="hermes", health__probe_interval_s=5)
    fleet = GenerationFleet.launch(settings)
    handle = start_server(fleet)
    try:
        yield fleet, handle, settings
    finally:
        handle.stop()
        fleet.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served[1].url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_tokenizer(long_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(long_model))


def model(served) -> str:
    return served[2].model_name()


def test_required_returns_a_call_whose_arguments_validate_against_the_tools_schema(served, client):
    out = client.chat.completions.create(model=model(served), messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=200, temperature=0)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    tool = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["parameters"])
    assert call.id and call.type == "function"


def test_a_named_function_is_the_call_made(served, client):
    out = client.chat.completions.create(model=model(served), messages=ASK, tools=TOOLS, max_tokens=200,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}},
                                         temperature=0.8, seed=3)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME)


def test_auto_reads_the_call_the_model_wrote_through_the_named_parser(served, client):
    out = client.chat.completions.create(model=model(served), messages=ASK, tools=TOOLS, tool_choice="auto",
                                         max_tokens=200, temperature=0,
                                         extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls" and not (choice.message.content or "").strip(), choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # without tools the same text is the answer's content: the parser is what found the call
    plain = client.chat.completions.create(model=model(served), messages=ASK, max_tokens=200, temperature=0,
                                           extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    assert plain.choices[0].message.content.startswith("<tool_call>") and not plain.choices[0].message.tool_calls


def _reassembled(chunks) -> tuple[list[tuple[str, str]], str | None]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                name, args = calls.setdefault(d.index, ["", ""])
                calls[d.index] = [name + (d.function.name or ""), args + (d.function.arguments or "")]
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("how", ["auto", "required"])
def test_streamed_tool_call_deltas_reassemble_to_the_unstreamed_call(served, client, how):
    kwargs = dict(model=model(served), messages=ASK, tools=TOOLS, max_tokens=200, temperature=0)
    if how == "auto":
        kwargs.update(tool_choice="auto", extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    else:
        kwargs.update(tool_choice="required", parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs)
    calls, finish = _reassembled(client.chat.completions.create(stream=True, **kwargs))
    expected = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert expected and [(n, json.loads(a)) for n, a in calls] == [(n, json.loads(a)) for n, a in expected]
    assert finish == whole.choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_a_call_and_its_result_renders_as_the_template_says(served, client, hf_tokenizer):
    import httpx

    turn = client.chat.completions.create(model=model(served), messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=200, temperature=0)
    call = turn.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    out = client.chat.completions.create(model=model(served), messages=messages, tools=TOOLS, tool_choice="none",
                                         max_tokens=6, extra_body={"return_token_ids": True})
    hf_messages = [dict(m) for m in messages]
    hf_messages[1] = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": call.function.name,
                                          "arguments": json.loads(call.function.arguments)}}]}
    text = hf_tokenizer.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tool_call>" in text and "sunny, 21 C" in text
    assert out.prompt_token_ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    tokenized = httpx.post(f"{served[1].url}/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert tokenized["tokens"] == out.prompt_token_ids


def test_tokenize_is_the_hf_tokenizers_and_detokenize_inverts_it(served, hf_tokenizer):
    import httpx

    url = served[1].url
    prompt = "The engine wakes before the city does."
    got = httpx.post(f"{url}/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
    assert got["tokens"] == hf_tokenizer(prompt)["input_ids"] and got["count"] == len(got["tokens"])
    assert got["token_strs"] == hf_tokenizer.convert_ids_to_tokens(got["tokens"])
    assert got["max_model_len"] == served[2].generation.vllm_cfg.max_model_len
    bare = httpx.post(f"{url}/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()
    assert bare["tokens"] == hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    chat = httpx.post(f"{url}/tokenize", json={"messages": ASK}).json()
    text = hf_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    back = httpx.post(f"{url}/detokenize", json={"tokens": bare["tokens"]}).json()
    assert back == {"prompt": prompt}


def test_return_token_ids_are_fleet_generates_for_the_same_prompt_and_seed(served, client):
    fleet = served[0]
    sampling = dict(temperature=1.0, seed=11)
    (lib,) = fleet.generate([ASK], max_new_tokens=12, **sampling)
    out = client.chat.completions.create(model=model(served), messages=ASK, max_tokens=12,
                                         extra_body={"return_token_ids": True}, **sampling)
    assert out.prompt_token_ids == lib.prompt_token_ids and out.choices[0].token_ids == lib.token_ids
    assert out.choices[0].message.content == lib.text
    prompt = "Nobody in the control room watches a single engine."
    (lib,) = fleet.generate([prompt], max_new_tokens=12, **sampling)
    done = client.completions.create(model=model(served), prompt=prompt, max_tokens=12,
                                     extra_body={"return_token_ids": True}, **sampling)
    assert done.choices[0].prompt_token_ids == lib.prompt_token_ids and done.choices[0].token_ids == lib.token_ids
    # the prompt given as its token ids is the same request
    again = client.completions.create(model=model(served), prompt=lib.prompt_token_ids, max_tokens=12,
                                      extra_body={"return_token_ids": True}, **sampling)
    assert again.choices[0].token_ids == lib.token_ids


def test_chat_top_logprobs_gives_that_many_alternatives_per_token(served, client):
    out = client.chat.completions.create(model=model(served), messages=ASK, max_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)  # greedy: the sampled one is the top
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    # and the sampled logprobs are the ones fleet.generate reports
    (lib,) = served[0].generate([ASK], max_new_tokens=8, temperature=0.0)
    assert [e.logprob for e in content] == pytest.approx(lib.logprobs, abs=1e-4)


def test_completion_logprobs_and_prompt_logprobs(served, client):
    prompt = "A prompt arrives: a question about the weather."
    out = client.completions.create(model=model(served), prompt=prompt, max_tokens=5, temperature=0, logprobs=2,
                                     extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    (choice,) = out.choices
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert len(choice.logprobs.token_logprobs) == 5
    prompt_lps = choice.prompt_logprobs
    assert len(prompt_lps) == len(choice.prompt_token_ids) and prompt_lps[0] is None
    for tid, entry in zip(choice.prompt_token_ids[1:], prompt_lps[1:]):
        assert str(tid) in entry  # the prompt's own token, with its logprob
