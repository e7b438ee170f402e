"""A handler outbox: notes emitted in a transaction, run by a receiver right after the commit."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from .base import Lane, RollBack, Row, median_max_ms, runs_by_key


@dataclass
class HandlerOutbox(Lane):
    """Notes per parcel, emitted in a transaction and run right after its commit."""

    parcels: int = 3
    notes: int = 3
    title = "handler outbox: emit() + @receiver under outbox_context(flush=True)"
    committed: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    done_on_return: int = 0  # receiver runs already done when the block returned
    leaving: dict[str, datetime] = field(default_factory=dict)  # shard -> commit
    runs: dict[str, list[tuple[int, datetime]]] = field(default_factory=dict)

    def place(self) -> None:
        from django.db import transaction
        from django.utils import timezone

        from celery_outbox import handlers as outbox
        from demo.shop.models import Run
        from demo.shop.receivers import PARCEL_NOTE

        for n in range(1, self.parcels + 1):
            shard = f"parcel:P-{n:03d}"
            try:
                # The context is left after the commit: its shards run right then.
                with outbox.outbox_context(flush=True), transaction.atomic():
                    for seq in range(1, self.notes + 1):
                        outbox.emit(
                            PARCEL_NOTE,
                            shard=shard,
                            object_id=seq,
                            payload={"seq": seq},
                        )
                    if n == self.parcels:  # the last parcel's transaction fails
                        raise RollBack(shard)
                    self.leaving[shard] = timezone.now()
            except RollBack:
                self.rolled_back.append(shard)
                continue
            # The block has returned: its receivers already ran, in this process.
            self.committed.append(shard)
            self.done_on_return += Run.objects.filter(lane="handler", key=shard).count()

    def collect(self) -> None:
        self.runs = runs_by_key("handler", "seq", "executed_at")

    def _in_order(self, shard: str) -> bool:
        return [seq for seq, _ in self.runs.get(shard, [])] == list(
            range(1, self.notes + 1)
        )

    def rows(self) -> list[Row]:
        sent = len(self.committed) * self.notes
        in_order = sum(1 for shard in self.committed if self._in_order(shard))
        leaked = sum(len(self.runs.get(s, [])) for s in self.rolled_back)
        latencies = [
            (runs[0][1] - self.leaving[shard]).total_seconds() * 1000
            for shard in self.committed
            if (runs := self.runs.get(shard))
        ]
        return [
            Row(
                f"shards committed / rolled back ({self.notes} notes each)",
                f"{len(self.committed)} / {len(self.rolled_back)}",
            ),
            Row(
                "notes run when the block returned",
                f"{self.done_on_return} / {sent}",
                "all",
            ),
            Row(
                "shards whose notes ran once each, in order",
                f"{in_order} / {len(self.committed)}",
                "all",
            ),
            Row("notes run for a rolled-back block", str(leaked), "0"),
            Row("commit -> receiver, p50 / max", median_max_ms(latencies)),
        ]

    def problems(self) -> list[str]:
        found = []
        sent = len(self.committed) * self.notes
        if self.done_on_return != sent:
            found.append(
                f"{sent - self.done_on_return} note(s) had not run when the block returned"
            )
        disorder = [s for s in self.committed if not self._in_order(s)]
        if disorder:
            found.append(
                f"shard(s) {', '.join(disorder)} did not run each note once, in order"
            )
        if any(self.runs.get(s) for s in self.rolled_back):
            found.append("a rolled-back block's notes ran")
        return found
