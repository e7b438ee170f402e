"""Keys that refuse duplicate enqueues (``apply_async(..., dedup_key=...)``)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0004_relay_heartbeat"),
    ]

    operations = [
        migrations.CreateModel(
            name="DedupKey",
            fields=[
                (
                    "dedup_key",
                    models.CharField(max_length=255, primary_key=True, serialize=False),
                ),
                ("task_id", models.CharField(max_length=255)),
                ("held_until", models.DateTimeField()),
            ],
            options={
                "verbose_name": "deduplication key",
                "db_table": "celery_outbox_dedup_key",
            },
        ),
    ]
