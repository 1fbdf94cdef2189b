"""The batch shapes that go into and come out of a generation backend (``GenerationDatumSpec``,
``GenerationOutputSpec``) and the right-padding check both must pass. torch is imported inside
``verify_right_padding`` only, so importing this module stays cheap. Re-exported by
``nemo_gen.generation.interfaces``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

if TYPE_CHECKING:
    from torch import Tensor
else:
    Tensor = Any


class GenerationDatumSpec(TypedDict):
    """A generation request batch.

    - ``input_ids``: 2-D token ids, **right-padded** with ``_pad_token_id``.
    - ``input_lengths``: the unpadded length of each row.
    - ``stop_strings``: optional, a list of stop strings per sample.
    - ``__extra__``: backend-specific fields may ride along.

    Example, lengths [3, 5, 2]::

        input_ids = [[101, 2054, 2003,    0,    0],
                     [101, 2054, 2003, 2001, 1996],
                     [101, 2054,    0,    0,    0]]
        input_lengths = [3, 5, 2]

    Producers and consumers keep the padding on the right; ``verify_right_padding``
    checks it.
    """

    input_ids: Tensor
    input_lengths: Tensor
    stop_strings: NotRequired[list[list[str] | None]]
    __extra__: Any


class GenerationOutputSpec(TypedDict):
    """A generation result batch, row-aligned with the request.

    - ``output_ids``: the prompt, immediately followed by the generated tokens, then
      ``_pad_token_id`` padding (right-padded).
    - ``generation_lengths``: generated tokens only.
    - ``unpadded_sequence_lengths``: prompt length plus generated length.
    - ``logprobs``: same shape as ``output_ids``; 0 at prompt and padding positions, the
      sampled token's logprob at generated positions.
    - ``truncated``: optional bool per row, True when generation stopped on the length
      limit (vLLM ``finish_reason == "length"``).
    - ``routed_experts`` and ``r3_routed_experts_{missing,expected,actual}_routes``:
      optional MoE routing, in the narrowest signed int that fits (int8 up to 128 experts,
      int16 up to 32,768, else int32; int16 when the count is unknown); -1 marks a
      missing route.

    Example, prompts of 3 and 5 tokens, 4 and 2 generated::

        output_ids = [[101, 2054, 2003, 2023, 2003, 1037, 2200, 0],
                      [101, 2054, 2003, 2001, 1996, 3014, 2005, 0]]
        generation_lengths = [4, 2]
        unpadded_sequence_lengths = [7, 7]
    """

    output_ids: Tensor
    generation_lengths: Tensor
    unpadded_sequence_lengths: Tensor
    logprobs: Tensor
    truncated: NotRequired[Tensor]
    routed_experts: NotRequired[Tensor]
    r3_routed_experts_missing_routes: NotRequired[Tensor]
    r3_routed_experts_expected_routes: NotRequired[Tensor]
    r3_routed_experts_actual_routes: NotRequired[Tensor]
    __extra__: Any


def verify_right_padding(
    data: Mapping[str, Any], pad_value: int, raise_error: bool = True
) -> tuple[bool, str | None]:
    """Check that a batch is right-padded with ``pad_value`` beyond each row's length.

    ``data`` holds either ``input_ids`` + ``input_lengths`` (a ``GenerationDatumSpec``) or
    ``output_ids`` + ``unpadded_sequence_lengths`` (a ``GenerationOutputSpec``); the
    request pair is checked when both are present.

    Args:
        data: The batch; any mapping (a dict or a batched-data dict).
        pad_value: The pad token id, normally the config's ``_pad_token_id``.
        raise_error: Raise ``ValueError`` on the first violation instead of returning it.

    Returns:
        ``(True, None)`` when the padding is right, else ``(False, message)``; the message
        describes the first violating row.

    Raises:
        ValueError: ``pad_value`` is None (always, whatever ``raise_error`` says: it is a
            caller bug, not a data problem), or a violation was found and ``raise_error``.
    """
    import torch  # deferred: keeps `import nemo_gen.generation` free of torch

    if pad_value is None:
        # NeMo-RL asserts here; a ValueError survives `python -O`.
        raise ValueError(
            "pad_value is None: the tokenizer has no pad_token_id. Load the tokenizer so "
            "that pad_token_id is set (NeMo-RL's get_tokenizer(...) sets it when absent) "
            "and pass the generation config's _pad_token_id."
        )

    def _fail(message: str) -> tuple[bool, str | None]:
        if raise_error:
            raise ValueError(message)
        return False, message

    if "input_ids" in data and "input_lengths" in data:
        tensor, lengths = data["input_ids"], data["input_lengths"]
    elif "output_ids" in data and "unpadded_sequence_lengths" in data:
        tensor, lengths = data["output_ids"], data["unpadded_sequence_lengths"]
    else:
        return _fail(
            "Could not find the required pairs of fields. Expected either (input_ids, "
            "input_lengths) or (output_ids, unpadded_sequence_lengths). "
            f"Got keys: {list(data.keys())}"
        )

    tensor = torch.as_tensor(tensor)
    lengths = torch.as_tensor(lengths).reshape(-1)
    if tensor.ndim != 2:
        return _fail(f"Expected 2D tensor for padding check, got shape {tuple(tensor.shape)}")
    batch_size, seq_len = tensor.shape
    if lengths.shape[0] != batch_size:
        return _fail(
            f"Mismatch between tensor batch size ({batch_size}) and lengths tensor size "
            f"({lengths.shape[0]})"
        )

    # One vectorised pass, then report the first offending row the way a row-by-row scan
    # would (length problems and stray tokens are reported in row order).
    lengths = lengths.to(device=tensor.device, dtype=torch.long)
    after_length = torch.arange(seq_len, device=tensor.device)[None, :] >= lengths[:, None]
    stray = after_length & (tensor != pad_value)
    bad_length = (lengths > seq_len) | (lengths < 0)
    bad_rows = torch.nonzero(bad_length | stray.any(dim=1)).flatten()
    if bad_rows.numel() == 0:
        return True, None
    i = int(bad_rows[0])
    length = int(lengths[i])
    if length > seq_len:
        return _fail(f"Length {length} at index {i} exceeds tensor sequence dimension {seq_len}")
    if length < 0:
        return _fail(f"Length {length} at index {i} is negative")
    positions = torch.nonzero(stray[i]).flatten().tolist()
    return _fail(
        f"Non-padding values found after specified length at index {i}: positions {positions}"
    )
