"""The generate path's part of the shard's wire (``nemo_gen.core.wire`` re-exports every name
here; import them from there): a request's ``Sampling``, its ``RequestResult`` of
``SampleResult``s in a ``GenerateReply``, a stream's ``StreamDeltas`` of ``SampleDelta``s and its
``StreamEnd``, and the diagnostics tests and benchmarks read (``StepGaps``, ``Unfinished``,
``LoadStats``). Frozen dataclasses, no dict: what a caller gets as dicts (``GenerationResult``'s
logprob alternatives) is built on the driver (``nemo_gen.fleet.decode``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Union

# -- generation ------------------------------------------------------------------------------------

# One token's logprob and its top alternatives' ((token id, logprob) pairs, the sampled one among them).
TokenLogprobs = tuple[tuple[int, float], ...]
Spans = tuple[tuple[Union[int, None], int], ...]  # (weight version, tokens) in generation order


def pairs(entries: Mapping[int, float]) -> TokenLogprobs:
    return tuple((int(t), float(lp)) for t, lp in entries.items())


@dataclass(frozen=True)
class Structured:
    """A grammar to decode under (vLLM's ``StructuredOutputsParams``): exactly one of ``json`` (a
    JSON schema, as JSON text), ``regex``, ``choice``, ``grammar``, ``json_object``,
    ``structural_tag``, and vLLM's options."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> "Structured":
        """The sampling keyword's dict (``nemo_gen.core.sampling``, checked there)."""
        fields = dict(spec)
        if fields.get("json") is not None and not isinstance(fields["json"], str):
            fields["json"] = json.dumps(fields["json"])
        if fields.get("choice") is not None:
            fields["choice"] = tuple(fields["choice"])
        return cls(**fields)

    def as_kwargs(self) -> dict[str, Any]:
        """``StructuredOutputsParams``' keywords (set fields and options only)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out["choice"] is not None:
            out["choice"] = list(out["choice"])
        return out


def _tuple(value: Iterable[Any] | None) -> tuple[Any, ...] | None:
    return None if value is None else tuple(value)


@dataclass(frozen=True)
class Sampling:
    """A request's sampling parameters, resolved and checked on the driver
    (``nemo_gen.core.sampling.resolve_sampling``), as the shard's engine takes them. ``adapter``:
    the LoRA adapter's (engine name, engine id), None: the base model."""

    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] | None = None
    bad_words: tuple[str, ...] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    structured_outputs: Structured | None = None
    logprobs: int = 0  # alternatives per token beside the sampled one
    prompt_logprobs: int | None = None  # None: the prompt's are not computed
    adapter: tuple[str, int] | None = None

    @classmethod
    def of(cls, resolved: Mapping[str, Any], adapter: Iterable[Any] | None = None) -> "Sampling":
        """A resolved sampling dict (every key of ``SAMPLING_KEYS``; a missing one is unset)."""
        so = resolved.get("structured_outputs")
        top_p = resolved.get("top_p")
        name, engine_id = adapter if adapter else (None, None)
        return cls(
            max_new_tokens=resolved["max_new_tokens"], temperature=resolved["temperature"],
            top_p=1.0 if top_p is None else top_p, top_k=resolved.get("top_k"),
            stop_token_ids=_tuple(resolved.get("stop_token_ids")), stop_strings=_tuple(resolved.get("stop_strings")),
            bad_words=_tuple(resolved.get("bad_words")), seed=resolved.get("seed"),
            ignore_eos=bool(resolved.get("ignore_eos")), n=resolved.get("n") or 1,
            structured_outputs=Structured.of(so) if so else None, logprobs=resolved.get("logprobs") or 0,
            prompt_logprobs=resolved.get("prompt_logprobs"),
            adapter=None if name is None or engine_id is None else (str(name), int(engine_id)),
        )


@dataclass(frozen=True)
class SampleResult:
    """One of a request's ``n`` samples, finished. ``weight_versions``: its tokens by the version
    that sampled them (empty: all by the version the reply names); ``top_logprobs``: each
    token's alternatives, when the request asked for them. Token and logprob lists are the
    engine's own, not copied."""

    token_ids: list[int]
    logprobs: list[float]
    text: str | None
    finish_reason: str | None
    weight_versions: Spans = ()
    top_logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class RequestResult:
    """One request's result from its shard's engine: its samples (the first is the result's own),
    or ``error`` (vLLM refused the request; the rest of its batch still ran). ``prompt_logprobs``:
    per prompt token (the first None), when the request asked for them."""

    index: int
    samples: tuple[SampleResult, ...] = ()
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    @classmethod
    def failed(cls, index: int, error: str) -> "RequestResult":
        return cls(index, error=error)


@dataclass(frozen=True)
class SampleDelta:
    """One sample's progress since a stream's last item: its new tokens, their text and
    logprobs, the versions that sampled them; ``finish_reason`` set on its last delta."""

    sample: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    weight_versions: Spans
    finish_reason: str | None


@dataclass(frozen=True)
class GenerateReply:
    """A generate call's answer: ``results`` (one per request, in order) were made by shard
    ``shard`` at ``weight_version``, read when the work started."""

    shard: int | None
    weight_version: int | None
    results: tuple[RequestResult, ...]
    seconds: float


@dataclass(frozen=True)
class SampleProgress:
    """What one running sample has made from token ``start`` on (the driver already knows the
    tokens before it): a checkpoint of the request (``fleet.migration``), so that the request
    goes on elsewhere from its tokens if its shard is lost."""

    sample: int
    start: int
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: Spans
    finish_reason: str | None = None


@dataclass(frozen=True)
class RequestProgress:
    """A running request's checkpoint, by the key the driver gave it (``GenerationRequest.key``)."""

    key: str
    samples: tuple[SampleProgress, ...]


@dataclass(frozen=True)
class StreamDeltas:
    """A stream's item: per sample that moved, the tokens since the last item."""

    deltas: tuple[SampleDelta, ...]


@dataclass(frozen=True)
class StreamEnd:
    """A stream's last item: the request's whole result, stamped as ``GenerateReply`` is."""

    result: RequestResult
    shard: int | None
    weight_version: int | None
    seconds: float


# -- diagnostics (tests and benchmarks) ---------------------------------------------------------------


@dataclass(frozen=True)
class StepGaps:
    """The longest time the engine went without finishing a step since the last reset, and each
    stretch without one over ``nemo_gen.shard.step_clock.GAP_S`` as (start, end) on the host's
    monotonic clock."""

    max_step_gap_s: float
    gaps: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class Unfinished:
    """The requests an engine holds, as vLLM's own output processor counts them (an abort removes
    one at once): (engine request id, tokens generated so far)."""

    requests: tuple[tuple[str, int], ...] = ()

    def __len__(self) -> int:
        return len(self.requests)

    def tokens(self) -> dict[str, int]:
        return dict(self.requests)


@dataclass(frozen=True)
class LoadStats:
    """How one worker's last weight load went (a staged refit, or one through vLLM's weight
    transfer): the load path, its seconds and their parts, the kernel repack's share (direct
    path only), the copy plan's note, when it finished (wall clock), and the transfer's seconds.
    All None before any load."""

    path: str | None = None
    seconds: float | None = None
    load_s: float | None = None
    prepare_s: float | None = None
    repack_s: float | None = None
    plan: str | None = None
    finished_at: float | None = None
    transfer_s: float | None = None

    @classmethod
    def of(cls, stats: Mapping[str, Any]) -> "LoadStats":
        """A worker's answer (``nemo_gen_load_stats``)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in stats.items() if k in names})


