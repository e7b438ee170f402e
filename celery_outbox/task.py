"""OutboxTask: the task class of an OutboxCelery app.

Celery's ``apply_async`` works out a call's options, its route and its message on
every call. For a plain call (``delay(...)``, ``apply_async(args, kwargs)``, a
signature's ``delay()`` without options) all of that follows from the task alone,
so once such a call was built from a template (:mod:`celery_outbox.fastpath`) the
app sends the thread's next plain calls of the task straight from it. Anything
else, and any plain call the app cannot send that way, goes through Celery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery.contrib.django.task import DjangoTask

from .app import OutboxCelery

if TYPE_CHECKING:
    _Base = DjangoTask[Any, Any]
else:
    _Base = DjangoTask


class OutboxTask(_Base):
    """Django's task class (``delay_on_commit`` and all), with a shorter way for plain calls."""

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``apply_async``; a plain call may skip most of it (same message)."""
        if (
            task_id is None
            and producer is None
            and link is None
            and link_error is None
            and shadow is None
            and not options
        ):
            app = self.app
            if isinstance(app, OutboxCelery):  # the class may serve another app too
                result = app._send_plain(self, args, kwargs)
                if result is None:
                    result = super().apply_async(args, kwargs)
                    app._learn_plain(self, result)
                return result
        return super().apply_async(
            args, kwargs, task_id, producer, link, link_error, shadow, **options
        )
