"""The fleet's drain verbs: a healthy shard leaves service on purpose, its requests moving on.

``fleet.drain(shard)``: the slot leaves the serving set at once (``SlotTable.drain``, the one
writer of slot state), so no new request goes to it; the router takes every request it holds
off it (aborted on its engine) and carries each on on another shard from the tokens it had made
(``fleet.migration``; ``Moved.cause`` is ``drained``), counting none against
``fleet.max_reroutes``. It returns once no call of this process holds a request there (or
``wait_s`` passed: what still runs there then moves when the shard is stopped). The slot stays
out of service, DEAD with ``drained: why`` on record, until it is restarted here or by the heal
flow (``nemo_gen.core.planner`` restarts any DEAD slot).

``fleet.restart_shard(shard)``: the planned restart: a drain, then the recovery's own restart
(``Recovery.restart_shard``: the old actor reaped, a warm spare promoted or a new engine started
and refit to the fleet's version). A shard that no longer serves (dead, stale) is restarted
without a drain. What may be drained is ``nemo_gen.core.drain``'s decision (never an unknown
shard, nor the last serving one): ``DrainRefused`` naming the shard, nothing changed.

A drain acts on this process's router: requests routed by another process attached to the same
fleet are not moved by it (they see the shard go when it is stopped, a loss).
"""

from __future__ import annotations

import time
from typing import Any

from nemo_gen.core.drain import DrainRefused, refusal
from nemo_gen.core.members import Member
from nemo_gen.core.shard_health import SERVING_STATES, ShardState

# How long a drain waits for the router to take the shard's requests off it. The router sees a
# drained shard within its poll (0.1 s); the bound only keeps a wedged call from holding a
# restart forever (what still runs moves when the shard is stopped, as after a loss).
MOVE_WAIT_S = 30.0
_POLL_S = 0.02


def _holds(router: Any, member: Member) -> bool:
    """Does a call of ``router`` still hold requests on ``member``? With ``fleet.migration`` on,
    its checkpointer knows each call's requests by actor; else the slot's acquired count."""
    if router.checkpointer is not None:
        return router.checkpointer.holds(member.name)
    return router.selector.inflight(member.slot) > 0


def _states(fleet: Any) -> dict[int, ShardState]:
    return {s.dp_shard_idx: s.state for s in fleet.members.table.ledger.snapshot()}


def drain_shard(fleet: Any, shard: int, reason: str, wait_s: float) -> dict[str, Any]:
    """Drain ``shard`` of ``fleet`` (a ``GenerationFleet``): see the module doc."""
    ledger = fleet.members.table.ledger
    why = refusal(_states(fleet), shard)
    handle = fleet.members.handle(shard)
    if why is None and handle is None:
        why = f"shard {shard}: no actor holds it"
    if why is not None:
        raise DrainRefused(why)
    member = Member(handle.name, shard)
    if not fleet.members.table.drain(member, reason):
        raise DrainRefused(f"shard {shard} left service meanwhile ({ledger.state_of(shard).value}): not drained")
    t0 = time.monotonic()
    while _holds(fleet.router, member) and time.monotonic() - t0 < wait_s:
        time.sleep(_POLL_S)
    return {"shard": shard, "action": "drained", "actor": handle.name, "reason": reason,
            "moved": not _holds(fleet.router, member), "seconds": time.monotonic() - t0}


def restart_shard(fleet: Any, shard: int, wait_s: float) -> dict[str, Any]:
    """A planned restart of ``shard`` of ``fleet``: see the module doc."""
    drained: dict[str, Any] = {"shard": shard, "action": "none"}
    state = _states(fleet).get(shard)
    if state is None or state in SERVING_STATES:  # (an unknown shard: refused by the drain, naming it)
        drained = drain_shard(fleet, shard, "planned restart", wait_s)
    if not fleet.members.begin_recovery(shard):  # (its self-healing thread restarts it already)
        raise DrainRefused(f"shard {shard} is being recovered already: not restarted twice")
    try:
        return {**drained, "restart": fleet.recovery.restart_shard(shard)}
    finally:
        fleet.members.end_recovery(shard)
