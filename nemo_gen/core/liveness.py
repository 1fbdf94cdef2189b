"""Whether a busy engine is alive: the rule a probe answers by while the engine generates.

An engine that holds requests is judged by its progress, never by how long its requests take:
it is alive while it made a step (or, on the async engine, an output) within ``stall_s`` — or
within ``warmup_s`` before its first one, since the first step of a batch (its prefill; on a
fresh engine also kernel selection) can take far longer than a decode step. A 30-minute
generation that makes a token a second is alive for all of its 30 minutes; an engine that made
no step for ``stall_s`` is not, and a streak of such answers condemns its shard.

Shared by the real engine's step clock (``nemo_gen.shard.step_clock``) and the fake tier's
shards, so the fast tests judge liveness by the same rule.
"""

from __future__ import annotations

from typing import Any


def busy_answer(age_s: float, steps: int, stall_s: float, warmup_s: float) -> dict[str, Any]:
    """A probe's answer about an engine busy with requests: ``age_s`` since its last step,
    ``steps`` it made since it became busy."""
    bound = stall_s if steps else max(stall_s, warmup_s)
    if age_s <= bound:
        return {"ok": True, "busy": True, "step_age_s": age_s}
    return {"ok": False, "error": f"engine busy and no generation step for {age_s:.1f}s"}
