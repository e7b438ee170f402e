"""The demo's handler outbox receiver: runs in the process that emitted, after commit."""

from __future__ import annotations

from typing import Any

from django.utils import timezone

from celery_outbox import handlers as outbox

from .models import Run

#: The category of a parcel's notes; every note matters, so none is coalesced.
PARCEL_NOTE = "demo.parcel.note"


@outbox.receiver(PARCEL_NOTE, coalesce=False, max_attempts=3)
def on_parcel_note(*, shard: str, payload: dict[str, Any], **_: Any) -> None:
    """Record the note: its shard and its number within the shard."""
    Run.objects.create(
        lane="handler", key=shard, seq=payload["seq"], executed_at=timezone.now()
    )
