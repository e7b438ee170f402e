"""``ENGINE = "celery_outbox.backends.postgresql"``: see :mod:`celery_outbox.backends.writeoncommit`."""

from __future__ import annotations

from django.db.backends.postgresql import base

from ..writeoncommit import WriteOnCommitMixin


class DatabaseWrapper(WriteOnCommitMixin, base.DatabaseWrapper):
    """Django's PostgreSQL ``DatabaseWrapper`` with buffered outbox rows."""
