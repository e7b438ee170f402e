"""``ENGINE = "celery_outbox.backends.postgresql"``: see :mod:`celery_outbox.store.commit`."""

from __future__ import annotations

from django.db.backends.postgresql import base

from ...store.commit import WriteOnCommitMixin


class DatabaseWrapper(WriteOnCommitMixin, base.DatabaseWrapper):
    """Django's PostgreSQL ``DatabaseWrapper`` with held outbox rows."""
