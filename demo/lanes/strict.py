"""Strict order: a parcel's steps run one after the other, in the order sent."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import Lane, RollBack, Row, runs_by_key


@dataclass
class StrictOrder(Lane):
    """Parcels whose packing steps must run one after the other, in order."""

    parcels: int = 3
    steps: int = 4
    title = 'strict order: pack_step.apply_async(..., ordering_key=, ordering="strict")'
    committed: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    #: parcel -> (step, rows of its key still in the outbox) in the order they ran
    runs: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def place(self) -> None:
        from django.db import transaction

        from demo.shop.tasks import pack_step, parcel_key

        for n in range(1, self.parcels + 1):
            parcel = f"P-{n:03d}"
            try:
                with transaction.atomic():
                    for step in range(1, self.steps + 1):
                        pack_step.apply_async(
                            (parcel, step),
                            ordering_key=parcel_key(parcel),
                            ordering="strict",
                        )
                    if n == self.parcels:  # the last parcel's transaction fails
                        raise RollBack(parcel)
            except RollBack:
                self.rolled_back.append(parcel)
            else:
                self.committed.append(parcel)

    def collect(self) -> None:
        self.runs = runs_by_key("strict", "seq", "behind")

    def complete(self) -> bool:
        return all(len(self.runs.get(p, [])) >= self.steps for p in self.committed)

    def _in_order(self, parcel: str) -> bool:
        return [step for step, _ in self.runs.get(parcel, [])] == list(
            range(1, self.steps + 1)
        )

    def _waited(self) -> set[tuple[int, ...]]:
        return {tuple(b for _, b in self.runs.get(p, [])) for p in self.committed}

    def rows(self) -> list[Row]:
        in_order = sum(1 for parcel in self.committed if self._in_order(parcel))
        leaked = sum(len(self.runs.get(p, [])) for p in self.rolled_back)
        waited = self._waited()
        expected = tuple(range(self.steps - 1, -1, -1))
        shown = " ".join(map(str, waited.pop())) if len(waited) == 1 else "differs"
        return [
            Row(
                f"parcels committed / rolled back ({self.steps} steps each)",
                f"{len(self.committed)} / {len(self.rolled_back)}",
            ),
            Row(
                "parcels whose steps ran once each, in order",
                f"{in_order} / {len(self.committed)}",
                "all",
            ),
            Row(
                "later steps still in the outbox as each ran",
                shown,
                " ".join(map(str, expected)),
            ),
            Row("steps run for a rolled-back parcel", str(leaked), "0"),
        ]

    def problems(self) -> list[str]:
        found = []
        disorder = [p for p in self.committed if not self._in_order(p)]
        if disorder:
            found.append(
                f"parcel(s) {', '.join(disorder)} did not run each step once, in order"
            )
        expected = tuple(range(self.steps - 1, -1, -1))
        if any(w != expected for w in self._waited()):
            found.append("a step was published before the one before it had finished")
        if any(self.runs.get(p) for p in self.rolled_back):
            found.append("a rolled-back parcel's steps ran")
        return found
