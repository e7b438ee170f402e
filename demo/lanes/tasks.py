"""Tasks: a receipt per order, sent in the order's transaction."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from .base import Lane, RollBack, Row, median_max_ms


@dataclass
class Tasks(Lane):
    """Orders, each in its own transaction with ``send_receipt.delay(order.id)``."""

    orders: int = 20
    rollback_every: int = 4
    title = "tasks: send_receipt.delay(order.id) in the order's transaction"
    committed: dict[str, datetime] = field(default_factory=dict)  # task id -> commit
    rolled_back: set[str] = field(default_factory=set)
    runs: dict[str, list[datetime]] = field(default_factory=dict)
    foreign: int = 0  # receipts of tasks this run did not send

    def place(self) -> None:
        from django.db import transaction
        from django.utils import timezone

        from demo.shop.models import Order
        from demo.shop.tasks import send_receipt

        for n in range(1, self.orders + 1):
            fail = self.rollback_every > 0 and n % self.rollback_every == 0
            task_id = ""
            try:
                with transaction.atomic():
                    order = Order.objects.create(
                        number=f"A-{n:04d}", total_cents=1000 + 37 * n
                    )
                    task_id = send_receipt.delay(order.id).id
                    if fail:
                        raise RollBack(order.number)
            except RollBack:
                self.rolled_back.add(task_id)
            else:
                self.committed[task_id] = timezone.now()

    def collect(self) -> None:
        from demo.shop.models import Receipt

        ours = self.committed.keys() | self.rolled_back
        runs: dict[str, list[datetime]] = {}
        foreign = 0
        for task_id, executed_at in Receipt.objects.order_by("id").values_list(
            "task_id", "executed_at"
        ):
            if task_id in ours:
                runs.setdefault(task_id, []).append(executed_at)
            else:
                foreign += 1
        self.runs, self.foreign = runs, foreign

    @property
    def executed(self) -> int:
        return sum(1 for task_id in self.committed if self.runs.get(task_id))

    @property
    def leaked(self) -> int:
        return sum(1 for task_id in self.rolled_back if self.runs.get(task_id))

    @property
    def duplicates(self) -> int:
        return sum(len(times) - 1 for times in self.runs.values() if len(times) > 1)

    def complete(self) -> bool:
        return self.executed == len(self.committed)

    def rows(self) -> list[Row]:
        latencies = [
            (self.runs[task_id][0] - committed_at).total_seconds() * 1000
            for task_id, committed_at in self.committed.items()
            if self.runs.get(task_id)
        ]
        committed, rolled_back = len(self.committed), len(self.rolled_back)
        return [
            Row("orders committed / rolled back", f"{committed} / {rolled_back}"),
            Row("receipts run (of committed)", f"{self.executed} / {committed}", "all"),
            Row("receipts run for a rolled-back order", str(self.leaked), "0"),
            Row("duplicate executions", str(self.duplicates), "0"),
            Row("commit -> worker, p50 / max", median_max_ms(latencies)),
        ]

    def problems(self) -> list[str]:
        found = []
        if missing := len(self.committed) - self.executed:
            found.append(f"{missing} committed order(s) never got their receipt")
        if self.leaked:
            found.append(f"{self.leaked} rolled-back order(s) got a receipt anyway")
        if self.duplicates:
            found.append(f"{self.duplicates} receipt(s) ran more than once")
        return found
