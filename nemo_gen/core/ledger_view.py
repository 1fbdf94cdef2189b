"""The ledger's read side: what every part of the fleet but the slot table gets.

``GenerationFleetHealth`` keeps NeMo-RL's public shape, reads and writes on one object. In the
fleet only the ``SlotTable`` (``nemo_gen.core.slots``) writes it, so slot state changes in its
transactions; the router, prober, refit, recovery and status read it through this view, which
has no write method to call by mistake (tests/tooling/test_structure.py holds the source to it).
"""

from __future__ import annotations

from typing import Any

from nemo_gen.core.fleet_health import FleetHealthPolicy, GenerationFleetHealth, ShardHealth, ShardState


class LedgerView:
    """Read-only access to one ``GenerationFleetHealth`` (each method is the ledger's own)."""

    __slots__ = ("_ledger",)

    def __init__(self, ledger: GenerationFleetHealth) -> None:
        self._ledger = ledger

    @property
    def policy(self) -> FleetHealthPolicy:
        return self._ledger.policy

    @property
    def membership_epoch(self) -> int:
        return self._ledger.membership_epoch

    @property
    def shard_count(self) -> int:
        return self._ledger.shard_count

    def snapshot(self) -> list[ShardHealth]:
        return self._ledger.snapshot()

    def serving_shards(self) -> list[int]:
        return self._ledger.serving_shards()

    def serving_changes_since(self, epoch: int | None) -> tuple[int, list[tuple[int, bool]] | None]:
        return self._ledger.serving_changes_since(epoch)

    def absent_shards(self) -> list[int]:
        return self._ledger.absent_shards()

    def state_of(self, shard_idx: int) -> ShardState:
        return self._ledger.state_of(shard_idx)

    def counts_by_state(self) -> dict[ShardState, int]:
        return self._ledger.counts_by_state()

    def serving_base_urls(self) -> list[str]:
        return self._ledger.serving_base_urls()

    def shard_for_base_url(self, url: str) -> int | None:
        return self._ledger.shard_for_base_url(url)

    def as_metrics(self) -> dict[str, float]:
        return self._ledger.as_metrics()

    def history(self, shard: int | None = None) -> list[dict[str, Any]]:
        return self._ledger.history(shard)

    def state_summary(self) -> dict[str, int]:
        return self._ledger.state_summary()

    def raise_if_exhausted(self) -> None:
        self._ledger.raise_if_exhausted()
