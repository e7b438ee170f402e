"""Flow control per key (docs/flow.md): a slot per running task of a flow key, an
operator's limits per flow, and the key of the rows that wait for a slot.

``flow_key`` is NULL on every row but those parked for a slot of their key, so the
enqueue path never writes it. Its index holds those rows only (a partial index) on
PostgreSQL and SQLite: a task with no flow key adds no index entry. MySQL and
MariaDB have no partial index: there it is a plain index (an entry per row).
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models, router

INDEX = "celery_outbox_flowkey_idx"
TABLE = "celery_outbox_message"


def _allowed(apps: Any, schema_editor: Any) -> bool:
    model = apps.get_model("celery_outbox", "outboxmessage")
    return bool(router.allow_migrate_model(schema_editor.connection.alias, model))


def add_index(apps: Any, schema_editor: Any) -> None:
    if not _allowed(apps, schema_editor):
        return
    partial = schema_editor.connection.features.supports_partial_indexes
    where = " WHERE flow_key IS NOT NULL" if partial else ""
    schema_editor.execute(f"CREATE INDEX {INDEX} ON {TABLE} (flow_key, id){where}")


def drop_index(apps: Any, schema_editor: Any) -> None:
    if not _allowed(apps, schema_editor):
        return
    on = (
        ""
        if schema_editor.connection.features.supports_partial_indexes
        else f" ON {TABLE}"
    )
    schema_editor.execute(f"DROP INDEX {INDEX}{on}")


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
        # Not wrapped in a transaction of its own: MySQL cannot roll DDL back, and
        # PostgreSQL and SQLite run the whole migration in one.
        migrations.RunPython(add_index, drop_index, atomic=False),
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
