"""Flow keys and flow names compare byte for byte on MySQL/MariaDB (see
:mod:`celery_outbox.collation`).

0010 and 0011 made these columns with the default collation, which folds case,
accents and trailing spaces: ``Tenant-A`` and ``tenant-a``, ``café`` and ``cafe``,
``t`` and ``t `` (and any two emoji, under ``utf8mb4_general_ci``) were one key of a
flow, whose report woke another key's row and whose slots the stats counted as
one; flows ``Partner`` and ``partner`` shared one row and one rate window. Rows
are kept. PostgreSQL and SQLite are left alone.
"""

from __future__ import annotations

from django.db import migrations

from celery_outbox.collation import ExactKeys


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0011_flow_keys"),
    ]

    operations = [
        ExactKeys("outboxmessage", ["flow_key"]),
        ExactKeys("flowstate", ["name"]),
        ExactKeys("flowrecord", ["flow"]),
        ExactKeys("flowslot", ["flow", "flow_key", "task_id"]),
    ]
