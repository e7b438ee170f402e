"""``OutboxTask``: the task class of every ``OutboxCelery`` app, composed in one place.

Each capability that acts on a task's calls or runs brings a small part of its own,
and this class puts them together over Celery's ``DjangoTask``; no part knows about
another:

* :class:`~celery_outbox.ordering.task.OrderingMixin`: per-task ordering defaults
  (``@app.task(ordering="strict", ordering_policy="skip", coalesce=True)``) for the
  calls that carry an ``ordering_key`` or a ``coalesce_key``;
* :class:`~celery_outbox.inbox.task.InboxMixin`: the opt-in inbox
  (``@app.task(inbox=True)``, ``apply_async(..., inbox_key=...)``).

Both are no-ops for a task that uses neither. Give the app a ``task_cls`` of your own
by deriving it from ``OutboxTask``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery.contrib.django.task import DjangoTask

from .inbox.task import InboxMixin
from .ordering.task import OrderingMixin

if TYPE_CHECKING:
    _DjangoTask = DjangoTask[Any, Any]
else:  # Celery's Task is subscriptable only from 5.7 on
    _DjangoTask = DjangoTask

__all__ = ["OutboxTask"]


class OutboxTask(OrderingMixin, InboxMixin, _DjangoTask):
    """Celery's ``DjangoTask`` with the ordering defaults and the opt-in inbox.

    ``apply_async`` runs through the parts in this order: the ordering defaults are
    set, then the inbox key moves into the headers, then Celery sends the message.
    """
