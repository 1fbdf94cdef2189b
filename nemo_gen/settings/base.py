"""What every settings section shares: the ``Section`` base (unknown keys are errors,
assignments are validated), ``ENV_PREFIX``, ``GPU_SHARE_HEADROOM``, the ``one_of`` check against
what is installed, and ``invalid``/``invalid_keys``, which report a cross-field check's failure as
pydantic reports a field's so the loader names the dotted field.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError

ENV_PREFIX = "NEMO_GEN_"

# fleet.shards_per_gpu > 1: the engines' gpu_memory_utilization shares may add up to at most
# 1 - this, leaving room for each engine process's CUDA context and allocator (outside its share).
GPU_SHARE_HEADROOM = 0.05


class Section(BaseModel):
    """A settings section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def one_of(value: str, choices: Sequence[str] | None, what: str, hint: str = "") -> str:
    """``value`` if it is one of ``choices`` (None: vLLM is not installed here, nothing to
    check against), else a ValueError listing them."""
    if choices is not None and value not in choices:
        from nemo_gen.config.loader import suggest

        raise ValueError(f"{value!r} is not {what}{suggest(value, choices)} (known: {', '.join(choices)}){hint}")
    return value


def invalid(title: str, loc: tuple[str, ...], value: Any, kind: str, template: str,
            context: dict[str, Any]) -> ValidationError:
    """A cross-field check's failure as pydantic reports a field's, so the loader names the field."""
    from pydantic_core import InitErrorDetails, PydanticCustomError

    return ValidationError.from_exception_data(
        title, [InitErrorDetails(type=PydanticCustomError(kind, template, context), loc=loc, input=value)])


def invalid_keys(title: str, at: tuple[str, ...], problems: Sequence[tuple[str, str]],
                 values: Mapping[str, Any]) -> ValidationError:
    """One error per bad key of a dict field, each at ``at`` + the key, so the loader names it."""
    from pydantic_core import InitErrorDetails, PydanticCustomError

    return ValidationError.from_exception_data(title, [
        InitErrorDetails(type=PydanticCustomError("env_var", "{why}", {"why": why}), loc=(*at, key),
                         input=values.get(key)) for key, why in problems])

