"""The handler processor when its database goes away under a running receiver.

``tests/faults/test_database_restarts.py`` restarts the server (PostgreSQL and
MariaDB). Here, on PostgreSQL, the database refuses new connections and the server
ends the processor's connection while a receiver runs: what a restart does to the
processor, without stopping a server other test runs share.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import connections, transaction

from celery_outbox.handlers import emit
from celery_outbox.handlers.models import HandlerMessage, HandlerShard
from celery_outbox.handlers.processor import Processor, ProcessorConfig
from celery_outbox.handlers.registry import Category, Registry

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@contextlib.contextmanager
def maintenance(alias: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection to the server's ``postgres`` database, outside Django."""
    settings = connections[alias].settings_dict
    with psycopg.connect(
        host=settings["HOST"],
        port=settings["PORT"],
        user=settings["USER"],
        dbname="postgres",
        autocommit=True,
    ) as connection:
        yield connection


def allow_connections(alias: str, allowed: bool) -> None:
    """Let the test database take new connections, or refuse them."""
    name = connections[alias].settings_dict["NAME"]
    with maintenance(alias) as connection:
        connection.execute(
            f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {str(allowed).lower()}'
        )


def go_away(alias: str) -> None:
    """Refuse new connections, then have the server end this one."""
    allow_connections(alias, False)
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")


def test_a_shard_an_outage_interrupted_is_due_as_soon_as_the_database_is_back(
    alias: str,
) -> None:
    if connections[alias].vendor != "postgresql":
        pytest.skip("PostgreSQL only; the fault suite restarts MariaDB for this")
    name = f"test.{uuid.uuid4().hex[:8]}"
    ran: list[Any] = []

    def receive(*, payload: Any, **_: Any) -> None:
        if not ran:
            ran.append("database gone")
            go_away(alias)
        ran.append(payload)

    categories = Registry()
    categories.add(Category(name, receive, coalesce=False))
    with transaction.atomic(using=alias):
        emit(name, shard="a", object_id=1, payload="first", using=alias)
        emit(name, shard="a", object_id=2, payload="second", using=alias)
    # A lease far longer than the test: waiting it out would miss the deadline.
    config = ProcessorConfig(databases=(alias,), lease_seconds=300.0)
    processor = Processor(config, categories)
    try:
        # The pass breaks off; the processor logs it and closes its connection.
        assert processor.run_once() == 0
        assert ran == ["database gone"]
    finally:
        allow_connections(alias, True)
    shard = HandlerShard.objects.using(alias).get()
    assert shard.attempts == 0, "the outage was charged to the receiver"
    started = time.monotonic()
    assert processor.run_once() == 1
    assert time.monotonic() - started < 5
    assert ran == ["database gone", "first", "second"]
    assert not HandlerMessage.objects.using(alias).exists()
    assert not HandlerShard.objects.using(alias).exists()
