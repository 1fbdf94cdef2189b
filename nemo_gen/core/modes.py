"""The fleet's vocabulary of modes, targets and actions, as enums: what a refit does to running
requests (``RefitMode``), which model a refit loads (``WeightTarget``) and what one recovery
attempt did (``RecoveryAction``). The fault model's kinds are the wire's ``FailureKind``
(``nemo_gen.core.wire``), the one type of that name.

Strings are accepted only where the outside speaks (settings, the HTTP API, the CLI): ``parse``
turns one into the enum there, with an error that names the key; inside, only the enum. Each is a
``StrEnum`` whose values are the public spellings, so a report or a JSON body reads as before.
"""

from __future__ import annotations

import enum
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


class RefitMode(enum.StrEnum):
    """``refit.in_flight``: how running requests meet a refit's new weights."""

    DRAIN = "drain"  # new requests wait until the running ones finish: strict on-policy
    ABORT = "abort"  # every running request is cut at once (resumed on the new weights if asked)
    KEEP = "keep"  # running requests keep their KV cache and go on under the new weights


class WeightTarget(enum.StrEnum):
    """Which of a shard's models a refit's tensors are for."""

    POLICY = "policy"  # the model that generates
    DRAFT = "draft"  # the speculative-decoding drafter (its tensors are prefixed in a staged refit)


class RecoveryAction(enum.StrEnum):
    """What one recovery attempt of a slot did (``restart_shard``'s ``action``)."""

    NONE = "none"  # nothing to do: the slot serves, or no version to catch up to yet
    CAUGHT_UP = "caught-up"  # the slot's actor lived but was behind: a refit brought it level
    PROMOTED_SPARE = "promoted-spare"  # a warm spare at the fleet's version took the slot
    RESTARTED = "restarted"  # a new actor was started for the slot and refit to the fleet's version
    RESTARTED_STALE = "restarted-stale"  # a new actor serves the slot but could not be refit yet


def parse(kind: type[E], value: object, key: str) -> E:
    """``value`` (a member or its public spelling) as a member of ``kind``; a ``ValueError`` that
    names ``key`` and the accepted values otherwise. For the outside's edges only."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        allowed = [m.value for m in kind]
        raise ValueError(f"{key}: must be one of {allowed}, got {value!r}") from None
