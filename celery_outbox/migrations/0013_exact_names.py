"""Task names, queues, exchanges, lease tokens, relay ids and the package's state
words compare byte for byte on MySQL/MariaDB (see :mod:`celery_outbox.collation`).

The schema's rule (every text column exact unless named free text) found them with
the default collation: the stats grouped ``shop.Export`` and ``shop.export``, and
queues ``Mail`` and ``mail``, as one. The tokens, ids and states are the
package's own lowercase words, which no collation folds together; they follow the
rule all the same, so that it has no third kind of column. On MariaDB 10.11 a
column without an index changes collation in place (no table copy). Rows are kept;
PostgreSQL and SQLite are left alone.
"""

from __future__ import annotations

from django.db import migrations

from celery_outbox.collation import ExactKeys


class Migration(migrations.Migration):
    dependencies = [
        ("celery_outbox", "0012_exact_flow_keys"),
    ]

    operations = [
        ExactKeys(
            "outboxmessage",
            ["task_name", "queue", "exchange", "lease_token", "holder", "state"],
        ),
        ExactKeys("deadletter", ["task_name", "queue", "exchange"]),
        ExactKeys("historyevent", ["task_name", "event", "relay_id"]),
        ExactKeys("relayheartbeat", ["id"]),
    ]
