"""The test project's handler-outbox receiver, declared in every test process.

Its category runs in the message's transaction (``atomic=True``): the record and the
message's deletion commit together, so a record exists once per message handled.
"""

from __future__ import annotations

from typing import Any

from celery_outbox import handlers

from .models import TaskRun

#: The category fault tests emit to; the payload's ``tag`` is recorded.
RECORDED = "shop.recorded"


@handlers.receiver(RECORDED, coalesce=False)
def record_message(*, payload: dict[str, Any], message_id: int, **_: Any) -> None:
    """Write one :class:`TaskRun` for the message (tag from the payload)."""
    TaskRun.objects.create(
        task_id=str(message_id), task_name=RECORDED, tag=str(payload["tag"])
    )
