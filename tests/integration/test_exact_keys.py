"""Every key means exactly what the caller wrote, on every database.

MySQL/MariaDB's default collations fold case, accents and trailing spaces: the
migrations give the key columns a binary collation there. Each test writes keys that
differ only in one of those ways and expects them to stay apart.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import states
from django.core.management import call_command
from django.db import connections, transaction

from celery_outbox.handlers import emit
from celery_outbox.handlers.registry import Category, registry
from celery_outbox.inbox.models import InboxEntry
from celery_outbox.models import DedupKey
from celery_outbox.ordering.core import ordered_settlement
from celery_outbox.ordering.options import HEADER
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
