"""The inbox table: one row per (task, key) whose body has committed.

Only :mod:`celery_outbox.inbox.store` reads or writes it. Times are written by the
database clock.
"""

from __future__ import annotations

from django.db import models


class InboxEntry(models.Model):
    """A message whose task body committed; a second delivery finds it and is skipped."""

    id = models.BigAutoField(primary_key=True)
    task_name = models.CharField(max_length=255)
    #: The task id, or the caller's idempotency key (the ``inbox_key`` header).
    key = models.CharField(max_length=255)
    created_at = models.DateTimeField()

    class Meta:
        db_table = "celery_outbox_inbox"
        verbose_name = "inbox entry"
        verbose_name_plural = "inbox entries"
        constraints = [
            models.UniqueConstraint(
                fields=["task_name", "key"], name="celery_outbox_inbox_key_uniq"
            )
        ]
        indexes = [
            models.Index(fields=["created_at"], name="celery_outbox_inbox_age_idx")
        ]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.key}]"
