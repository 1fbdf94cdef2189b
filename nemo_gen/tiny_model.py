"""Tiny random-weight Llama models, made locally: the only model source tests and demos need.

This module owns making (and recognising) a small Hugging Face-format Llama directory that
vLLM's CPU build loads with ``dtype="float32", enforce_eager=True``. Nothing is downloaded:
the weights are random (deterministic for a seed) and the tokenizer is a byte-level BPE
trained here, with the ``tokenizers`` library, on the English corpus embedded below.

A finished directory holds::

    config.json               LlamaConfig (float32, untied embeddings)
    generation_config.json    bos/eos/pad ids
    model.safetensors         the random weights
    tokenizer.json            the trained tokenizer (plus tokenizer_config.json)
    tokenizer_config.json     special tokens <s> </s> <pad> <unk> and a chat template; loads with AutoTokenizer
    special_tokens_map.json
    nemo_gen_tiny_model.json  marker: the parameters it was made with (written last)

``make_tiny_model`` is idempotent (same parameters -> returns at once, nothing rewritten) and
atomic (built in a temporary directory beside the target, then renamed into place), so an
interrupted run never leaves a half model behind. torch, transformers, tokenizers and
safetensors are imported inside functions only: the CLI imports this module cheaply.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from nemo_gen.errors import ConfigError
from nemo_gen.tiny_corpus import CORPUS

__all__ = [
    "CPU_ATTENTION_HEAD_SIZES",
    "MARKER_NAME",
    "MODEL_FILES",
    "TinyModelExistsError",
    "is_tiny_model",
    "make_tiny_model",
    "read_tiny_model_params",
    "tiny_model_param_bytes",
    "tiny_model_num_params",
]

#: Head sizes vLLM 0.32's CPU attention backend accepts
#: (``vllm/v1/attention/backends/cpu_attn.py``: ``CPUAttentionBackend.get_supported_head_sizes``).
CPU_ATTENTION_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

MARKER_NAME = "nemo_gen_tiny_model.json"
MARKER_FORMAT = 1
MODEL_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS: tuple[str, ...] = (UNK, BOS, EOS, PAD)  # ids 0, 1, 2, 3 (Llama's order)
_BYTE_ALPHABET = 256
MIN_VOCAB_SIZE = _BYTE_ALPHABET + len(SPECIAL_TOKENS)
_INIT_STD = 0.02

class TinyModelExistsError(FileExistsError):
    """The target directory holds something other than the requested tiny model."""


# ----------------------------------------------------------------------------- parameters


def _params(
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    vocab_size: int,
    max_position_embeddings: int,
    seed: int,
) -> dict[str, int]:
    """Validate and return the parameters as a plain dict (the marker's content)."""
    params = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
    }
    for name, value in params.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"must be an integer, got {value!r}", field=name)
        if name != "seed" and value <= 0:
            raise ConfigError(f"must be positive, got {value}", field=name)
    if seed < 0:
        raise ConfigError(f"must be >= 0, got {seed}", field="seed")
    if hidden_size % num_heads:
        raise ConfigError(
            f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}", field="num_heads"
        )
    head_dim = hidden_size // num_heads
    if head_dim not in CPU_ATTENTION_HEAD_SIZES:
        raise ConfigError(
            f"hidden_size/num_heads = {hidden_size}/{num_heads} = head_dim {head_dim}, which vLLM's "
            f"CPU attention backend does not support; use one of {list(CPU_ATTENTION_HEAD_SIZES)} "
            f"(e.g. hidden_size={64 * num_heads} for num_heads={num_heads})",
            field="hidden_size",
        )
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"must be at least {MIN_VOCAB_SIZE} (256 byte tokens + {len(SPECIAL_TOKENS)} special "
            f"tokens), got {vocab_size}",
            field="vocab_size",
        )
    return params


def tiny_model_num_params(
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 512,
) -> int:
    """Number of parameters of the tiny Llama (untied embeddings, num_kv_heads == num_heads)."""
    per_layer = 4 * hidden_size * hidden_size + 3 * hidden_size * intermediate_size + 2 * hidden_size
    return 2 * vocab_size * hidden_size + num_layers * per_layer + hidden_size


def tiny_model_param_bytes(
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 512,
    bytes_per_param: int = 4,
) -> int:
    """Bytes of weights of the tiny Llama (float32 by default): what a full refit moves."""
    return bytes_per_param * tiny_model_num_params(
        hidden_size=hidden_size,
        num_layers=num_layers,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
    )


# ----------------------------------------------------------------------------- inspection


def read_tiny_model_params(path: str | os.PathLike[str]) -> dict[str, int] | None:
    """The parameters recorded in ``path``'s marker, or None when there is no readable marker."""
    marker = Path(path) / MARKER_NAME
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("params"), dict):
        return None
    return data["params"]


def _missing_files(path: Path) -> list[str]:
    return [
        name
        for name in (*MODEL_FILES, MARKER_NAME)
        if not (path / name).is_file() or (path / name).stat().st_size == 0
    ]


def is_tiny_model(path: str | os.PathLike[str], **params: int) -> bool:
    """True when ``path`` holds a complete tiny model (made with ``params``, if any are given)."""
    path = Path(path)
    recorded = read_tiny_model_params(path)
    if recorded is None or _missing_files(path):
        return False
    return all(recorded.get(k) == v for k, v in params.items())


# ----------------------------------------------------------------------------- building


def _state_dict(params: dict[str, int]) -> dict[str, Any]:
    """Random Llama weights, named as LlamaForCausalLM names them; deterministic per seed."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(params["seed"])
    h, i, v = params["hidden_size"], params["intermediate_size"], params["vocab_size"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * _INIT_STD

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, h)}
    for layer in range(params["num_layers"]):
        p = f"model.layers.{layer}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{proj}.weight"] = normal(h, h)
        sd[p + "mlp.gate_proj.weight"] = normal(i, h)
        sd[p + "mlp.up_proj.weight"] = normal(i, h)
        sd[p + "mlp.down_proj.weight"] = normal(h, i)
        sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.float32)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float32)
    sd["model.norm.weight"] = torch.ones(h, dtype=torch.float32)
    sd["lm_head.weight"] = normal(v, h)
    return sd


def _train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` tokens, <s> prepended on encode.

    BPE merges learnt on the embedded corpus fill the vocabulary; if the corpus runs out of
    merges before ``vocab_size`` is reached, ``<extra_N>`` tokens fill the rest so that every
    id the model can sample decodes to something.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    short = vocab_size - tok.get_vocab_size()
    if short > 0:
        tok.add_tokens([AddedToken(f"<extra_{n}>", special=False, normalized=False) for n in range(short)])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


# A minimal chat format in the tiny tokenizer's own special tokens, so chat prompts (lists of
# {"role", "content"} messages) render and run on the tiny model like on a real instruct model.
# With tools it renders them and earlier tool calls as Hermes does (<tools>, <tool_call>{json}</tool_call>),
# so vLLM's "hermes" tool parser reads the calls; without, it renders what it always did.
CHAT_TEMPLATE = (
    "{% if tools %}" + BOS + "system\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>" + EOS
    + "\n{% endif %}"
    "{% for m in messages %}" + BOS + "{{ m['role'] }}\n{% if m['content'] is not none %}{{ m['content'] }}{% endif %}"
    "{% for tc in m.get('tool_calls') or [] %}<tool_call>{{ {'name': tc['function']['name'], "
    "'arguments': tc['function']['arguments']} | tojson }}</tool_call>{% endfor %}" + EOS + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + BOS + "assistant\n{% endif %}"
)


def _write_model(tmp: Path, params: dict[str, int]) -> None:
    """Write every file of the model into ``tmp`` (the marker last)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    tok = _train_tokenizer(params["vocab_size"])
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=params["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    hf_tok.save_pretrained(str(tmp))
    # Pin the class so AutoTokenizer loads tokenizer.json as is, whatever model_type says
    # (LlamaTokenizer would build a sentencepiece-style pipeline around our byte-level vocab).
    tc_path = tmp / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["chat_template"] = CHAT_TEMPLATE
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    if not (tmp / "special_tokens_map.json").exists():
        (tmp / "special_tokens_map.json").write_text(
            json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}, indent=2)
            + "\n"
        )

    config = LlamaConfig(
        vocab_size=params["vocab_size"],
        hidden_size=params["hidden_size"],
        intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_heads"],
        num_key_value_heads=params["num_heads"],
        head_dim=params["hidden_size"] // params["num_heads"],
        max_position_embeddings=params["max_position_embeddings"],
        tie_word_embeddings=False,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        torch_dtype="float32",
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(tmp))
    # transformers 5 writes "dtype"; older readers (and this module's contract) want torch_dtype too.
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "float32"
    cfg.setdefault("dtype", "float32")
    cfg["tie_word_embeddings"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    GenerationConfig(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD]).save_pretrained(
        str(tmp)
    )
    save_file(_state_dict(params), str(tmp / "model.safetensors"), metadata={"format": "pt"})

    missing = [n for n in MODEL_FILES if not (tmp / n).is_file()]
    if missing:  # a transformers version that names files differently must fail here, loudly
        raise RuntimeError(f"tiny model build did not produce {missing} in {tmp}")
    marker = {"format": MARKER_FORMAT, "params": params, "files": list(MODEL_FILES)}
    (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    for f in tmp.iterdir():  # durable before the rename publishes it
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def _check_existing(path: Path, params: dict[str, int]) -> bool:
    """True if ``path`` already holds this exact model; raise if it holds anything else."""
    if not path.exists():
        return False
    if not path.is_dir():
        raise TinyModelExistsError(f"{path}: exists and is not a directory; pass overwrite=True to replace it")
    if not any(path.iterdir()):
        return False
    recorded = read_tiny_model_params(path)
    if recorded is None:
        raise TinyModelExistsError(
            f"{path}: directory is not empty and holds no readable {MARKER_NAME} (not a tiny model, or "
            "an incomplete one); pass overwrite=True to replace it"
        )
    diff = {k: (recorded.get(k), v) for k, v in params.items() if recorded.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: existing {old!r} != requested {new!r}" for k, (old, new) in diff.items())
        raise TinyModelExistsError(
            f"{path}: holds a tiny model made with different parameters ({detail}); "
            "pass overwrite=True to replace it"
        )
    missing = _missing_files(path)
    if missing:
        raise TinyModelExistsError(
            f"{path}: tiny model is incomplete (missing or empty: {missing}); pass overwrite=True to rebuild it"
        )
    return True


def make_tiny_model(
    path: str | os.PathLike[str],
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Make (or find) a tiny random-weight HF Llama at ``path`` and return its absolute path.

    Same parameters as an existing complete model -> returns without touching a file.
    Different parameters, a foreign or incomplete directory -> ``TinyModelExistsError``
    unless ``overwrite=True``. Bad parameters -> ``ConfigError`` (a ``ValueError``) naming
    the field, e.g. a head dim (hidden_size/num_heads) the CPU attention kernel rejects.
    """
    params = _params(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
    )
    target = Path(path).expanduser().absolute()
    if not overwrite and _check_existing(target, params):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_model(tmp, params)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if overwrite and target.exists() and (not target.is_dir() or any(target.iterdir())):
            trash = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(target, trash)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(trash, target)
                raise
            if trash.is_dir():
                shutil.rmtree(trash, ignore_errors=True)
            else:
                trash.unlink()
        else:
            try:
                os.rename(tmp, target)  # replaces a missing or empty directory atomically
            except OSError:
                # Someone else published the target meanwhile: fine if it is the same model.
                if _check_existing(target, params):
                    return target
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
