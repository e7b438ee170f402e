"""Every key means exactly what the caller wrote, on every database.

MySQL/MariaDB's default collations fold case, accents and trailing spaces: the
migrations give the key columns a binary collation there. The schema is held to it
as a whole: every text column of the package's tables is exact on MariaDB unless
``celery_outbox.collation.FREE_TEXT`` says why no query compares it. The other
tests write keys that differ only in one of those ways and expect them to stay
apart.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pytest
from celery import states
from django.apps import apps
from django.core.management import call_command
from django.db import connections, transaction
from django.utils import timezone

from celery_outbox.collation import FREE_TEXT, exact_collation
from celery_outbox.handlers import emit
from celery_outbox.handlers.registry import Category, registry
from celery_outbox.inbox.models import InboxEntry
from celery_outbox.models import DedupKey, FlowSlot
from celery_outbox.ordering.core import ordered_settlement
from celery_outbox.ordering_options import HEADER
from celery_outbox.outcomes import Settlement
from celery_outbox.store import Stores
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import inbox_record, record

from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

#: Three pairs of keys MySQL/MariaDB's default collations take for one.
KEYS = ["doc:A", "doc:a", "é", "e", "k1", "k1 "]
#: The tables and key columns the migrations make exact, per app.
KEY_COLUMNS = {
    "celery_outbox": {
        "celery_outbox_message": ["task_id", "ordering_key", "routing_key"],
        "celery_outbox_deadletter": ["task_id", "ordering_key", "routing_key"],
        "celery_outbox_history": ["task_id"],
        "celery_outbox_dedup_key": ["dedup_key", "task_id"],
    },
    "celery_outbox_inbox": {"celery_outbox_inbox": ["task_name", "key"]},
    "celery_outbox_handlers": {
        "celery_outbox_handler_message": ["category", "shard", "object_id"],
        "celery_outbox_handler_shard": ["shard", "held_by"],
        "celery_outbox_handler_deadletter": ["category", "shard", "object_id"],
        "celery_outbox_handler_pause": ["value"],
        "celery_outbox_handler_counter": ["category"],
    },
}
#: The migration before ours, per app.
BEFORE = {
    "celery_outbox": "0007",
    "celery_outbox_inbox": "0001",
    "celery_outbox_handlers": "0001",
}
#: Each app's exact-key migration: what comes after it (indexes of its own) is
#: undone before the round trip, so that the trip compares like with like.
EXACT = {
    "celery_outbox": "0008",
    "celery_outbox_inbox": "0002",
    "celery_outbox_handlers": "0002",
}
MYSQL = [alias for alias in connections if connections[alias].vendor == "mysql"]


def collations(alias: str) -> dict[tuple[str, str], str]:
    """The collation of every key column, by (table, column)."""
    wanted = [table for tables in KEY_COLUMNS.values() for table in tables]
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT TABLE_NAME, COLUMN_NAME, COLLATION_NAME FROM "
            "information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() "
            f"AND TABLE_NAME IN ({', '.join(['%s'] * len(wanted))})",
            wanted,
        )
        found = {(table, column): str(name) for table, column, name in cursor}
    return {
        (table, column): found[(table, column)]
        for tables in KEY_COLUMNS.values()
        for table, columns in tables.items()
        for column in columns
    }


def constraints(alias: str) -> dict[str, set[tuple[str, ...]]]:
    """Each key table's keys and indexes: (kind, columns...), kept by the migrations."""
    connection = connections[alias]
    found: dict[str, set[tuple[str, ...]]] = {}
    with connection.cursor() as cursor:
        for tables in KEY_COLUMNS.values():
            for table in tables:
                found[table] = {
                    (
                        "primary"
                        if info["primary_key"]
                        else "unique"
                        if info["unique"]
                        else "index",
                        *info["columns"],
                    )
                    for info in connection.introspection.get_constraints(
                        cursor, table
                    ).values()
                    if info["index"] or info["unique"] or info["primary_key"]
                }
    assert ("unique", "task_name", "key") in found["celery_outbox_inbox"]
    assert ("primary", "dedup_key") in found["celery_outbox_dedup_key"]
    return found


@pytest.fixture
def migrated_back_at_the_end(alias: str) -> Iterator[str]:
    yield alias
    for app in KEY_COLUMNS:
        call_command("migrate", app, database=alias, verbosity=0)


@pytest.mark.parametrize("alias", MYSQL)
def test_the_migrations_make_every_key_column_binary_and_go_back(
    migrated_back_at_the_end: str,
) -> None:
    alias = migrated_back_at_the_end
    for app, at in EXACT.items():
        call_command("migrate", app, at, database=alias, verbosity=0)
    exact = collations(alias)
    # NO PAD: MariaDB's utf8mb4_bin still takes "k1" and "k1 " for one value.
    assert set(exact.values()) == {"utf8mb4_nopad_bin"}, exact
    shape = constraints(alias)
    for app, before in BEFORE.items():
        call_command("migrate", app, before, database=alias, verbosity=0)
    folded = collations(alias)
    assert "utf8mb4_nopad_bin" not in set(folded.values()), folded
    assert constraints(alias) == shape
    for app, at in EXACT.items():
        call_command("migrate", app, at, database=alias, verbosity=0)
    assert collations(alias) == exact
    assert constraints(alias) == shape


def package_tables() -> dict[str, tuple[str, str]]:
    """Every table of the package (the ``celery_outbox`` app and its sub-apps, as
    Django's app registry has them): its app label and model name, by table."""
    return {
        model._meta.db_table: (config.label, model._meta.model_name or "")
        for config in apps.get_app_configs()
        if config.name == "celery_outbox" or config.name.startswith("celery_outbox.")
        for model in config.get_models()
        if model._meta.managed and not model._meta.proxy
    }


def free_text() -> set[tuple[str, str]]:
    """The columns :data:`~celery_outbox.collation.FREE_TEXT` lets fold, by (table, column)."""
    return {(table, column) for table, columns, _ in FREE_TEXT for column in columns}


def folding_columns(
    alias: str,
    tables: Mapping[str, tuple[str, str]],
    allowed: Iterable[tuple[str, str]],
) -> tuple[set[str], dict[tuple[str, str], str]]:
    """The tables found, and each text column of ``tables`` (any column with a
    collation) whose collation is not its character set's exact one and which
    ``allowed`` does not name, by (table, column): what is wrong and the fix."""
    connection = connections[alias]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT TABLE_NAME, COLUMN_NAME, CHARACTER_SET_NAME, COLLATION_NAME FROM "
            "information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND "
            f"TABLE_NAME IN ({', '.join(['%s'] * len(tables))})",
            list(tables),
        )
        rows = cursor.fetchall()
    exempt = set(allowed)
    exact: dict[str, str] = {}
    folding: dict[tuple[str, str], str] = {}
    for table, column, charset, collation in sorted(rows):
        if collation is None or (table, column) in exempt:
            continue
        if charset not in exact:
            exact[charset] = exact_collation(connection, charset)
        if collation != exact[charset]:
            app, model = tables[table]
            folding[(table, column)] = (
                f"{table}.{column} is {collation}, which folds case, accents or "
                f"trailing spaces: make it exact in a migration of {app} with "
                f"celery_outbox.collation.ExactKeys({model!r}, [{column!r}]) "
                f"(after any AlterField of it), or, if no query compares it, add it "
                f"to celery_outbox.collation.FREE_TEXT with the reason"
            )
    return {str(row[0]) for row in rows}, folding


@pytest.mark.parametrize("alias", MYSQL)
def test_every_text_column_of_the_package_is_exact_or_named_free_text(
    alias: str,
) -> None:
    call_command("migrate", database=alias, verbosity=0)
    tables = package_tables()
    # The registry's tables, not a list here: a new model is checked as it comes.
    assert {"celery_outbox_message", "celery_outbox_inbox"} <= set(tables)
    assert "celery_outbox_handler_shard" in tables
    found, folding = folding_columns(alias, tables, free_text())
    assert found == set(tables)
    assert folding == {}, "\n".join(folding.values())
    # Each exemption names a column that exists and folds: none is left stale.
    _, unexempted = folding_columns(alias, tables, ())
    assert free_text() - set(unexempted) == set()


@pytest.mark.parametrize("alias", MYSQL)
def test_the_rule_names_a_folding_column_and_its_fix(alias: str) -> None:
    table = f"celery_outbox_scratch_{uuid.uuid4().hex[:6]}"
    with connections[alias].cursor() as cursor:
        # MariaDB's utf8mb4_bin pads: "t" and "t " are one value even there.
        cursor.execute(
            "SELECT _utf8mb4't' COLLATE utf8mb4_bin = _utf8mb4't ', "
            "_utf8mb4't' COLLATE utf8mb4_nopad_bin = _utf8mb4't '"
        )
        assert cursor.fetchone() == (1, 0)
        cursor.execute(
            f"CREATE TABLE {table} (id INT PRIMARY KEY, "
            "folded VARCHAR(10) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci, "
            "padded VARCHAR(10) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin, "
            "exact VARCHAR(10) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin, "
            "note TEXT CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci)"
        )
    try:
        found, folding = folding_columns(
            alias, {table: ("celery_outbox", "scratch")}, {(table, "note")}
        )
    finally:
        with connections[alias].cursor() as cursor:
            cursor.execute(f"DROP TABLE {table}")
    assert found == {table}
    assert sorted(folding) == [(table, "folded"), (table, "padded")]
    assert folding[(table, "folded")] == (
        f"{table}.folded is utf8mb4_general_ci, which folds case, accents or "
        "trailing spaces: make it exact in a migration of celery_outbox with "
        "celery_outbox.collation.ExactKeys('scratch', ['folded']) (after any "
        "AlterField of it), or, if no query compares it, add it to "
        "celery_outbox.collation.FREE_TEXT with the reason"
    )


#: Each app's migration before the ones the schema's rule asked for (0012 and 0013
#: of the outbox, 0004 of the handlers).
BEFORE_THE_RULE = {"celery_outbox": "0011", "celery_outbox_handlers": "0003"}


@pytest.mark.parametrize("alias", MYSQL)
def test_the_rules_migrations_keep_the_rows_and_go_back(
    migrated_back_at_the_end: str,
) -> None:
    alias = migrated_back_at_the_end
    tables = package_tables()
    for app, at in BEFORE_THE_RULE.items():
        call_command("migrate", app, at, database=alias, verbosity=0)
    _, before = folding_columns(alias, tables, free_text())
    assert {
        ("celery_outbox_message", "flow_key"),
        ("celery_outbox_flow", "name"),
        ("celery_outbox_flow_record", "flow"),
        ("celery_outbox_flow_slot", "flow"),
        ("celery_outbox_flow_slot", "flow_key"),
        ("celery_outbox_flow_slot", "task_id"),
        ("celery_outbox_handler_shard", "holder"),
    } <= set(before)
    # The table as 0011 made it (the model has columns added since).
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "INSERT INTO celery_outbox_flow_slot (flow, flow_key, task_id, started, "
            "expires_at) VALUES (%s, %s, %s, %s, %s)",
            ["Partner", "Tenant-A ", "t1", False, timezone.now()],
        )
    for app in BEFORE_THE_RULE:
        call_command("migrate", app, database=alias, verbosity=0)
    assert folding_columns(alias, tables, free_text())[1] == {}
    rows = FlowSlot.objects.using(alias).values_list("flow", "flow_key", "task_id")
    assert list(rows) == [("Partner", "Tenant-A ", "t1")]
    # Exact now: another spelling finds nothing.
    assert not FlowSlot.objects.using(alias).filter(flow_key="tenant-a").exists()


def keyed(key: str, version: int) -> Any:
    """A coalescing message of ``key``; its task id ends with the key's index."""
    built = envelope(f"v{version}", ordering_key=key)
    return envelope(
        f"v{version}",
        task_id=f"{KEYS.index(key)}-v{version}-{uuid.uuid4().hex[:6]}",
        ordering_key=key,
        headers={**dict(built.headers), HEADER: "coalesce"},
    )


def test_distinct_coalescing_keys_publish_one_message_each(alias: str) -> None:
    stores = Stores(alias)
    store = stores.relay()
    with transaction.atomic(using=alias):
        stores.writer().insert(
            [keyed(key, version) for version in (1, 2) for key in KEYS]
        )
    published = []
    for _ in range(4):  # a coalesced head leaves its newest row to the next claim
        claim = store.claim(100, 30)
        published.extend(claim.messages)
        settlement = ordered_settlement(
            Settlement(delete=tuple(m.id for m in claim.messages)),
            claim.messages,
            300.0,
        )
        store.settle(claim.token, settlement)
    sent = sorted((m.envelope.ordering_key, m.envelope.task_id) for m in published)
    assert [key for key, _ in sent] == sorted(KEYS)
    # Each key's newest message, under the key it was written with.
    for key, task_id in sent:
        assert task_id.startswith(f"{KEYS.index(key)}-v2-")


def test_distinct_dedup_keys_write_one_row_each(alias: str, settings: Any) -> None:
    settings.CELERY_OUTBOX_DATABASE = alias
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False
    with transaction.atomic(using=alias):
        sent = [record.apply_async((key,), dedup_key=key).id for key in KEYS]
    assert len(set(sent)) == len(KEYS)
    rows = DedupKey.objects.using(alias).values_list("dedup_key", "task_id")
    assert sorted(rows) == sorted(zip(KEYS, sent, strict=True))


def test_distinct_inbox_keys_commit_one_body_each(alias: str, settings: Any) -> None:
    settings.CELERY_OUTBOX_INBOX_DATABASE = alias
    tag = f"keys-{uuid.uuid4().hex[:8]}"
    results = [
        inbox_record.apply((tag, key, alias), inbox_key=key, task_id=uuid.uuid4().hex)
        for key in KEYS
    ]
    assert [result.state for result in results] == [states.SUCCESS] * len(KEYS)
    bodies = (
        TaskRun.objects.using(alias).filter(tag=tag).values_list("value", flat=True)
    )
    assert sorted(bodies) == sorted(repr(key) for key in KEYS)
    keys = InboxEntry.objects.using(alias).filter(task_name="shop.inbox_record")
    assert sorted(keys.values_list("key", flat=True)) == sorted(KEYS)


def test_shards_that_differ_in_case_or_accent_stay_apart(alias: str) -> None:
    name = f"test.{uuid.uuid4().hex[:8]}"
    received: list[tuple[str, Any]] = []
    registry.add(
        Category(name, lambda **kw: received.append((kw["shard"], kw["payload"])))
    )
    shards = ["org:É", "org:é", "org:e"]
    try:
        with transaction.atomic(using=alias):
            for shard in shards:
                emit(name, shard=shard, object_id=1, payload=shard, using=alias)
        call_command("outbox", "handlers", "run", "--until-empty", "--database", alias)
    finally:
        registry.remove(name)
    # Each receiver call got the shard as it was emitted, with its own message.
    assert sorted(received) == sorted((shard, shard) for shard in shards)
