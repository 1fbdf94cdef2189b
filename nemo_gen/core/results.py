"""Requests into the fleet and results out of it, as plain data (no engine types).

A ``GenerationResult`` always says which shard produced it and at which weight version, so a
caller can prove a rollout is on-policy; a request that failed for a data reason carries
``error`` instead of text, and never stops the rest of its batch.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt, already tokenized on the driver. ``index`` is its place in the caller's batch."""

    index: int
    prompt_token_ids: list[int]
    prompt: str | None = None
    # The driver's name for it while it runs (fleet.migration on): its checkpoints are read by it.
    key: str | None = None
    # A migrated sample going on (``nemo_gen.core.migration``): ``prompt_token_ids`` end with the
    # ``continues`` tokens it had made; one sample (n = 1), with that many fewer tokens to make.
    continues: int | None = None
    sample: int = 0  # which of the request's n samples a continuation carries on (its seed is the sample's)


@dataclass
class Sample:
    """One of the ``n`` samples generated for a prompt (a GRPO group has ``n`` of them)."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    weight_versions: list[tuple[int | None, int]] = field(default_factory=list)
    # The content digest of the weights that made each span (``nemo_gen.core.digest``), in the
    # spans' order; None for a version whose weights this fleet did not digest.
    weight_digests: list[str | None] = field(default_factory=list)
    # Each token's {token id: logprob} for it and its top alternatives; None: not asked (sampling "logprobs").
    top_logprobs: list[dict[int, float]] | None = None


class MoveCause(enum.StrEnum):
    """Why a request moved: its shard was lost (dead, condemned), or drained on purpose."""

    LOST = "lost"
    DRAINED = "drained"  # a planned restart or scale-down (nemo_gen.core.drain)


@dataclass
class Moved:
    """A request (its sample ``sample``) went on elsewhere: shard ``from_shard`` was lost (dead,
    condemned) or drained (``cause``) after it had made ``at_token`` tokens, which the result keeps."""

    from_shard: int
    at_token: int
    sample: int = 0
    cause: MoveCause = MoveCause.LOST


@dataclass
class Delta:
    """A streamed request's progress (``generate_stream``): sample ``sample`` of the prompt got
    these tokens since its last delta, on ``shard``. ``weight_versions``: the (version, count)
    spans of these tokens only, in generation order (a refit landing mid-stream under
    ``refit.in_flight`` keep/abort shows as a new span). ``finish_reason`` is set on the sample's
    last delta."""

    sample: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    weight_versions: list[tuple[int | None, int]]
    finish_reason: str | None
    shard: int | None
    weight_digests: list[str | None] = field(default_factory=list)  # beside each of weight_versions


@dataclass
class GenerationResult:
    """What the fleet returns for one prompt. With ``n`` samples, ``samples`` holds them all and
    the result's own text/token_ids/logprobs/finish_reason/weight_versions are ``samples[0]``'s,
    so code written for one sample is unchanged."""

    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    shard: int | None = None
    weight_version: int | None = None  # the version of the last generated token
    error: str | None = None
    # (version, token count) spans in generation order, covering every generated token: two
    # or more when a refit landed while the request ran (refit.in_flight keep / abort).
    weight_versions: list[tuple[int | None, int]] = field(default_factory=list)
    # Beside each span, the content digest of the weights that made it (``Sample.weight_digests``).
    weight_digests: list[str | None] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    # The LoRA adapter that produced it (``generate(..., adapter=name)``) and its version; None: the base model.
    adapter: str | None = None
    adapter_version: int | None = None
    # None unless asked for: samples[0]'s top_logprobs; the prompt's ({token id: logprob} per
    # prompt token, the first None), sampling "prompt_logprobs".
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Where it moved when a shard was lost mid-request (``fleet.migration``), in order; empty: it did not.
    migrations: list[Moved] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        """As JSON; ``samples`` only when there is more than one (the result's fields are the first)."""
        data = asdict(self)
        if len(self.samples) <= 1:
            data.pop("samples")
        if self.adapter is None:
            data.pop("adapter")
            data.pop("adapter_version")
        for key in ("top_logprobs", "prompt_logprobs"):
            if data[key] is None:
                data.pop(key)
        if not data["migrations"]:
            data.pop("migrations")
        if all(s.get("top_logprobs") is None for s in data.get("samples", ())):
            for s in data.get("samples", ()):
                s.pop("top_logprobs", None)
        return data

    @classmethod
    def failed(cls, request: GenerationRequest, error: str, shard: int | None = None) -> "GenerationResult":
        return cls(
            index=request.index,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            text=None,
            shard=shard,
            error=error,
        )


def too_long_error(prompt_len: int, max_model_len: int) -> str | None:
    """The per-request error for a prompt that cannot fit, or None if it fits.

    vLLM needs room for at least one generated token: a prompt of exactly ``max_model_len``
    tokens is rejected too (same rule as vLLM's input processor, checked before dispatch)."""
    if prompt_len == 0:
        return "RequestError: the prompt is empty"
    if prompt_len >= max_model_len:
        return (
            f"RequestError: prompt has {prompt_len} tokens but generation.vllm_cfg.max_model_len is "
            f"{max_model_len} (the prompt plus at least one generated token must fit)"
        )
    return None


def out_of_vocab(prompt: int, token_ids: Sequence[int], vocab_size: int | None) -> str | None:
    """Why prompt ``prompt``'s ids cannot go to an engine, or None: the first id outside
    ``[0, vocab_size)``, by its position. The bound is the model config's ``vocab_size``, the
    rows of the embedding the engine indexes (a tokenizer may be shorter or longer). An engine
    without a tokenizer checks nothing and dies of such an id, and so would the next one it was
    sent to: it is refused here, before any shard sees it. ``vocab_size`` None: unknown, unchecked."""
    if not vocab_size or not token_ids:
        return None
    if min(token_ids) >= 0 and max(token_ids) < vocab_size:  # the common case, at C speed
        return None
    position, token = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size)
    return (f"prompt {prompt}: token id {token} at position {position} is out of the model's vocabulary "
            f"(ids 0 to {vocab_size - 1}: the model config's vocab_size is {vocab_size})")
