"""Each message's history (``CELERY_OUTBOX_HISTORY``): one row per event, by task id.

A new table only: nothing is written to it until the setting is on. Its one index
is on ``task_id`` (``outbox tasks inspect``, the admin); the retention purge walks the
primary key instead of an index on ``at``, which every settlement would update.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0006_ordering"),
    ]

    operations = [
        migrations.CreateModel(
            name="HistoryEvent",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("task_id", models.CharField(max_length=255)),
                ("task_name", models.CharField(max_length=255)),
                ("event", models.CharField(max_length=16)),
                ("at", models.DateTimeField()),
                ("enqueued_at", models.DateTimeField()),
                ("attempt", models.PositiveIntegerField(default=0)),
                ("error", models.TextField(blank=True, default="")),
                (
                    "relay_id",
                    models.CharField(blank=True, max_length=32, null=True),
                ),
                ("process", models.CharField(blank=True, default="", max_length=255)),
            ],
            options={
                "verbose_name": "history event",
                "db_table": "celery_outbox_history",
                "indexes": [
                    models.Index(
                        fields=["task_id"], name="celery_outbox_history_task_idx"
                    )
                ],
            },
        ),
    ]
