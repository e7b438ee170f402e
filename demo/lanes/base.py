"""What every lane has: a place for its work, its checks and its rows in the table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


class RollBack(Exception):
    """Raised inside ``atomic()`` to abandon the work, as a failed payment would."""


@dataclass(frozen=True)
class Row:
    """One line of the result table."""

    label: str
    result: str
    expected: str = ""


def median_max_ms(values: list[float]) -> str:
    """``"p50 / max ms"`` of ``values`` (milliseconds), or ``-`` when there are none."""
    return f"{statistics.median(values):.0f} / {max(values):.0f} ms" if values else "-"


def runs_by_key(lane: str, *fields: str) -> dict[str, list[tuple[Any, ...]]]:
    """``key -> [(fields) of each run]`` of ``lane``'s ``Run`` rows, in the order they ran."""
    from demo.shop.models import Run

    runs: dict[str, list[tuple[Any, ...]]] = {}
    rows = Run.objects.filter(lane=lane).order_by("id").values_list("key", *fields)
    for key, *values in rows:
        runs.setdefault(key, []).append(tuple(values))
    return runs


class Lane:
    """One kind of work: placed, collected, reported."""

    title = ""

    def place(self) -> None:
        """Send the work, each unit in its own transaction."""

    def collect(self) -> None:
        """Read what ran so far."""

    def complete(self) -> bool:
        """Whether everything that should run has run."""
        return True

    def rows(self) -> list[Row]:
        """The lane's lines of the result table."""
        return []

    def problems(self) -> list[str]:
        """What broke, one line each; empty when every promise held."""
        return []
