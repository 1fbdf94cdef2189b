"""Drain: a healthy shard leaves service on purpose (a planned restart, a scale-down).

A drain is not a fault. The slot leaves the serving set at once (``SlotTable.drain``: no new
request goes to it), the requests it holds go on on the other shards from the tokens they had
made (the same migration as a loss, ``nemo_gen.core.migration``; each ``Moved`` says
``cause=drained``), and none of it counts against ``fleet.max_reroutes``: the shard did not
fail them. Then the shard is replaced (``fleet.restart_shard``) or left out of service.

This module decides what may be drained (``refusal``): a shard that exists and serves, and
never the last one that serves, which would leave the fleet nothing to move its requests to.
Pure logic: no engine types.
"""

from __future__ import annotations

from typing import Mapping

from nemo_gen.core.results import MoveCause
from nemo_gen.core.shard_health import SERVING_STATES, ShardState
from nemo_gen.core.wire import FailureKind


class DrainRefused(ValueError):
    """A drain that cannot act (an unknown shard, one not serving, the last serving one): nothing changed."""


def refusal(states: Mapping[int, ShardState], shard: int) -> str | None:
    """Why shard ``shard`` cannot be drained from the fleet's ``states`` (slot -> ledger state),
    or None when it can."""
    if shard not in states:
        known = ", ".join(str(s) for s in sorted(states)) or "none"
        return f"shard {shard}: no such shard (the fleet's shards: {known})"
    state = states[shard]
    if state not in SERVING_STATES:
        return f"shard {shard} is {state.value}, not serving: there is nothing to drain"
    if not any(s != shard and st in SERVING_STATES for s, st in states.items()):
        return (f"shard {shard} is the last serving shard: drained, its requests would have nowhere "
                "to go and the fleet would serve nothing")
    return None


def move_cause(kind: FailureKind, drained: bool) -> MoveCause:
    """Why a request left its shard: a loss of ``kind`` (dead / busy / ...) on a shard that was
    ``drained`` is a drain (moved uncounted: no ``fleet.max_reroutes``, no backoff); else a loss."""
    return MoveCause.DRAINED if kind is FailureKind.DEAD and drained else MoveCause.LOST
