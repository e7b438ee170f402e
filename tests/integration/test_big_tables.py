"""Claiming stays an index range scan with a huge backlog waiting for retry and many dead letters."""

from __future__ import annotations

import pytest
from django.db import connections, transaction

from celery_outbox.store import Stores

from .builders import envelope

# Transactional: MariaDB commits implicitly on ANALYZE TABLE, so a rollback would not
# clean up; pytest-django truncates the tables after each test instead.
pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

COLUMNS = (
    "task_id, task_name, queue, exchange, routing_key, payload_version, body, content_type, "
    "content_encoding, headers, properties, declare_queues, arguments_preview, attempts, "
    "last_error, created_at, available_at"
)
DEAD_COLUMNS = COLUMNS.replace("available_at", "dead_at") + ", original_id"


def fill_postgresql(rows: int) -> None:
    with connections["default"].cursor() as cursor:
        cursor.execute(
            f"INSERT INTO celery_outbox_message ({COLUMNS}) SELECT 'retry-' || n, 'shop.record', "
            "'celery', '', 'celery', 1, '\\x00'::bytea, 'application/json', 'utf-8', '{}', '{}', "
            "'[]', '', 3, 'NotFound', now(), now() + interval '1 day' FROM generate_series(1, %s) n",
            [rows],
        )
        cursor.execute(
            f"INSERT INTO celery_outbox_deadletter ({DEAD_COLUMNS}) SELECT 'dead-' || n, "
            "'shop.record', 'celery', '', 'celery', 1, '\\x00'::bytea, 'application/json', "
            "'utf-8', '{}', '{}', '[]', '', 10, 'NotFound', now(), now(), n "
            "FROM generate_series(1, %s) n",
            [rows],
        )
        cursor.execute("ANALYZE celery_outbox_message")
        cursor.execute("ANALYZE celery_outbox_deadletter")


def fill_mysql(rows: int) -> None:
    with connections["mysql"].cursor() as cursor:
        cursor.execute(
            f"INSERT INTO celery_outbox_message ({COLUMNS}) SELECT CONCAT('retry-', seq), "
            "'shop.record', 'celery', '', 'celery', 1, X'00', 'application/json', 'utf-8', '{}', "
            "'{}', '[]', '', 3, 'NotFound', UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) + INTERVAL 1 DAY "
            f"FROM seq_1_to_{rows}"
        )
        cursor.execute("ANALYZE TABLE celery_outbox_message")
        cursor.fetchall()


def test_postgresql_claim_is_an_index_scan_over_a_million_waiting_rows() -> None:
    fill_postgresql(1_000_000)
    store = Stores("default").operator()
    with transaction.atomic():
        Stores("default").writer().insert([envelope(f"due-{i}") for i in range(10)])
    plan = store.explain_claim(500)
    assert '"Index Name": "celery_outbox_due_idx"' in plan, plan
    assert '"Node Type": "Seq Scan"' not in plan, plan
    assert '"Node Type": "Sort"' not in plan, plan  # the index gives the order
    claim = Stores("default").relay().claim(500, 30)
    assert (
        sorted(m.envelope.task_id.split("-")[0] for m in claim.messages) == ["due"] * 10
    )


def test_mariadb_claim_is_an_index_range_over_waiting_rows() -> None:
    fill_mysql(300_000)
    store = Stores("mysql").operator()
    with transaction.atomic(using="mysql"):
        Stores("mysql").writer().insert([envelope(f"due-{i}") for i in range(10)])
    plan = store.explain_claim(500)
    assert '"key": "celery_outbox_due_idx"' in plan, plan
    assert '"access_type": "range"' in plan, plan
    assert "filesort" not in plan, plan
    claim = Stores("mysql").relay().claim(500, 30)
    assert len(claim.messages) == 10


def test_sqlite_claim_uses_the_due_index() -> None:
    store = Stores("sqlite").operator()
    plan = store.explain_claim(500)
    assert "celery_outbox_due_idx" in plan, plan
    assert "USE TEMP B-TREE" not in plan, plan
