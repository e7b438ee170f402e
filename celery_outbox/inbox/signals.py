"""Django signals of the inbox.

``duplicate_skipped(task_id, task_name, key, using)``
    A delivery found its (task, key) row already committed: the body did not run and
    the message is acknowledged. Sent with ``send_robust`` (a receiver that raises is
    logged); the sender is :class:`~celery_outbox.inbox.models.InboxEntry`. Count
    duplicates by connecting a receiver.
"""

from __future__ import annotations

import logging
from typing import Any

from django.dispatch import Signal

logger = logging.getLogger("celery_outbox.inbox")

duplicate_skipped = Signal()


def send_duplicate_skipped(**kwargs: Any) -> None:
    """Send :data:`duplicate_skipped`; a failing receiver is logged, never raised."""
    from .models import InboxEntry

    for receiver, response in duplicate_skipped.send_robust(
        sender=InboxEntry, **kwargs
    ):
        if isinstance(response, Exception):
            logger.error(
                "celery-outbox inbox signal receiver %r failed: %s",
                receiver,
                response,
                exc_info=response,
            )
