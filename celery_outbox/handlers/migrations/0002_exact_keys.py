"""Shards, categories, object ids and pauses compare byte for byte on MySQL/MariaDB
(see :mod:`celery_outbox.collation`).

With the default collations, shards that differ in case, accents or trailing
spaces were one shard, and its receivers got another spelling than the one emitted.
"""

from __future__ import annotations

from django.db import migrations

from celery_outbox.collation import ExactKeys


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox_handlers", "0001_initial"),
    ]

    operations = [
        ExactKeys("handlermessage", ["category", "shard", "object_id"]),
        ExactKeys("handlershard", ["shard", "held_by"]),
        ExactKeys("handlerdeadletter", ["category", "shard", "object_id"]),
        ExactKeys("handlerpause", ["value"]),
        ExactKeys("handlercounter", ["category"]),
    ]
