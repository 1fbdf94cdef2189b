"""Who decodes a sample's text: a batch's shards leave it to the router (vLLM's front end would
decode every token, and with logprobs every logprob entry's token, in the shard's process), a
request with stop strings and a stream keep the engine's; the router decodes what came undecoded,
and everything where the engines have no tokenizer. The real engine's side of the same rule:
tests/engine/test_fleet.py::test_a_batchs_text_decoded_by_the_router_is_the_engines_own."""

from __future__ import annotations

from types import SimpleNamespace

from nemo_gen.core.detokenize import completion_text
from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.wire import RequestResult, SampleResult, Sampling
from nemo_gen.fleet.decode import decode_result
from nemo_gen.shard import vllm_compat
from nemo_gen.shard.batch import Track, sampled_by


class Letters:
    """A tokenizer whose token i is the letter chr(97 + i % 26)."""

    def __init__(self):
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return "".join(chr(97 + i % 26) for i in ids)


REQ = GenerationRequest(index=0, prompt_token_ids=[1, 2], prompt="p")


def test_a_batch_asks_the_engine_for_no_text_unless_stop_strings_need_it():
    plain = Sampling(max_new_tokens=4, temperature=0.0)
    assert vllm_compat.sampling_params(plain, text=False).detokenize is False
    assert vllm_compat.sampling_params(plain).detokenize is True  # a stream's
    stops = Sampling(max_new_tokens=4, temperature=0.0, stop_strings=("end",))
    assert vllm_compat.sampling_params(stops, text=False).detokenize is True


def test_an_undecoded_requests_samples_carry_no_text_and_a_decoded_ones_the_engines():
    for detokenize, want in ((False, None), (True, "xy")):
        track = Track.start(REQ, SimpleNamespace(n=1, max_tokens=2, detokenize=detokenize), "r", "i")
        comp = SimpleNamespace(index=0, token_ids=[23, 24], logprobs=None, text="" if not detokenize else "xy",
                               finish_reason="length")
        track.observe("r", SimpleNamespace(outputs=[comp], finished=True), sampled_by(0))
        assert track.result.samples[0].text == want


def test_the_router_decodes_what_came_undecoded_and_keeps_the_engines_text():
    tok = Letters()
    undecoded = RequestResult(0, (SampleResult([0, 1, 2], [-0.1] * 3, None, "length"),), None)
    assert decode_result(REQ, undecoded, 0, 1, tok).text == "abc"
    # The engine's own text stays, even empty (a sample of no printable token) or different.
    calls = tok.calls
    for engine_text in ("", "ENGINE"):
        decoded = RequestResult(0, (SampleResult([0, 1, 2], [-0.1] * 3, engine_text, "stop"),), None)
        assert decode_result(REQ, decoded, 0, 1, tok).text == engine_text
    assert tok.calls == calls
    # Engines without a tokenizer: every sample is decoded here, whatever text came.
    blank = RequestResult(0, (SampleResult([3, 4], [-0.1] * 2, "", "length"),), None)
    assert decode_result(REQ, blank, 0, 1, tok, engines_decode=False).text == "de"
    # n samples: each its own.
    group = RequestResult(0, (SampleResult([0], [-0.1], None, "length"), SampleResult([25], [-0.2], None, "length")), None)
    assert [s.text for s in decode_result(REQ, group, 0, 1, tok).samples] == ["a", "z"]


class Bytes:
    """A byte-level tokenizer with SentencePiece's habit: token i is the byte i, except 1-3
    (special: skipped) and 4, "▁" (a space, dropped where a text begins)."""

    def decode(self, ids, skip_special_tokens=True):
        raw = bytes(32 if i == 4 else i for i in ids if not (skip_special_tokens and i in (1, 2, 3)))
        return raw.decode("utf-8", errors="replace").removeprefix(" ")


def test_a_completions_text_is_what_the_engine_hands_out_token_by_token():
    tok, euro = Bytes(), list("€".encode())  # three bytes: e2 82 ac
    hi = [ord(c) for c in "hi"]
    # The leading space survives: the prompt's last tokens are decoded before it as context.
    assert completion_text(tok, [1, *hi], [4, *hi]) == " hi"
    assert tok.decode([4, *hi]) == "hi"
    # A partial character at the end is not handed out (vLLM withholds it until it completes) ...
    assert completion_text(tok, hi, [*hi, *euro[:2]]) == "hi"
    assert completion_text(tok, hi, euro[:1]) == ""
    # ... a complete one is, and an invalid byte in the middle reads as U+FFFD, as in the engine.
    assert completion_text(tok, hi, [*hi, *euro]) == "hi€"
    assert completion_text(tok, hi, [0xFF, *hi]) == "\ufffdhi"
    # A completion that completes the prompt's last character: decoded alone.
    assert completion_text(tok, [*hi, euro[0]], [*euro[1:], *hi]) == "\ufffd\ufffdhi"
    assert completion_text(tok, [], [4, *hi]) == "hi"  # no prompt: no context
