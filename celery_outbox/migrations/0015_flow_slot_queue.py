"""A flow slot names the broker queue its task went to (#44).

An unstarted slot past its lease stays while that queue still holds its task, so
``queued`` counts a task until a worker starts it, however long it waits. The
column is compared as a key (grouped and matched by the decisions), so it is exact
on MySQL/MariaDB like every other key. Slots taken before this migration have no
queue: past their lease they free, as before.
"""

from __future__ import annotations

from django.db import migrations, models

from celery_outbox.collation import ExactKeys


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0014_dedup_slots"),
    ]

    operations = [
        migrations.AddField(
            model_name="flowslot",
            name="queue",
            field=models.CharField(blank=True, default="", max_length=255),
        ),
        ExactKeys("flowslot", ["queue"]),
    ]
