"""Flow control (docs/flow.md): a row per flow, and the publishes recorded for each.

Two new tables, nothing changed on the outbox: a task with no flow never reads them.
The (flow, at) index serves the window's sum and the prune of old records.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0009_scheduled"),
    ]

    operations = [
        migrations.CreateModel(
            name="FlowState",
            fields=[
                (
                    "name",
                    models.CharField(max_length=255, primary_key=True, serialize=False),
                ),
                ("rates", models.CharField(blank=True, max_length=255, null=True)),
                ("changed_at", models.DateTimeField(blank=True, null=True)),
                ("paced_until", models.DateTimeField(blank=True, null=True)),
            ],
            options={
                "verbose_name": "flow",
                "db_table": "celery_outbox_flow",
            },
        ),
        migrations.CreateModel(
            name="FlowRecord",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("flow", models.CharField(max_length=255)),
                ("at", models.DateTimeField()),
                ("tasks", models.PositiveIntegerField()),
            ],
            options={
                "verbose_name": "flow record",
                "db_table": "celery_outbox_flow_record",
                "indexes": [
                    models.Index(
                        fields=["flow", "at"], name="celery_outbox_flow_at_idx"
                    )
                ],
            },
        ),
    ]
