"""The inbox: a task's database effects happen once per message, however often it is delivered.

Add ``"celery_outbox.inbox"`` to ``INSTALLED_APPS``, then mark tasks with
``@app.task(inbox=True)`` (or set ``CELERY_OUTBOX_INBOX = True``). See ``docs/inbox.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["KEY_HEADER", "InboxMixin"]

if TYPE_CHECKING:
    from .task import KEY_HEADER, InboxMixin


def __getattr__(name: str) -> Any:
    # Imported lazily: the app's task class is resolved before Django is set up.
    if name in __all__:
        from . import task

        return getattr(task, name)
    raise AttributeError(name)
