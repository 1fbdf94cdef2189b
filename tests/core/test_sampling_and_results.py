"""nemo_gen.core.sampling (per-call keywords over config defaults) and nemo_gen.core.results."""

from __future__ import annotations

import json

import pytest

from nemo_gen.core.results import GenerationRequest, GenerationResult, too_long_error
from nemo_gen.core.sampling import SAMPLING_KEYS, resolve_sampling
from nemo_gen.errors import DataError, RequestError
from nemo_gen.settings import NemoGenSettings

DEFAULTS = {
    "max_new_tokens": 16,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": None,
    "stop_token_ids": [2],
    "stop_strings": None,
}


def _bad(**overrides) -> RequestError:
    with pytest.raises(RequestError) as info:
        resolve_sampling(DEFAULTS, overrides)
    assert isinstance(info.value, DataError)
    return info.value


# --------------------------------------------------------------------------------------------
# resolve_sampling


def test_defaults_only():
    s = resolve_sampling(DEFAULTS, {})
    assert set(s) == set(SAMPLING_KEYS)
    assert s["max_new_tokens"] == 16
    assert s["temperature"] == 0.7
    assert s["top_p"] == 0.9
    assert s["stop_token_ids"] == [2]
    assert s["seed"] is None and s["ignore_eos"] is None


def test_overrides_win_and_defaults_untouched():
    before = dict(DEFAULTS)
    s = resolve_sampling(DEFAULTS, {"temperature": 0, "max_new_tokens": 4, "seed": 11, "ignore_eos": True})
    assert s["temperature"] == 0
    assert s["max_new_tokens"] == 4
    assert s["seed"] == 11
    assert s["ignore_eos"] is True
    assert s["top_p"] == 0.9  # not overridden
    assert DEFAULTS == before


def test_override_with_none_replaces_default():
    assert resolve_sampling(DEFAULTS, {"stop_token_ids": None})["stop_token_ids"] is None


def test_extra_default_keys_are_ignored():
    cfg = NemoGenSettings.load().generation.to_generation_config()  # the real defaults dict
    s = resolve_sampling(cfg, {})
    assert set(s) == set(SAMPLING_KEYS)
    assert s["max_new_tokens"] == 32 and s["temperature"] == 1.0 and s["top_p"] == 1.0


def test_unknown_keywords_named_and_known_listed():
    err = _bad(temprature=0.5, max_tokens=3, top_p=0.5)
    msg = str(err)
    unknown_part, sep, known_part = msg.partition("known:")
    assert sep, msg
    assert "temprature" in unknown_part and "max_tokens" in unknown_part
    assert "top_p" not in unknown_part  # the valid one is not reported as unknown
    for key in SAMPLING_KEYS:
        assert key in known_part


def test_unknown_keyword_checked_before_values():
    err = _bad(bogus=1, max_new_tokens=0)
    assert "bogus" in str(err)


@pytest.mark.parametrize("value", [1, 1000])
def test_max_new_tokens_ok(value):
    assert resolve_sampling(DEFAULTS, {"max_new_tokens": value})["max_new_tokens"] == value


@pytest.mark.parametrize("value", [0, -1, 1.5, "4", None, True])
def test_max_new_tokens_bad(value):
    assert "max_new_tokens" in str(_bad(max_new_tokens=value))


def test_max_new_tokens_missing_from_defaults():
    with pytest.raises(RequestError, match="max_new_tokens"):
        resolve_sampling({"temperature": 1.0, "top_p": 1.0}, {})


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 1, 2.0])
def test_temperature_ok(value):
    assert resolve_sampling(DEFAULTS, {"temperature": value})["temperature"] == value


@pytest.mark.parametrize("value", [-0.1, -1, None, "1.0"])
def test_temperature_bad(value):
    assert "temperature" in str(_bad(temperature=value))


@pytest.mark.parametrize("value", [1, 1.0, 0.5, 1e-6])
def test_top_p_ok(value):
    assert resolve_sampling(DEFAULTS, {"top_p": value})["top_p"] == value


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.0001, 2, None, "0.5", float("nan")])
def test_top_p_bad(value):
    assert "top_p" in str(_bad(top_p=value))


@pytest.mark.parametrize("value", [None, -1, 1, 50])
def test_top_k_ok(value):
    assert resolve_sampling(DEFAULTS, {"top_k": value})["top_k"] == value


@pytest.mark.parametrize("value", [0, -2, 1.5, "5"])
def test_top_k_bad(value):
    assert "top_k" in str(_bad(top_k=value))


@pytest.mark.parametrize("key", ["stop_strings", "stop_token_ids"])
@pytest.mark.parametrize("value", [None, [], ("a",), ["</s>", "\n"]])
def test_stop_lists_ok(key, value):
    if key == "stop_token_ids" and value not in (None, []):
        value = [2, 3] if isinstance(value, list) else (2,)
    assert resolve_sampling(DEFAULTS, {key: value})[key] == value


@pytest.mark.parametrize("key", ["stop_strings", "stop_token_ids"])
@pytest.mark.parametrize("value", ["</s>", 2, {"a": 1}])
def test_stop_lists_bad(key, value):
    assert key in str(_bad(**{key: value}))


@pytest.mark.parametrize("value", [None, [], ["foo"], ("foo", "bar baz")])
def test_bad_words_ok(value):
    assert resolve_sampling(DEFAULTS, {"bad_words": value})["bad_words"] == value


@pytest.mark.parametrize("value", ["foo", [""], [1], {"a": 1}])
def test_bad_words_bad(value):
    assert "bad_words" in str(_bad(bad_words=value))


def test_bad_words_default_from_the_generation_config():
    assert resolve_sampling({**DEFAULTS, "bad_words": ["x"]}, {})["bad_words"] == ["x"]


@pytest.mark.parametrize("key", ["bad_words", "stop_strings"])
def test_tokenizer_dependent_keywords_refused_on_engines_without_a_tokenizer(key):
    no_tokenizer = {**DEFAULTS, "vllm_cfg": {"skip_tokenizer_init": True}}
    with pytest.raises(RequestError) as info:
        resolve_sampling(no_tokenizer, {key: ["foo"]})
    assert key in str(info.value) and "skip_tokenizer_init" in str(info.value)
    with_tokenizer = {**DEFAULTS, "vllm_cfg": {"skip_tokenizer_init": False}}
    assert resolve_sampling(with_tokenizer, {key: ["foo"]})[key] == ["foo"]
    assert resolve_sampling(no_tokenizer, {})[key] is None  # nothing asked for, nothing refused


@pytest.mark.parametrize("key", ["temperature", "top_k"])
def test_booleans_are_not_numbers(key):
    _bad(**{key: True})


def test_nan_temperature_rejected():
    _bad(temperature=float("nan"))


def test_stop_token_ids_elements_checked():
    _bad(stop_token_ids=["</s>"])


# --------------------------------------------------------------------------------------------
# too_long_error


def test_empty_prompt_rejected():
    msg = too_long_error(0, 16)
    assert msg is not None and msg.startswith("RequestError") and "empty" in msg


def test_prompt_of_exactly_max_model_len_rejected():
    msg = too_long_error(16, 16)
    assert msg is not None
    assert msg.startswith("RequestError")
    assert "generation.vllm_cfg.max_model_len" in msg
    assert "16" in msg


def test_longer_prompt_rejected():
    msg = too_long_error(100, 16)
    assert msg is not None and "100" in msg and "generation.vllm_cfg.max_model_len" in msg


@pytest.mark.parametrize("length", [1, 8, 15])
def test_prompts_that_leave_room_accepted(length):
    assert too_long_error(length, 16) is None


def test_max_model_len_one_fits_nothing():
    assert too_long_error(1, 1) is not None


# --------------------------------------------------------------------------------------------
# GenerationResult


def test_result_ok_and_to_json():
    r = GenerationResult(
        index=3, prompt="hi", prompt_token_ids=[1, 2], text=" there", token_ids=[5, 6],
        logprobs=[-0.1, -0.2], finish_reason="length", shard=1, weight_version=4,
    )
    assert r.ok is True
    data = r.to_json()
    assert data == {
        "index": 3, "prompt": "hi", "prompt_token_ids": [1, 2], "text": " there",
        "token_ids": [5, 6], "logprobs": [-0.1, -0.2], "finish_reason": "length",
        "shard": 1, "weight_version": 4, "error": None, "weight_versions": [], "weight_digests": [],
    }
    assert json.loads(json.dumps(data)) == data
    data["token_ids"].append(99)
    assert r.token_ids == [5, 6]  # to_json returns a copy


def test_result_defaults():
    r = GenerationResult(index=0, prompt=None, prompt_token_ids=[1], text="x")
    assert r.token_ids == [] and r.logprobs == []
    assert r.finish_reason is None and r.shard is None and r.weight_version is None
    assert r.ok is True
    other = GenerationResult(index=1, prompt=None, prompt_token_ids=[1], text="y")
    r.token_ids.append(1)
    assert other.token_ids == []


def test_failed_result():
    req = GenerationRequest(index=5, prompt_token_ids=[7, 8, 9], prompt="p")
    r = GenerationResult.failed(req, "RequestError: too long", shard=2)
    assert r.ok is False
    assert r.index == 5
    assert r.prompt == "p"
    assert r.prompt_token_ids == [7, 8, 9]
    assert r.prompt_token_ids is not req.prompt_token_ids
    assert r.text is None
    assert r.token_ids == [] and r.logprobs == []
    assert r.shard == 2
    assert r.error == "RequestError: too long"
    assert r.to_json()["error"] == "RequestError: too long"


def test_failed_result_without_shard():
    r = GenerationResult.failed(GenerationRequest(index=0, prompt_token_ids=[1]), "boom")
    assert r.shard is None and r.prompt is None and not r.ok


def test_request_is_frozen():
    req = GenerationRequest(index=0, prompt_token_ids=[1])
    with pytest.raises(AttributeError):
        req.index = 1  # type: ignore[misc]


def test_ignore_eos_drops_the_configured_eos_stop_unless_the_call_names_stops():
    from nemo_gen.core.sampling import resolve_sampling

    defaults = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": [2]}
    assert resolve_sampling(defaults, {})["stop_token_ids"] == [2]
    assert resolve_sampling(defaults, {"ignore_eos": True})["stop_token_ids"] is None
    assert resolve_sampling(defaults, {"ignore_eos": True, "stop_token_ids": [7]})["stop_token_ids"] == [7]
