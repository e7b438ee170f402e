"""Every read and write of the inbox table."""

from __future__ import annotations

from datetime import timedelta

from django.db import DatabaseError, transaction
from django.db.models.functions import Now
from django.utils import timezone

from .models import InboxEntry

#: Rows one purge statement deletes: short transactions, no long lock on the table.
PURGE_CHUNK = 1000
#: MySQL/MariaDB's ER_LOCK_DEADLOCK.
_MYSQL_DEADLOCK = 1213
#: SQLSTATEs of a transaction rolled back to end a deadlock (MySQL/MariaDB's is 40001).
_DEADLOCK_STATES = ("40001", "40P01")


def deadlocked(exc: DatabaseError) -> bool:
    """Whether the database chose the statement that raised ``exc`` to end a deadlock."""
    cause = exc.__cause__
    if getattr(cause, "sqlstate", None) in _DEADLOCK_STATES:
        return True
    args = getattr(cause, "args", None) or (None,)
    return bool(args[0] == _MYSQL_DEADLOCK)


class InboxStore:
    """The inbox table on one database alias."""

    def __init__(self, using: str) -> None:
        self.using = using

    def record(self, task_name: str, key: str) -> None:
        """INSERT the (task, key) row: the only statement the inbox adds to a task.

        Raises :class:`django.db.IntegrityError` when the row exists (committed by an
        earlier delivery). While another transaction holds an uncommitted row for the
        same key, the database makes this INSERT wait for it to end.
        """
        InboxEntry.objects.using(self.using).create(
            task_name=task_name, key=key, created_at=Now()
        )

    def seen(self, task_name: str, key: str) -> bool:
        """Whether a committed row exists for (task, key)."""
        return bool(
            InboxEntry.objects.using(self.using)
            .filter(task_name=task_name, key=key)
            .exists()
        )

    def purge(self, older_than: float, chunk: int = PURGE_CHUNK) -> int:
        """Delete rows older than ``older_than`` seconds, ``chunk`` per transaction."""
        cutoff = timezone.now() - timedelta(seconds=older_than)
        rows = InboxEntry.objects.using(self.using)
        deleted = 0
        while True:
            with transaction.atomic(using=self.using):
                ids = list(
                    rows.filter(created_at__lt=cutoff)
                    .order_by("created_at")
                    .values_list("id", flat=True)[:chunk]
                )
                if ids:
                    rows.filter(id__in=ids).delete()
            deleted += len(ids)
            if len(ids) < chunk:
                return deleted
