"""A subscriber's inbox: its body runs once per event, however often the event arrives.

``@app.subscriber("order.created", inbox=True)`` (or ``CELERY_OUTBOX_INBOX = True``)
runs the subscriber inside ``transaction.atomic()`` on the inbox alias, after an
INSERT of (``<service>:<subscriber task name>``, event id) into the inbox table; both
commit together. A second delivery of the event to that subscriber (a redelivery, a
duplicate publish) finds the row and is acknowledged without running the body. A
failing body rolls the row back with its own writes, so the retry runs it again; a
body that ends with ``Ignore`` commits them, as the inbox of a task does
(:func:`~celery_outbox.inbox.task.inbox_atomic`): its event is done.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import IntegrityError

from ..conf import get_settings
from ..inbox.task import MAX_KEY_LENGTH, inbox_alias, inbox_atomic

logger = logging.getLogger("celery_outbox.events")


class _Duplicate(Exception):
    """The (subscriber, event) row exists: leave the transaction without running it."""


def uses_inbox(task: Any) -> bool:
    """Whether the subscriber's task asks for the inbox (``inbox=True`` or the setting)."""
    check = getattr(task, "uses_inbox", None)
    return bool(check()) if callable(check) else False


def inbox_name(service: str, task_name: str) -> str:
    """The inbox's task name of a subscriber: the event id is its key per (service, subscriber)."""
    return f"{service}:{task_name}"[:MAX_KEY_LENGTH]


def run_subscriber(
    task: Any, service: str, event_id: str, args: Any, kwargs: Any
) -> bool:
    """Run the subscriber's task on the event; returns False when its inbox says it
    already ran for this event (nothing ran)."""
    if not uses_inbox(task):
        task(*args, **kwargs)
        return True
    # Imported here: subscribers are declared before Django's models are loaded.
    from ..inbox.signals import send_duplicate_skipped
    from ..inbox.store import InboxStore

    alias = inbox_alias(get_settings())
    name = inbox_name(service, str(task.name))
    try:
        with inbox_atomic(alias):
            try:
                InboxStore(alias).record(name, event_id)
            except IntegrityError:
                raise _Duplicate from None
            task(*args, **kwargs)
    except _Duplicate:
        logger.info(
            "inbox: %s already handled event %s; acknowledged without running it",
            name,
            event_id,
        )
        send_duplicate_skipped(
            task_id=event_id, task_name=name, key=event_id, using=alias
        )
        return False
    return True
