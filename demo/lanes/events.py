"""Events: one event, a copy to each of two services (RabbitMQ or Redis)."""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field

from .base import Lane, RollBack, Row


@dataclass
class Events(Lane):
    """Orders announced to two services; needs a broker that routes events."""

    #: How to see events when this broker cannot route them ("" when it can).
    unavailable: str = ""
    events: int = 3
    services: tuple[str, ...] = ("billing", "shipping")
    title = "events: order_placed() fired in the transaction, to billing and shipping"
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    committed: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    copies: dict[str, Counter[str]] = field(default_factory=dict)

    def place(self) -> None:
        if self.unavailable:
            return
        from django.db import transaction

        from demo.shop.events import order_placed

        for n in range(1, self.events + 2):
            number = f"E-{n:03d}-{self.tag}"  # this run's: a queue may hold older ones
            try:
                with transaction.atomic():
                    order_placed(number)
                    if n == self.events + 1:  # one more, rolled back
                        raise RollBack(number)
            except RollBack:
                self.rolled_back.append(number)
            else:
                self.committed.append(number)

    def collect(self) -> None:
        if self.unavailable:
            return
        from demo.shop.models import Run

        self.copies = {
            service: Counter(
                Run.objects.filter(lane=f"event:{service}").values_list(
                    "key", flat=True
                )
            )
            for service in self.services
        }

    def complete(self) -> bool:
        return all(
            all(self.copies.get(s, Counter())[n] for n in self.committed)
            for s in self.services
        )

    def rows(self) -> list[Row]:
        if self.unavailable:
            return [Row("not on this broker: it needs RabbitMQ or Redis", "-")]
        rows = [
            Row(
                "events committed / rolled back",
                f"{len(self.committed)} / {len(self.rolled_back)}",
            )
        ]
        for service in self.services:
            got = self.copies.get(service, Counter())
            once = sum(1 for n in self.committed if got[n] == 1)
            rows.append(
                Row(
                    f"{service}: committed events handled once",
                    f"{once} / {len(self.committed)}",
                    "all",
                )
            )
        leaked = sum(c[n] for c in self.copies.values() for n in self.rolled_back)
        rows.append(Row("copies of a rolled-back event", str(leaked), "0"))
        return rows

    def problems(self) -> list[str]:
        found = []
        for service in self.services:
            got = self.copies.get(service, Counter())
            if wrong := [n for n in self.committed if got[n] != 1]:
                found.append(
                    f"{service} did not handle {', '.join(wrong)} exactly once"
                )
        if any(c[n] for c in self.copies.values() for n in self.rolled_back):
            found.append("a rolled-back event reached a service")
        return found
