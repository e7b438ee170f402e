"""The rows that writers of a new ``dedup_key`` lock on MySQL/MariaDB (#45).

They replace a named lock (``GET_LOCK``), whose waits InnoDB's deadlock detection
does not see. The table is not managed by Django, so that a test run's flush leaves
its rows; this migration creates it and writes its 4,096 rows (on every database, so
that the schema is one; only MySQL/MariaDB lock them).
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

#: celery_outbox.store.dialects.DEDUP_SLOTS when this migration was written.
SLOTS = 4096


def fill(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("celery_outbox", "DedupSlot")
    model.objects.using(schema_editor.connection.alias).bulk_create(
        [model(slot=slot) for slot in range(SLOTS)], batch_size=500
    )


def slot_table(*, managed: bool) -> migrations.CreateModel:
    """The table, unmanaged in the models' state, created in the database."""
    return migrations.CreateModel(
        name="DedupSlot",
        fields=[
            ("slot", models.PositiveIntegerField(primary_key=True, serialize=False)),
        ],
        options={
            "verbose_name": "deduplication slot",
            "db_table": "celery_outbox_dedup_slot",
            "managed": managed,
        },
    )


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0013_exact_names"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[slot_table(managed=False)],
            database_operations=[slot_table(managed=True)],
        ),
        # The rows go with the table (a reverse drops both).
        migrations.RunPython(
            fill, migrations.RunPython.noop, hints={"model_name": "dedupslot"}
        ),
    ]
