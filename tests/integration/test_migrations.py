"""The migrations build the tables the models describe, on every database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connections
from django.test import override_settings

from celery_outbox.models import DeadLetter, OutboxMessage

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

#: The aliases on PostgreSQL (its own engine and the write-on-commit one).
POSTGRESQL = [
    alias
    for alias, config in settings.DATABASES.items()
    if "postgresql" in config["ENGINE"]
]
TABLES = (
    (OutboxMessage._meta.db_table, "celery_outbox_task_idx"),
    (DeadLetter._meta.db_table, "celery_outbox_dead_task_idx"),
)


def task_id_indexes(alias: str, table: str) -> list[str]:
    """The names of the indexes whose only column is ``task_id``."""
    connection = connections[alias]
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, table)
    return sorted(
        name
        for name, info in constraints.items()
        if info["index"] and not info["primary_key"] and info["columns"] == ["task_id"]
    )


@pytest.fixture
def migrated_back_at_the_end(alias: str) -> Iterator[str]:
    yield alias
    # Through 0002 first: a test may have left 0003 recorded without its changes.
    call_command("migrate", "celery_outbox", "0002", database=alias, verbosity=0)
    call_command("migrate", "celery_outbox", database=alias, verbosity=0)


class KeepsTheOutboxElsewhere:
    """A router that decides by model: the outbox tables never migrate on ``alias``."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def allow_migrate(
        self, db: str, app_label: str, model_name: str | None = None, **hints: object
    ) -> bool | None:
        if db == self.alias and model_name in {"outboxmessage", "deadletter"}:
            return False
        return None


def test_the_migrations_match_the_models() -> None:
    # Exits with status 1 when a model change has no migration.
    call_command(
        "makemigrations", "celery_outbox", check=True, dry_run=True, verbosity=0
    )


def test_each_table_has_one_plain_task_id_index(alias: str) -> None:
    for table, name in TABLES:
        assert task_id_indexes(alias, table) == [name]


def test_the_task_id_index_migration_goes_both_ways(
    migrated_back_at_the_end: str,
) -> None:
    alias = migrated_back_at_the_end
    vendor = connections[alias].vendor
    call_command("migrate", "celery_outbox", "0002", database=alias, verbosity=0)
    for table, _ in TABLES:
        before = task_id_indexes(alias, table)
        # db_index's indexes again: on PostgreSQL the plain one and the LIKE one.
        assert len(before) == (2 if vendor == "postgresql" else 1), before
        assert [n.endswith("_like") for n in before].count(True) == (
            1 if vendor == "postgresql" else 0
        )
    call_command("migrate", "celery_outbox", "0003", database=alias, verbosity=0)
    for table, name in TABLES:
        assert task_id_indexes(alias, table) == [name]


def test_a_router_that_keeps_the_outbox_elsewhere_is_obeyed(
    migrated_back_at_the_end: str,
) -> None:
    alias = migrated_back_at_the_end
    call_command("migrate", "celery_outbox", "0002", database=alias, verbosity=0)
    before = {table: task_id_indexes(alias, table) for table, _ in TABLES}
    with override_settings(DATABASE_ROUTERS=[KeepsTheOutboxElsewhere(alias)]):
        # On a database without the tables this used to fail: nothing may be touched.
        call_command("migrate", "celery_outbox", "0003", database=alias, verbosity=0)
    assert {table: task_id_indexes(alias, table) for table, _ in TABLES} == before


@pytest.mark.parametrize("alias", POSTGRESQL)
def test_an_index_of_the_projects_own_on_task_id_is_left_alone(
    migrated_back_at_the_end: str,
) -> None:
    alias = migrated_back_at_the_end
    table = OutboxMessage._meta.db_table
    call_command("migrate", "celery_outbox", "0002", database=alias, verbosity=0)
    with connections[alias].cursor() as cursor:
        # Its name sorts before the ones Django gave its own indexes.
        cursor.execute(
            f"CREATE INDEX a_refunds_by_task ON {table} (task_id) "
            "WHERE task_name = 'shop.refund'"
        )
    try:
        call_command("migrate", "celery_outbox", "0003", database=alias, verbosity=0)
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s",
                [table],
            )
            definitions = dict(cursor.fetchall())
        names = task_id_indexes(alias, table)
    finally:
        with connections[alias].cursor() as cursor:
            cursor.execute("DROP INDEX IF EXISTS a_refunds_by_task")
    assert "WHERE" in definitions["a_refunds_by_task"]
    assert "WHERE" not in definitions["celery_outbox_task_idx"]
    assert names == ["a_refunds_by_task", "celery_outbox_task_idx"]


def flow_key_index(alias: str) -> list[str] | None:
    """The columns of the flow key's index on the outbox; None when it is missing."""
    connection = connections[alias]
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(
            cursor, OutboxMessage._meta.db_table
        )
    found = constraints.get("celery_outbox_flowkey_idx")
    return None if found is None else list(found["columns"])


@pytest.fixture
def at_the_last_migration_at_the_end(alias: str) -> Iterator[str]:
    yield alias
    call_command("migrate", "celery_outbox", database=alias, verbosity=0)


def test_the_flow_key_index_holds_parked_rows_only_where_it_can_and_goes_both_ways(
    at_the_last_migration_at_the_end: str,
) -> None:
    alias = at_the_last_migration_at_the_end
    connection = connections[alias]
    assert flow_key_index(alias) == ["flow_key", "id"]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT indexdef FROM pg_indexes WHERE indexname = %s",
                ["celery_outbox_flowkey_idx"],
            )
            (definition,) = cursor.fetchone()
        # A task with no flow key adds no entry to it.
        assert "WHERE (flow_key IS NOT NULL)" in definition
    call_command("migrate", "celery_outbox", "0010", database=alias, verbosity=0)
    assert flow_key_index(alias) is None
    call_command("migrate", "celery_outbox", "0011", database=alias, verbosity=0)
    assert flow_key_index(alias) == ["flow_key", "id"]
