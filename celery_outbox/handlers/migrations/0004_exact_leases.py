"""Shard leases, processor ids and pause kinds compare byte for byte on MySQL/MariaDB
(see :mod:`celery_outbox.collation`).

0003 added the processors and the shards' ``holder`` with the default collation,
and 0002 had left the lease token and the pause kind to it: the package's own
lowercase words, which no collation folds together, made exact so that the
schema's rule (every text column exact unless named free text) holds without
exceptions. Rows are kept; PostgreSQL and SQLite are left alone.
"""

from __future__ import annotations

from django.db import migrations

from celery_outbox.collation import ExactKeys


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox_handlers", "0003_heartbeats"),
    ]

    operations = [
        ExactKeys("handlershard", ["lease_token", "holder"]),
        ExactKeys("handlerpause", ["kind"]),
        ExactKeys("handlerprocessor", ["id"]),
    ]
