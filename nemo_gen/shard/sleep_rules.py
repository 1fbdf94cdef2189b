"""A shard's sleep and wake (the colocated layout; ``nemo_gen.core.sleep``'s states): the part of
``nemo_gen.shard.rules.Shard``'s rules that moves its engine between awake and asleep. A mixin of
``Shard``: ``self`` holds ``sleep_state``, ``claim`` and the engine. While asleep the shard refuses
requests (``Shard._admission``), skips probes and refuses a refit of weights that are not resident.
"""

from __future__ import annotations

import time
from typing import Any

from nemo_gen.core.sleep import (
    ResetPrefixCache, SleepOrder, SleepPhase, SleepState, WakeOrder, after_sleep, after_wake, draining, tags_to_wake,
    wake_tags,
)
from nemo_gen.shard.engine_protocol import EngineLike


class SleepRules:
    sleep_state: SleepState
    claim: Any  # (Shard's ``Claim``: rules.py imports this module, so it is not named here)

    def _engine(self) -> EngineLike:  # (Shard's)
        raise NotImplementedError

    async def sleep(self, order: SleepOrder) -> float:
        """Sleep at ``order.level`` once the running requests finished (new ones are refused from
        the start): the prefix cache is reset, then vLLM's sleep. Asleep already: nothing to do."""
        engine = self._engine()
        state = self.sleep_state
        if state.phase is SleepPhase.ASLEEP and state.level is not None and state.level >= order.level and not state.resident:
            return 0.0  # (half awake, it sleeps again: what it woke goes back)
        t0 = time.perf_counter()
        before, self.sleep_state = self.sleep_state, draining(self.sleep_state, order.level)
        try:
            async with engine.exclusive():
                await engine.sleep(order.level)
        except BaseException:
            self.sleep_state = before
            raise
        self.sleep_state = after_sleep(before, order.level, self.claim.version)
        return time.perf_counter() - t0

    async def wake(self, order: WakeOrder) -> float:
        """Bring ``order.tags`` back (all when empty); awake already: nothing to do."""
        tags = wake_tags(order.tags or None)
        wanted = tags_to_wake(self.sleep_state, tags)
        t0 = time.perf_counter()
        if wanted:
            await self._engine().wake(wanted)
        self.sleep_state = after_wake(self.sleep_state, tags)
        return time.perf_counter() - t0

    async def reset_prefix_cache(self, order: ResetPrefixCache) -> bool:
        """Drop the prefix cache (asleep: it holds none). False when vLLM refused (requests ran)."""
        if not self.sleep_state.awake:
            return True
        return bool(await self._engine().reset_prefix_cache())
