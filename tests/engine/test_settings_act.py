"""Settings that reach the engines act there, on a real vLLM CPU engine: bad_words (per call and
from the generation config) keep a token out of the output, and what nemo_gen.config.vllm_choices read
from vLLM's source is what the installed vLLM registers when imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nemo_gen import GenerationFleet

pytestmark = pytest.mark.engine

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def fleet(ray_cluster, make_settings):
    # bad_words in the generation config: the engine loads its tokenizer (skip_tokenizer_init is
    # decided false for them) and every request carries them unless a call says otherwise.
    f = GenerationFleet.launch(make_settings(fleet__name="settings-act", fleet__num_shards=1,
                                             generation__bad_words=["zzzz-not-a-word"]))
    yield f
    f.shutdown()


def _tokenizer(fleet):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(fleet.resolved.tokenizer_dir)


def test_bad_words_keep_a_token_out(fleet):
    free = fleet.generate([PROMPT], temperature=0, max_new_tokens=32, bad_words=[])[0]
    assert free.ok and free.token_ids
    tok = _tokenizer(fleet)
    # vLLM bans a bad word's own tokenization (and its space-prefixed one when that has as many
    # tokens): take a generated token that is a word by itself, so banning the word bans it.
    word, banned = next(((tok.decode([t]).strip(), t) for t in free.token_ids
                         if tok.decode([t]).strip() and tok.encode(tok.decode([t]).strip(), add_special_tokens=False) == [t]),
                        (None, None))
    assert word is not None, f"no generated token is a word by itself: {free.token_ids}"
    constrained = fleet.generate([PROMPT], temperature=0, max_new_tokens=32, bad_words=[word])[0]
    assert constrained.ok
    assert banned not in constrained.token_ids
    assert constrained.token_ids != free.token_ids


def test_bad_words_from_the_generation_config_go_with_every_call(fleet):
    """The configured words are every call's default (what the call above proves the engine
    applies); the engines loaded their tokenizer for them (vLLM drops bad_words without one)."""
    from nemo_gen.core.sampling import resolve_sampling

    cfg = fleet.resolved.generation_config
    assert cfg["vllm_cfg"]["skip_tokenizer_init"] is False
    assert resolve_sampling(cfg, {})["bad_words"] == ["zzzz-not-a-word"]
    assert resolve_sampling(cfg, {"bad_words": ["x"]})["bad_words"] == ["x"]
    out = fleet.generate([PROMPT], temperature=0, max_new_tokens=4)[0]
    assert out.ok and out.token_ids  # a multi-token bad word is applied, not an error


_REGISTRY = """
import json, vllm
from vllm.config.cache import CacheDType
from vllm.config.model import ModelDType
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.model_executor.model_loader import LoadFormats
import dataclasses, typing
import nemo_gen.vllm_ext.worker_entry  # registers nemo_gen's backends, as engines do
print(json.dumps({
    "kv": list(typing.get_args(CacheDType)), "dtypes": list(typing.get_args(ModelDType)),
    "loads": list(typing.get_args(LoadFormats)),
    "backends": sorted(WeightTransferEngineFactory._registry),
    "args": sorted(f.name for f in dataclasses.fields(AsyncEngineArgs)),
}))
"""


def test_what_is_read_from_vllms_source_is_what_vllm_has():
    from nemo_gen.config import vllm_choices

    out = subprocess.run([sys.executable, "-c", _REGISTRY], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    truth = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(vllm_choices.kv_cache_dtypes()) == truth["kv"]
    assert list(vllm_choices.model_dtypes()) == truth["dtypes"]
    assert list(vllm_choices.load_formats()) == truth["loads"]
    assert sorted(vllm_choices.weight_transfer_backends()) == truth["backends"]
    assert vllm_choices.engine_arg_names() == set(truth["args"]) | {"chat_template"}
