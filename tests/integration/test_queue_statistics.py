"""The claim stays fast when PostgreSQL's statistics say the outbox table is empty.

A queue table is vacuumed while nearly empty (the relay keeps up): VACUUM then
records a live row count near zero for a table of many pages, and until the next
ANALYZE the planner believes every scan returns one row. The million-message soak
(``bench/soak.py``, docs/benchmarks.md) met claims of 2.9 to 74 s there: the planner
looked each claimed id up through the ``(ordering_key, id)`` index, reading all of
it per row, or ran the whole selection once per row of the table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from django.db import connections, transaction

from celery_outbox.exceptions import OutboxDatabaseError
from celery_outbox.store import Stores

from .builders import envelope
from .test_big_tables import COLUMNS

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

TABLE = "celery_outbox_message"
#: Rows that churned through the table before the vacuum, and rows due after it.
CHURNED = 20_000
DUE = 3_000


@contextlib.contextmanager
def changed(statement: str, undo: str) -> Iterator[None]:
    """Run ``statement`` on the test's connection now, and ``undo`` afterwards."""
    with connections["default"].cursor() as cursor:
        cursor.execute(statement)
    try:
        yield
    finally:
        with connections["default"].cursor() as cursor:
            cursor.execute(undo)


@pytest.fixture
def statistics_held() -> Iterator[None]:
    """No autovacuum or autoanalyze on the table during the test (they would fix it)."""
    if connections["default"].vendor != "postgresql":
        pytest.skip("PostgreSQL's planner statistics")
    with changed(
        f"ALTER TABLE {TABLE} SET (autovacuum_enabled = false)",
        f"ALTER TABLE {TABLE} RESET (autovacuum_enabled)",
    ):
        yield


def vacuum_nearly_empty() -> None:
    """Churn rows through the table, then vacuum it with one live row at its end."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TABLE} ({COLUMNS}) SELECT 'gone-' || n, 'shop.record', "
            "'celery', '', 'celery', 1, '\\x00'::bytea, 'application/json', 'utf-8', "
            "'{}', '{}', '[]', '', 0, '', now(), now() + interval '1 day' "
            "FROM generate_series(1, %s) n",
            [CHURNED],
        )
        # The last row stays, so the vacuum cannot give the table's pages back.
        cursor.execute(f"DELETE FROM {TABLE} WHERE id < (SELECT max(id) FROM {TABLE})")
        cursor.execute(f"VACUUM ANALYZE {TABLE}")


def planner_rows() -> float:
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT reltuples FROM pg_class WHERE relname = %s", [TABLE])
        return float(cursor.fetchone()[0])


def test_a_claim_after_a_vacuum_of_a_nearly_empty_table_stays_fast(
    statistics_held: None,
) -> None:
    vacuum_nearly_empty()
    stores = Stores("default")
    with transaction.atomic():
        for start in range(0, DUE, 500):
            stores.writer().insert(
                [envelope(f"due-{i}") for i in range(start, start + 500)]
            )
    assert planner_rows() <= 1, "not the state this test is about"
    # The old claim ran for minutes on a bigger table: cancelled after 10 s.
    with changed("SET statement_timeout = '10s'", "RESET statement_timeout"):
        try:
            claim = stores.relay().claim(500, 30)
        except OutboxDatabaseError as exc:
            pytest.fail(f"claiming 500 rows took over 10 s: {exc}")
    assert len(claim.messages) == 500
    assert {m.envelope.task_id.split("-")[0] for m in claim.messages} == {"due"}
