"""Who a fleet's actors are: a ``Member`` names one actor and the role it plays — serving a
slot (``slot`` set) or waiting as a warm spare (``slot`` None).

A slot's actor changes when it is replaced or a spare is promoted, so news about an actor
(a death, a probe answer, a refit outcome) is keyed by the member it was about and is old
news once that member no longer holds its place.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Member:
    name: str  # the Ray actor's name
    slot: int | None  # the fleet position it serves; None while it is a warm spare

    @property
    def is_spare(self) -> bool:
        return self.slot is None

    @property
    def label(self) -> str:
        """How errors and logs name it: the slot number, or the spare's actor name."""
        return self.name if self.slot is None else str(self.slot)
