"""Where the benchmark's services live, read from the environment.

The driver sets ``OUTBOX_BENCH_RUN`` once; the relay and consumer subprocesses it
starts inherit it, so every process agrees on the queue name and the database.
"""

from __future__ import annotations

import os
import uuid

RUN_ID = os.environ.setdefault("OUTBOX_BENCH_RUN", uuid.uuid4().hex[:8])

AMQP_URL = os.environ.get("OUTBOX_BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672//")
REDIS_URL = os.environ.get("OUTBOX_BENCH_REDIS", "redis://127.0.0.1:6379/0")
#: The broker the bench app (and so the relay) publishes to: "amqp" or "redis".
BROKER = os.environ.get("OUTBOX_BENCH_BROKER", "amqp")

PG_NAME = os.environ.get("OUTBOX_BENCH_DB", "outbox_bench")
PG_USER = os.environ.get("OUTBOX_BENCH_PG_USER", "postgres")
PG_HOST = os.environ.get("OUTBOX_BENCH_PG_HOST", "127.0.0.1")
PG_PORT = os.environ.get("OUTBOX_BENCH_PG_PORT", "5432")

#: One queue (RabbitMQ) / list (Redis) per run, on an exchange of the same name.
QUEUE = os.environ.setdefault("OUTBOX_BENCH_QUEUE", f"celery-outbox-bench-{RUN_ID}")

TASK_NAME = "bench.noop"

#: Set in the strict part's relay: it records when it published each message
#: (:func:`bench.celery.record_publishes`).
PUBLISHED_ENV = "OUTBOX_BENCH_RECORD_PUBLISHED"


def broker_url(kind: str | None = None) -> str:
    """The URL of the ``amqp`` or ``redis`` broker."""
    kind = kind or BROKER
    if kind == "amqp":
        return AMQP_URL
    if kind == "redis":
        return REDIS_URL
    raise ValueError(f"unknown broker {kind!r}; expected 'amqp' or 'redis'")


def ensure_database(name: str = PG_NAME) -> None:
    """Create the benchmark database (PostgreSQL) when it does not exist yet."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(
        host=PG_HOST, port=PG_PORT, user=PG_USER, dbname="postgres", autocommit=True
    ) as conn:
        found = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", [name]
        ).fetchone()
        if found is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def setup_django() -> None:
    """Point Django at the bench settings and load it (no migrations)."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
