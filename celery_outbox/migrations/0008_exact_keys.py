"""Keys compare byte for byte on MySQL/MariaDB (see :mod:`celery_outbox.collation`).

Their default collations fold case, accents and trailing spaces, so distinct
ordering, coalescing and dedup keys, or task ids, were taken for one. The columns
get the binary collation of their character set; PostgreSQL and SQLite are left
alone. On MySQL/MariaDB it is one ``ALTER TABLE`` per column.
"""

from __future__ import annotations

from django.db import migrations

from celery_outbox.collation import ExactKeys


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0007_history"),
    ]

    operations = [
        ExactKeys("outboxmessage", ["task_id", "ordering_key", "routing_key"]),
        ExactKeys("deadletter", ["task_id", "ordering_key", "routing_key"]),
        ExactKeys("historyevent", ["task_id"]),
        ExactKeys("dedupkey", ["dedup_key", "task_id"]),
    ]
