"""Scheduled tasks: an ETA beyond CELERY_OUTBOX_SCHEDULE_AFTER waits in the outbox.

Through the real OutboxCelery app on every database: the row is written with its ETA
(``available_at`` and ``due_at``, database clock), no claim takes it before then, the
operator views tell it apart, and a task that expires before its ETA is a dead letter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from io import StringIO
from pathlib import Path

import pytest
from celery import chord
from django.core.management import call_command
from django.db import connections, transaction
from django.test import override_settings
from kombu import Connection, Queue

from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.store import Stores
from celery_outbox.testing import OutboxFixture
from tests.project.celery_app import app
from tests.project.shop.tasks import collect, errback, record

from ..conftest import BROKER_AMQP
from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

HOUR = 3600.0
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def on_alias(alias: str) -> Iterator[str]:
    """The outbox on each database in turn, scheduling ETAs over 60 s away."""
    with override_settings(
        CELERY_OUTBOX_DATABASE=alias, CELERY_OUTBOX_SCHEDULE_AFTER=60
    ):
        yield alias


def rows(alias: str) -> list[OutboxMessage]:
    return list(OutboxMessage.objects.using(alias).order_by("id"))


def seconds_from_now(alias: str, moment: datetime) -> float:
    """``moment`` minus the database's clock now, in seconds."""
    with connections[alias].cursor() as cursor:
        now = Stores(alias).relay().dialect.now()
        cursor.execute(f"SELECT {now}", [])
        (db_now,) = cursor.fetchone()
    if isinstance(db_now, str):  # SQLite's strftime
        db_now = datetime.fromisoformat(db_now)
    if db_now.tzinfo is None:
        db_now = db_now.replace(tzinfo=timezone.utc)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return float((moment - db_now).total_seconds())


def test_a_far_countdown_waits_in_the_outbox_until_its_eta(on_alias: str) -> None:
    store = Stores(on_alias).relay()
    with transaction.atomic(using=on_alias):
        result = record.apply_async(("later",), countdown=HOUR)
    (row,) = rows(on_alias)
    assert row.task_id == result.id
    assert row.due_at is not None and row.due_at == row.available_at
    assert HOUR - 5 < seconds_from_now(on_alias, row.due_at) <= HOUR
    # The message is Celery's, eta header included: a worker runs it once received.
    eta = datetime.fromisoformat(json.loads(row.headers)["eta"])
    assert HOUR - 5 < (eta - datetime.now(timezone.utc)).total_seconds() <= HOUR
    assert store.claim(10, 30).messages == ()
    due = store.seconds_until_due()
    assert due is not None and HOUR - 5 < due <= HOUR


def test_an_eta_within_the_threshold_is_written_as_before(on_alias: str) -> None:
    with transaction.atomic(using=on_alias):
        soon = record.apply_async(("soon",), countdown=30)
        plain = record.delay("plain")
    assert [(r.task_id, r.due_at) for r in rows(on_alias)] == [
        (soon.id, None),
        (plain.id, None),
    ]
    claimed = Stores(on_alias).relay().claim(10, 30).messages
    assert [m.envelope.task_id for m in claimed] == [soon.id, plain.id]


def test_the_setting_none_publishes_every_eta_at_once(alias: str) -> None:
    with override_settings(
        CELERY_OUTBOX_DATABASE=alias, CELERY_OUTBOX_SCHEDULE_AFTER=None
    ):
        with transaction.atomic(using=alias):
            result = record.apply_async(("later",), countdown=HOUR)
        (row,) = rows(alias)
        assert row.due_at is None
        claimed = Stores(alias).relay().claim(10, 30).messages
        assert [m.envelope.task_id for m in claimed] == [result.id]


def test_an_absolute_eta_and_a_rollback(on_alias: str) -> None:
    eta = datetime.now(timezone.utc) + timedelta(hours=2)
    with pytest.raises(RuntimeError), transaction.atomic(using=on_alias):
        record.apply_async(("never",), eta=eta)
        raise RuntimeError("rollback")
    assert rows(on_alias) == []
    with transaction.atomic(using=on_alias):
        record.apply_async(("later",), eta=eta)
    (row,) = rows(on_alias)
    assert row.due_at is not None
    assert abs(seconds_from_now(on_alias, row.due_at) - 2 * HOUR) < 5


def test_a_scheduled_row_is_claimed_once_due_and_its_age_counts_from_its_eta(
    alias: str,
) -> None:
    with override_settings(
        CELERY_OUTBOX_DATABASE=alias, CELERY_OUTBOX_SCHEDULE_AFTER=0.5
    ):
        with transaction.atomic(using=alias):
            result = record.apply_async(("soon",), countdown=1.5)
        store = Stores(alias).relay()
        assert store.claim(10, 30).messages == ()
        time.sleep(max(0.0, (store.seconds_until_due() or 0.0)) + 0.05)
        (message,) = store.claim(10, 30).messages
    assert message.envelope.task_id == result.id
    assert message.age_seconds is not None and message.age_seconds < 1.0


#: How long the tests of a long transaction keep it open, before and after the call.
HELD_OPEN = 1.5


def begin(alias: str) -> None:
    """Start the transaction now (PostgreSQL's now() is its start from here on)."""
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT 1", [])
        cursor.fetchall()


def test_a_row_written_late_in_a_long_transaction_is_due_at_its_eta(
    on_alias: str,
) -> None:
    """Due at the ETA the worker reads, not earlier by the transaction's age.

    On PostgreSQL the row is written at the call, 1.5 s into the transaction; through
    the write-on-commit engine at the COMMIT, 1.5 s after the call.
    """
    with transaction.atomic(using=on_alias):
        begin(on_alias)
        time.sleep(HELD_OPEN)
        result = record.apply_async(("late",), countdown=HOUR)
        time.sleep(HELD_OPEN)
    (row,) = rows(on_alias)
    assert row.task_id == result.id and row.due_at == row.available_at
    eta = datetime.fromisoformat(json.loads(row.headers)["eta"])
    worker_wait = (eta - datetime.now(timezone.utc)).total_seconds()
    assert row.due_at is not None
    assert seconds_from_now(on_alias, row.due_at) == pytest.approx(worker_wait, abs=0.5)


def test_a_dedup_window_counts_from_the_call_in_a_long_transaction(
    on_alias: str,
) -> None:
    """The same class: a key's window is a due time written in the caller's transaction."""
    key = f"window-{time.monotonic_ns()}"
    with transaction.atomic(using=on_alias):
        begin(on_alias)
        time.sleep(HELD_OPEN)
        record.apply_async(("held",), dedup_key=key, dedup_window=HOUR)
    with connections[on_alias].cursor() as cursor:
        cursor.execute(
            "SELECT held_until FROM celery_outbox_dedup_key WHERE dedup_key = %s", [key]
        )
        (held_until,) = cursor.fetchone()
    if isinstance(held_until, str):  # SQLite
        held_until = datetime.fromisoformat(held_until)
    assert seconds_from_now(on_alias, held_until) == pytest.approx(HOUR, abs=0.5)


def test_a_task_that_expires_before_its_eta_is_a_dead_letter(on_alias: str) -> None:
    with transaction.atomic(using=on_alias):
        doomed = record.apply_async(("doomed",), countdown=HOUR, expires=60)
        kept = record.apply_async(("kept",), countdown=HOUR, expires=2 * HOUR)
    assert [r.task_id for r in rows(on_alias)] == [kept.id]
    (dead,) = DeadLetter.objects.using(on_alias).all()
    assert dead.task_id == doomed.id
    assert dead.last_error.startswith("expired before due: the task expires at ")
    assert dead.attempts == 0


def test_an_expired_task_rolls_back_with_the_transaction(on_alias: str) -> None:
    with pytest.raises(RuntimeError), transaction.atomic(using=on_alias):
        doomed = record.apply_async(("doomed",), countdown=HOUR, expires=60)
        raise RuntimeError("rollback")
    assert not DeadLetter.objects.using(on_alias).exists()
    assert app.AsyncResult(doomed.id).state == "PENDING"


def test_a_chord_whose_header_expires_before_its_eta_fails_as_with_celery(
    on_alias: str,
) -> None:
    """A worker that received these would revoke them as expired, store REVOKED and
    return their part of the chord: so does their dead letter, once it commits."""
    tag = f"expired-{time.monotonic_ns()}"
    doomed = {"countdown": HOUR, "expires": 60}
    with transaction.atomic(using=on_alias):
        body = chord(
            [record.s(f"{tag}-a").set(**doomed), record.s(f"{tag}-b").set(**doomed)],
            collect.s(tag).on_error(errback.s()),
        ).apply_async()
        assert app.AsyncResult(body.id).state == "PENDING"
    members = [app.AsyncResult(member.id) for member in body.parent.results]
    assert [member.state for member in members] == ["REVOKED", "REVOKED"]
    assert str(members[0].result) == "expired"
    assert app.AsyncResult(body.id).state == "FAILURE"
    sent = OutboxFixture(alias=on_alias).filter(errback)
    assert [message.args for message in sent] == [(body.id,)]


def test_stats_tell_scheduled_rows_apart_and_leave_them_out_of_the_oldest_age(
    on_alias: str,
) -> None:
    stores = Stores(on_alias)
    store = stores.operator()
    with transaction.atomic(using=on_alias):
        record.apply_async(("in-an-hour",), countdown=HOUR)
        record.apply_async(("in-two",), countdown=2 * HOUR)
    stats = store.stats()
    assert (stats.pending, stats.due, stats.scheduled) == (2, 0, 2)
    assert stats.oldest_pending_seconds is None  # nothing is late
    assert stats.next_due_seconds is not None
    assert HOUR - 5 < stats.next_due_seconds <= HOUR
    with transaction.atomic(using=on_alias):
        stores.writer().insert([envelope("now")])
    time.sleep(0.05)
    after = store.stats()
    assert (after.pending, after.due, after.scheduled) == (3, 1, 2)
    assert after.oldest_pending_seconds is not None
    assert after.oldest_pending_seconds < 30

    out = StringIO()
    call_command("outbox", "tasks", "stats", "--format", "json", stdout=out)
    data = json.loads(out.getvalue())
    assert (data["scheduled"], data["due"]) == (2, 1)
    assert HOUR - 5 < data["next_due_seconds"] <= HOUR
    out = StringIO()
    call_command("outbox", "tasks", "stats", stdout=out)
    assert "scheduled 2 (next due in " in out.getvalue()


def test_inspect_says_when_a_scheduled_task_is_due(on_alias: str) -> None:
    with transaction.atomic(using=on_alias):
        result = record.apply_async(("later",), countdown=HOUR)
    out = StringIO()
    call_command("outbox", "tasks", "inspect", result.id, stdout=out)
    text = out.getvalue()
    assert "state        scheduled" in text
    assert "due at" in text and "(its ETA)" in text
    out = StringIO()
    call_command(
        "outbox", "tasks", "inspect", result.id, "--format", "json", stdout=out
    )
    data = json.loads(out.getvalue())
    assert data["state"] == "scheduled"
    assert data["outbox"][0]["due_at"] is not None


def test_a_beat_entry_with_a_countdown_is_scheduled(on_alias: str) -> None:
    """Beat sends through its own kombu producer: the call still becomes a row."""
    from celery.beat import ScheduleEntry, Scheduler

    from tests.project.celery_app import app

    scheduler = Scheduler(app, lazy=True)
    entry = ScheduleEntry(
        name="reminder",
        task="shop.record",
        args=("from-beat",),
        options={"countdown": HOUR},
        schedule=timedelta(days=1),
        app=app,
    )
    try:
        scheduler.apply_async(entry, producer=scheduler.producer, advance=False)
    finally:
        scheduler.close()
    (row,) = rows(on_alias)
    assert "from-beat" in row.arguments_preview
    assert row.due_at is not None
    assert HOUR - 5 < seconds_from_now(on_alias, row.due_at) <= HOUR


def fill_scheduled(alias: str, rows: int) -> None:
    """``rows`` scheduled rows, due in a day, written in one statement."""
    with transaction.atomic(using=alias):
        Stores(alias).writer().insert(
            [envelope(f"s{n}", due_in=86400.0 + n) for n in range(rows)]
        )
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "ANALYZE celery_outbox_message"
            if alias != "mysql"
            else "ANALYZE TABLE celery_outbox_message",
            [],
        )
        if alias == "mysql":
            cursor.fetchall()


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_postgresql_reads_one_index_entry_to_know_when_the_next_row_is_due() -> None:
    fill_scheduled("default", 20_000)
    store = Stores("default").relay()
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + store.dialect.next_due_sql(), []
        )
        plan = json.dumps(cursor.fetchone()[0])
    assert '"Index Name": "celery_outbox_due_idx"' in plan, plan
    assert '"Seq Scan"' not in plan, plan
    scans = [
        node for node in _nodes(json.loads(plan)[0]["Plan"]) if "Index Name" in node
    ]
    assert [node["Actual Rows"] for node in scans] == [1], plan
    assert 86_300 < (store.seconds_until_due() or 0) <= 86_400
    # And the claim, over the same 20,000 rows, finds nothing without reading them.
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + store.dialect.due_ids_sql(), [500]
        )
        claim_plan = json.dumps(cursor.fetchone()[0])
    assert '"Seq Scan"' not in claim_plan, claim_plan
    assert '"Rows Removed by Filter": 0' in claim_plan or (
        '"Rows Removed by Filter"' not in claim_plan
    ), claim_plan


@pytest.mark.django_db(databases=["mysql"], transaction=True)
def test_mariadb_reads_the_due_index_to_know_when_the_next_row_is_due() -> None:
    fill_scheduled("mysql", 20_000)
    store = Stores("mysql").relay()
    with connections["mysql"].cursor() as cursor:
        cursor.execute("ANALYZE FORMAT=JSON " + store.dialect.next_due_sql(), [])
        plan = str(cursor.fetchone()[0])
    # MIN over the index's leading column: one index lookup, no table read.
    assert '"message": "Select tables optimized away"' in plan, plan
    assert 86_300 < (store.seconds_until_due() or 0) <= 86_400


def _nodes(node: dict[str, object]) -> Iterator[dict[str, object]]:
    yield node
    for child in node.get("Plans", []):  # type: ignore[union-attr]
        yield from _nodes(child)  # type: ignore[arg-type]


SEND_LATER_FROM_A_WORKER = """
import sys
import django

django.setup()
from tests.project.shop.tasks import send_later

# Run as a worker runs it (apply() traces it as Celery's worker does).
result = send_later.apply(args=(sys.argv[1], 3600.0, sys.argv[2]))
print(result.state, result.result)
"""


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_with_the_outbox_database_down_a_workers_far_eta_goes_to_the_broker() -> None:
    """Celery needs only the broker to send a worker's retry or delayed call: with the
    outbox database down it is sent as Celery sends it, not lost (``Task.retry``
    rejects the message when the send fails)."""
    queue = f"later-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.project.settings",
        "PYTHONPATH": str(ROOT),
        # The outbox's database (PostgreSQL) at a port nothing listens on.
        "OUTBOX_TEST_DB": "postgresql",
        "OUTBOX_PG_PORT": "1",
        "OUTBOX_TEST_BROKER": BROKER_AMQP,
    }
    env.pop("OUTBOX_TEST_DB_NAME", None)
    try:
        done = subprocess.run(
            [sys.executable, "-c", SEND_LATER_FROM_A_WORKER, "later", queue],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.stdout.startswith("SUCCESS "), done.stdout + done.stderr
        child = done.stdout.split()[1]
        assert "the outbox database failed" in done.stderr
        with Connection(BROKER_AMQP, connect_timeout=5) as conn:
            message = Queue(queue)(conn.default_channel).get(no_ack=True)
    finally:
        with Connection(BROKER_AMQP, connect_timeout=5) as conn:
            Queue(queue)(conn.default_channel).delete()
    assert message is not None, "nothing reached the broker"
    assert message.headers["id"] == child
    eta = datetime.fromisoformat(message.headers["eta"])
    assert HOUR - 60 < (eta - datetime.now(timezone.utc)).total_seconds() <= HOUR
