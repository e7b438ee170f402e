"""The write-on-commit engine: outbox rows travel with the next statement or the COMMIT.

Everything runs on real PostgreSQL through ``celery_outbox.backends.postgresql``; the
statements the connection sent are read from Django's own query log.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import DatabaseError, connections, transaction
from django.test.utils import CaptureQueriesContext

from celery_outbox.backends import WriteOnCommitMixin
from celery_outbox.models import OutboxMessage
from tests.project.shop.models import Order
from tests.project.shop.tasks import add, record

ALIAS = "postgresql_commit"
INSERT = "INSERT INTO celery_outbox_message"

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


class Rollback(Exception):
    pass


@pytest.fixture(autouse=True)
def outbox_on_engine(settings: Any) -> None:
    settings.CELERY_OUTBOX_DATABASE = ALIAS


@pytest.fixture
def sent() -> Iterator[CaptureQueriesContext]:
    """The statements the engine's connection sends during the test."""
    with CaptureQueriesContext(connections[ALIAS]) as queries:
        yield queries


def task_ids() -> list[str]:
    return list(
        OutboxMessage.objects.using(ALIAS)
        .order_by("id")
        .values_list("task_id", flat=True)
    )


def inserts(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if INSERT in q["sql"]]


def test_the_alias_runs_the_engine() -> None:
    assert isinstance(connections[ALIAS], WriteOnCommitMixin)


def test_a_transactions_rows_are_written_by_its_commit_in_one_statement(
    sent: CaptureQueriesContext,
) -> None:
    with transaction.atomic(using=ALIAS):
        Order.objects.using(ALIAS).create(number="1")
        first = record.delay("first")
        second = add.delay(1, 2)
        assert inserts(sent) == [], "nothing is sent before the commit"

    assert task_ids() == [first.id, second.id]
    [statement] = inserts(sent)
    assert statement.endswith("; COMMIT")
    assert first.id in statement and second.id in statement
    assert not any(q["sql"] == "COMMIT" for q in sent.captured_queries)


def test_a_later_statement_in_the_transaction_sees_the_rows_once(
    sent: CaptureQueriesContext,
) -> None:
    with transaction.atomic(using=ALIAS):
        result = record.delay("seen")
        assert task_ids() == [result.id]
        Order.objects.using(ALIAS).create(number="after")

    assert task_ids() == [result.id]
    assert len(inserts(sent)) == 1


def test_a_rollback_sends_no_row(sent: CaptureQueriesContext) -> None:
    with pytest.raises(Rollback), transaction.atomic(using=ALIAS):
        Order.objects.using(ALIAS).create(number="1")
        record.delay("never")
        raise Rollback

    assert task_ids() == []
    assert Order.objects.using(ALIAS).count() == 0
    assert inserts(sent) == []


def test_a_rolled_back_savepoint_drops_only_the_tasks_sent_inside_it(
    sent: CaptureQueriesContext,
) -> None:
    with transaction.atomic(using=ALIAS):
        kept = record.delay("kept")
        with pytest.raises(Rollback), transaction.atomic(using=ALIAS):
            dropped = record.delay("dropped")
            raise Rollback
        also_kept = record.delay("also kept")

    assert task_ids() == [kept.id, also_kept.id]
    assert not any(dropped.id in statement for statement in inserts(sent))


def test_a_released_savepoint_keeps_its_tasks() -> None:
    with transaction.atomic(using=ALIAS):
        with transaction.atomic(using=ALIAS):
            inner = record.delay("inner")
        outer = record.delay("outer")

    assert task_ids() == [inner.id, outer.id]


def test_outside_a_transaction_the_row_is_written_at_once(
    settings: Any, sent: CaptureQueriesContext
) -> None:
    settings.CELERY_OUTBOX_OUTSIDE_TRANSACTION = "allow"
    result = record.delay("autocommit")
    [statement] = inserts(sent)  # sent by the call itself, not held
    assert result.id in statement and "COMMIT" not in statement
    assert task_ids() == [result.id]


@pytest.fixture
def refusing_trigger() -> Iterator[None]:
    """A trigger that makes the outbox INSERT fail for tasks whose argument is 'refuse'."""
    with connections[ALIAS].cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION test_refuse_outbox() RETURNS trigger AS $$ BEGIN "
            "IF NEW.arguments_preview LIKE '%refuse%' THEN "
            "RAISE EXCEPTION 'outbox row refused by the test trigger'; END IF; "
            "RETURN NEW; END $$ LANGUAGE plpgsql"
        )
        cursor.execute(
            "CREATE TRIGGER test_refuse_outbox BEFORE INSERT ON celery_outbox_message "
            "FOR EACH ROW EXECUTE FUNCTION test_refuse_outbox()"
        )
    try:
        yield
    finally:
        with connections[ALIAS].cursor() as cursor:
            cursor.execute("DROP TRIGGER test_refuse_outbox ON celery_outbox_message")
            cursor.execute("DROP FUNCTION test_refuse_outbox()")


@pytest.mark.usefixtures("refusing_trigger")
def test_an_insert_failing_at_commit_rolls_the_whole_transaction_back() -> None:
    with (
        pytest.raises(DatabaseError, match="refused by the test trigger"),
        transaction.atomic(using=ALIAS),
    ):
        Order.objects.using(ALIAS).create(number="lost with its task")
        record.delay("fine")
        record.delay("refuse")

    assert Order.objects.using(ALIAS).count() == 0
    assert task_ids() == []

    # The connection is usable again: the next transaction commits normally.
    with transaction.atomic(using=ALIAS):
        Order.objects.using(ALIAS).create(number="next")
        result = record.delay("next")
    assert task_ids() == [result.id]
    assert Order.objects.using(ALIAS).count() == 1
