"""A request's own weight policy: the version it must run on (``min_version``) and the most tokens
from older weights it may carry when a refit lands while it runs (``max_staleness``), and the
rule that refuses, naming the field, what the fleet cannot honour. Pure logic: the fleet passes
the version it serves and what its refits do to running requests (``InFlight``).

- ``min_version``: every token must come from weights of at least this version. Versions only
  move forward, so a request admitted while the fleet serves that version or a newer one is
  honoured to its last token; one asked of an older fleet is refused.
- ``max_staleness``: the most tokens from older weights a running request may have when a refit
  swaps the weights under it (the same count ``refit.max_staleness`` bounds). ``drain`` never
  swaps weights under a request, and ``abort`` (or ``keep`` with ``refit.recompute_kv``) recomputes
  every prefix on the new weights: both honour any bound. ``keep`` honours a bound no tighter
  than its ``refit.max_staleness``; without one it honours none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from nemo_gen.core.modes import RefitMode
from nemo_gen.core.wire import InFlight
from nemo_gen.errors import RequestError

POLICY_KEYS = ("min_version", "max_staleness")


@dataclass(frozen=True)
class RequestPolicy:
    min_version: int | None = None
    max_staleness: int | None = None


def split_policy(kwargs: Mapping[str, Any]) -> tuple[RequestPolicy, dict[str, Any]]:
    """The policy keywords of a call (validated: whole numbers >= 0, naming the field), and the rest."""
    values: dict[str, int | None] = {}
    for key in POLICY_KEYS:
        value = kwargs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise RequestError(f"{key}: a whole number >= 0, got {value!r}")
        values[key] = value
    return RequestPolicy(**values), {k: v for k, v in kwargs.items() if k not in POLICY_KEYS}


def staleness_bound(in_flight: InFlight) -> int | None:
    """The most tokens from older weights a running request can carry through a refit done this
    way; None: no bound."""
    if in_flight.mode is not RefitMode.KEEP or in_flight.recompute_kv:
        return 0
    return in_flight.max_staleness


def refusal(policy: RequestPolicy, serving: int | None, in_flight: InFlight) -> str | None:
    """Why the fleet cannot honour ``policy``, naming the field; None when it can."""
    if policy.min_version is not None and (serving is None or serving < policy.min_version):
        now = "no weight version yet" if serving is None else f"weight version {serving}"
        return (f"min_version: the fleet serves {now}; this request must run on version "
                f"{policy.min_version} or newer")
    if policy.max_staleness is not None:
        bound = staleness_bound(in_flight)
        if bound is None or bound > policy.max_staleness:
            most = "any number of" if bound is None else f"up to {bound}"
            return (f"max_staleness: a refit here (refit.in_flight keep, refit.max_staleness "
                    f"{in_flight.max_staleness}) leaves {most} tokens from older weights in a running "
                    f"request; this request allows {policy.max_staleness}")
    return None


def honour(kwargs: Mapping[str, Any], serving: int | None, in_flight: InFlight) -> dict[str, Any]:
    """A call's keywords without its policy, once the policy is one the fleet honours; else
    ``RequestError`` naming the field."""
    policy, rest = split_policy(kwargs)
    problem = refusal(policy, serving, in_flight)
    if problem:
        raise RequestError(problem)
    return rest
