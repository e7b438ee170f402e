"""Scheduled tasks: when a task held until its ETA falls due.

A nullable column without a default: added in place (no table rewrite) on
PostgreSQL, MySQL 8, MariaDB and SQLite, and never written for other rows. No
index: the claim finds due rows through ``available_at``, which a scheduled row
shares with ``due_at`` until it is claimed.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0008_exact_keys"),
    ]

    operations = [
        migrations.AddField(
            model_name="outboxmessage",
            name="due_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
