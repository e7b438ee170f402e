"""Ordered keys: the state of a key's head, and the index that finds each head."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0005_dedup_key"),
    ]

    operations = [
        migrations.AddField(
            model_name="outboxmessage",
            name="state",
            field=models.CharField(blank=True, max_length=8, null=True),
        ),
        migrations.AddIndex(
            model_name="outboxmessage",
            index=models.Index(
                fields=["ordering_key", "id"], name="celery_outbox_key_idx"
            ),
        ),
    ]
