"""The test project's handler-outbox receiver, declared in every test process.

Its category runs in the message's transaction (``atomic=True``): the record and the
message's deletion commit together, so a record exists once per message handled.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
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


#: A category whose first run stops mid-receiver, for a processor to be killed in.
STALLED = "shop.stalled"


@handlers.receiver(STALLED, coalesce=False)
def record_after_a_stall(*, payload: dict[str, Any], message_id: int, **_: Any) -> None:
    """Write one :class:`TaskRun`; the first run then stalls before it commits.

    The first run writes ``payload["started"]`` (outside the transaction, so it
    survives a ``kill -9``) and sleeps ``payload["stall"]`` seconds; later runs do not.
    """
    TaskRun.objects.create(
        task_id=str(message_id), task_name=STALLED, tag=str(payload["tag"])
    )
    started = Path(payload["started"])
    if not started.exists():
        started.write_text(str(os.getpid()))
        time.sleep(float(payload["stall"]))
