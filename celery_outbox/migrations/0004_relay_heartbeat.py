"""Relay heartbeats, and the relay holding each leased row.

A relay writes its heartbeat every few seconds; when one stops (``kill -9``, a lost
host), another relay ends the leases of the rows it held instead of waiting for them
to run out. Both changes are cheap on a large outbox: the new column is nullable
with no default (PostgreSQL, MySQL 8 and MariaDB add it without rewriting the table)
and it has no index, which every claim would have to keep up to date; the rare
takeover finds its rows through the ``available_at`` index instead.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0003_task_id_index"),
    ]

    operations = [
        migrations.CreateModel(
            name="RelayHeartbeat",
            fields=[
                (
                    "id",
                    models.CharField(max_length=32, primary_key=True, serialize=False),
                ),
                ("name", models.CharField(blank=True, default="", max_length=255)),
                ("seen_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "relay heartbeat",
                "db_table": "celery_outbox_relay",
            },
        ),
        migrations.AddField(
            model_name="outboxmessage",
            name="holder",
            field=models.CharField(blank=True, max_length=32, null=True),
        ),
    ]
