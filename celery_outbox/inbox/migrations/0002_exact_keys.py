"""Inbox keys compare byte for byte on MySQL/MariaDB (see :mod:`celery_outbox.collation`).

With the default collations, distinct keys that differ in case, accents or trailing
spaces were one row: the second message was skipped as a duplicate.
"""

from __future__ import annotations

from django.db import migrations

from celery_outbox.collation import ExactKeys


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox_inbox", "0001_initial"),
    ]

    operations = [
        ExactKeys("inboxentry", ["task_name", "key"]),
    ]
