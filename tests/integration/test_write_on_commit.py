"""The write-on-commit engine: outbox rows travel with the next statement or the COMMIT.

Everything runs on real PostgreSQL through ``celery_outbox.backends.postgresql``; the
statements the connection sent are read from Django's own query log.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import DatabaseError, connections, transaction
from django.test.utils import CaptureQueriesContext

from celery_outbox.backends import WriteOnCommitMixin
from celery_outbox.models import OutboxMessage
from celery_outbox.store import Stores
from tests.project.shop.models import Order
from tests.project.shop.tasks import add, record

from .builders import envelope

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
    [statement] = inserts(sent)  # sent by the call itself, not buffered
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


def order_numbers() -> list[str]:
    return list(
        Order.objects.using(ALIAS).order_by("id").values_list("number", flat=True)
    )


@pytest.mark.usefixtures("refusing_trigger")
def test_a_refused_row_whose_error_was_caught_fails_the_commit() -> None:
    # The buffered row goes out before the inner block's SAVEPOINT, whose error the
    # caller catches as it would catch the optional write's own. PostgreSQL has
    # aborted the transaction: its COMMIT would roll back without a word.
    with (
        pytest.raises(DatabaseError, match="could not be written"),
        transaction.atomic(using=ALIAS),
    ):
        Order.objects.using(ALIAS).create(number="lost with its task")
        record.delay("refuse")
        try:
            with transaction.atomic(using=ALIAS):
                Order.objects.using(ALIAS).create(number="optional")
        except DatabaseError:
            pass
    assert order_numbers() == []
    assert task_ids() == []
    with transaction.atomic(using=ALIAS):  # the connection is fine again
        result = record.delay("next")
    assert task_ids() == [result.id]


@pytest.mark.usefixtures("refusing_trigger")
def test_a_refused_row_rolled_back_with_its_savepoint_lets_the_rest_commit() -> None:
    with transaction.atomic(using=ALIAS):
        Order.objects.using(ALIAS).create(number="kept")
        kept = record.delay("kept")
        try:
            with transaction.atomic(using=ALIAS):
                record.delay("refuse")
                # Sends the buffered row, refused: the block and its savepoint roll back.
                Order.objects.using(ALIAS).create(number="inner")
        except DatabaseError:
            pass
        after = record.delay("after")
    assert order_numbers() == ["kept"]
    assert task_ids() == [kept.id, after.id]


@pytest.mark.usefixtures("refusing_trigger")
def test_a_refused_row_rolled_back_to_a_savepoint_made_by_hand() -> None:
    with transaction.atomic(using=ALIAS):
        Order.objects.using(ALIAS).create(number="kept")
        # savepoint_create() from Django 6.1 on, where savepoint() is deprecated.
        create = getattr(transaction, "savepoint_create", transaction.savepoint)
        savepoint = create(using=ALIAS)
        record.delay("refuse")
        # A raw statement: a model's save() would make Django refuse the rest of
        # the block, whatever the savepoint.
        with (
            pytest.raises(DatabaseError, match="refused by the test trigger"),
            connections[ALIAS].cursor() as cursor,
        ):
            cursor.execute("SELECT 1")
        transaction.savepoint_rollback(savepoint, using=ALIAS)
        after = record.delay("after")
    assert order_numbers() == ["kept"]
    assert task_ids() == [after.id]


def test_a_task_sent_after_the_connection_closed_in_the_transaction_is_refused() -> (
    None
):
    # Django reconnects for the next statement after such a block, in autocommit: a
    # row buffered from inside it would be committed though its transaction never was.
    connection = connections[ALIAS]
    with pytest.raises(Rollback), transaction.atomic(using=ALIAS):
        Order.objects.using(ALIAS).create(number="closed under it")
        connection.close()
        with pytest.raises(DatabaseError):
            record.delay("after close")
        raise Rollback
    assert task_ids() == []
    assert Order.objects.using(ALIAS).count() == 0


def test_rows_held_when_autocommit_comes_back_unfinished_are_not_committed() -> None:
    # Manual transaction management: the block never commits. The stock engine
    # refuses to switch autocommit on over the open transaction; so must this one.
    connection = connections[ALIAS]
    connection.set_autocommit(False)
    try:
        with transaction.atomic(using=ALIAS, savepoint=False):
            record.delay("never committed")
        with pytest.raises(DatabaseError):
            connection.set_autocommit(True)
    finally:
        connection.rollback()
        connection.set_autocommit(True)
    assert task_ids() == []


def test_a_new_connection_starts_with_nothing_buffered() -> None:
    connection = connections[ALIAS]
    with pytest.raises(Rollback), transaction.atomic(using=ALIAS):
        record.delay("held")
        connection.outbox_row_buffer.add([], False)  # still buffering the one above
        assert connection.outbox_row_buffer
        connection.connection.close()  # the server side goes away under Django
        connection.connect()
        assert not connection.outbox_row_buffer
        raise Rollback
    assert task_ids() == []


def test_an_argument_with_a_lone_surrogate_is_written(settings: Any) -> None:
    # Celery's argsrepr keeps a lone surrogate (a file name that is not UTF-8, say);
    # the stored preview escapes it, and the message keeps it, as Celery sends it.
    name = "report-\udc80.csv"
    with transaction.atomic(using=ALIAS):
        Order.objects.using(ALIAS).create(number="with its task")
        result = record.delay(name)
    row = OutboxMessage.objects.using(ALIAS).get()
    assert row.task_id == result.id
    assert "\\udc80" in row.arguments_preview
    assert json.loads(row.body.tobytes() if hasattr(row.body, "tobytes") else row.body)[
        0
    ] == [name]
    assert connections[ALIAS].get_autocommit()


def test_rows_that_cannot_be_sent_at_commit_roll_the_transaction_back() -> None:
    # The checks at the call stop such a row; should one get past them, the commit
    # fails as a DatabaseError, so Django rolls back and the connection is clean.
    connection = connections[ALIAS]
    bad = envelope("bad", arguments_preview="args=('\udc80',)")
    with (
        pytest.raises(DatabaseError, match="could not be sent with the COMMIT"),
        transaction.atomic(using=ALIAS),
    ):
        Order.objects.using(ALIAS).create(number="lost with its task")
        connection.outbox_row_buffer.add([bad], False)
    assert connection.get_autocommit()
    assert Order.objects.using(ALIAS).count() == 0
    with transaction.atomic(using=ALIAS):
        result = record.delay("next")
    assert task_ids() == [result.id]


def test_thousands_of_buffered_rows_fit_under_server_side_binding() -> None:
    # 15 bound parameters a row would pass PostgreSQL's 65,535 after 4,369 rows.
    connection = connections[ALIAS]
    options = connection.settings_dict.setdefault("OPTIONS", {})
    connection.close()
    options["server_side_binding"] = True
    try:
        with transaction.atomic(using=ALIAS):
            Stores(ALIAS).writer().insert([envelope(f"t{i}") for i in range(4_400)])
            assert OutboxMessage.objects.using(ALIAS).count() == 4_400
    finally:
        connection.close()
        del options["server_side_binding"]
