"""The inbox: one message delivered twice, its body committed once."""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field

from .base import Lane, Row


@dataclass
class Inbox(Lane):
    """One message of an inbox task, written to the outbox twice."""

    title = "inbox: credit_points (inbox=True), the same message sent twice"
    message_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    bodies: int = 0
    skipped: int = 0

    def place(self) -> None:
        from django.db import transaction

        from demo.shop.tasks import credit_points

        # The same task id twice, as after a relay lost the broker's confirm and
        # published the message again: the worker gets it two times.
        for _ in range(2):
            with transaction.atomic():
                credit_points.apply_async(("A-0001",), task_id=self.message_id)

    def collect(self) -> None:
        from demo.shop.models import Run

        lanes = Counter(
            Run.objects.filter(key=self.message_id).values_list("lane", flat=True)
        )
        self.bodies, self.skipped = lanes["inbox"], lanes["inbox-skipped"]

    def complete(self) -> bool:
        return self.bodies + self.skipped >= 2

    def rows(self) -> list[Row]:
        return [
            Row("deliveries of the message", str(self.bodies + self.skipped), "2"),
            Row("bodies run and committed", str(self.bodies), "1"),
            Row("duplicates acknowledged without running", str(self.skipped), "1"),
        ]

    def problems(self) -> list[str]:
        if self.bodies != 1:
            return [
                f"the inbox task's body committed {self.bodies} time(s) for one message"
            ]
        return []
