"""Processor heartbeats, the holder of a shard's lease, and the newest-message index.

A processor killed with ``kill -9`` stops beating; another one ends the leases of
the shards it held within seconds (three heartbeat intervals), not after the lease.
The index finds the newest message of an object anywhere in its shard (coalescing).
"""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox_handlers", "0002_exact_keys"),
    ]

    operations = [
        migrations.CreateModel(
            name="HandlerProcessor",
            fields=[
                (
                    "id",
                    models.CharField(max_length=32, primary_key=True, serialize=False),
                ),
                ("name", models.CharField(max_length=255)),
                ("seen_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "handler processor",
                "db_table": "celery_outbox_handler_processor",
            },
        ),
        migrations.AddField(
            model_name="handlershard",
            name="holder",
            field=models.CharField(blank=True, max_length=32, null=True),
        ),
        migrations.AddIndex(
            model_name="handlermessage",
            index=models.Index(
                fields=["shard", "category", "object_id", "id"],
                name="co_handler_msg_object_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="handlershard",
            index=models.Index(fields=["holder"], name="co_handler_shard_holder_idx"),
        ),
    ]
