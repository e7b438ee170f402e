"""Flow control per key (docs/flow.md): a slot per running task of a flow key, an
operator's limits per flow, and the key of the rows that wait for a slot.

``flow_key`` is NULL on every row but those waiting for a slot of their key, so
the enqueue path never writes it, and its index stays small.
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0010_flows"),
    ]

    operations = [
        migrations.AddField(
            model_name="outboxmessage",
            name="flow_key",
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
        migrations.AddIndex(
            model_name="outboxmessage",
            index=models.Index(
                fields=["flow_key", "id"], name="celery_outbox_flowkey_idx"
            ),
        ),
        migrations.AddField(
            model_name="flowstate",
            name="limits",
            field=models.TextField(blank=True, null=True),
        ),
        migrations.CreateModel(
            name="FlowSlot",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("flow", models.CharField(max_length=255)),
                ("flow_key", models.CharField(max_length=255)),
                ("task_id", models.CharField(max_length=255)),
                ("started", models.BooleanField(default=False)),
                ("expires_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "flow slot",
                "db_table": "celery_outbox_flow_slot",
                "indexes": [
                    models.Index(
                        fields=["flow", "flow_key"], name="celery_outbox_slot_key_idx"
                    ),
                    models.Index(
                        fields=["flow", "task_id"], name="celery_outbox_slot_task_idx"
                    ),
                ],
            },
        ),
    ]
