"""The inbox on every database: a task's effects commit once per message key.

Deliveries are simulated with ``task.apply(task_id=...)``, which runs the task through
Celery's tracer exactly as a worker does, in this process.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import states
from django.core import checks
from django.db import connections, transaction

from celery_outbox.exceptions import OutboxValueError
from celery_outbox.inbox import signals
from celery_outbox.inbox.models import InboxEntry
from celery_outbox.inbox.store import InboxStore
from celery_outbox.inbox.tasks import purge
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import (
    DUPLICATE_TASK_NAME,
    add,
    inbox_flaky,
    inbox_record,
    inbox_slow,
    record,
    record_on,
)

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture
def on(alias: str, settings: Any) -> str:
    """Put the inbox on ``alias``; returns it."""
    settings.CELERY_OUTBOX_INBOX_DATABASE = alias
    return alias


@pytest.fixture
def skipped() -> Iterator[list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        calls.append(kwargs)

    signals.duplicate_skipped.connect(receiver)
    yield calls
    signals.duplicate_skipped.disconnect(receiver)


def effects(alias: str, tag: str) -> list[str]:
    """The values of the TaskRun rows the task bodies committed for ``tag``."""
    rows = TaskRun.objects.using(alias).filter(tag=tag).order_by("id")
    return list(rows.values_list("value", flat=True))


def deliver(task: Any, task_id: str, *args: Any, **options: Any) -> Any:
    return task.apply(args, task_id=task_id, **options)


def test_a_second_delivery_is_skipped(
    on: str, skipped: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    tag, task_id = f"twice-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    first = deliver(inbox_record, task_id, tag, 1, on)
    second = deliver(inbox_record, task_id, tag, 2, on)
    assert first.state == states.SUCCESS
    assert first.result == tag
    assert second.state == states.IGNORED
    assert effects(on, tag) == ["1"]
    assert skipped == [
        {
            "signal": signals.duplicate_skipped,
            "task_id": task_id,
            "task_name": "shop.inbox_record",
            "key": task_id,
            "using": on,
        }
    ]
    assert any("already ran" in r.getMessage() for r in caplog.records)
    assert InboxStore(on).seen("shop.inbox_record", task_id)


def test_a_body_that_raises_rolls_its_row_back(on: str) -> None:
    tag, task_id = f"raise-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    failed = deliver(inbox_record, task_id, tag, 0, "no-such-alias")
    assert failed.state == states.FAILURE
    assert not InboxStore(on).seen("shop.inbox_record", task_id)
    again = deliver(inbox_record, task_id, tag, 1, on)
    assert again.state == states.SUCCESS
    assert effects(on, tag) == ["1"]


def test_fails_twice_then_succeeds_writes_its_effects_once(
    settings: Any,
) -> None:
    settings.CELERY_OUTBOX_INBOX_DATABASE = "default"
    tag = f"flaky-{uuid.uuid4().hex[:8]}"
    result = inbox_flaky.apply((tag,))
    assert result.state == states.SUCCESS
    # Each failed run wrote a row too, rolled back with its inbox row: one run committed.
    assert effects("default", tag) == ["2"]


def test_a_callers_key_merges_two_messages(
    on: str, skipped: list[dict[str, Any]]
) -> None:
    tag, key = f"key-{uuid.uuid4().hex[:8]}", f"invoice:{uuid.uuid4().hex}"
    deliver(inbox_record, uuid.uuid4().hex, tag, 1, on, inbox_key=key)
    deliver(inbox_record, uuid.uuid4().hex, tag, 2, on, headers={"inbox_key": key})
    assert effects(on, tag) == ["1"]
    assert [call["key"] for call in skipped] == [key]


def test_a_key_is_refused_for_a_task_without_the_inbox() -> None:
    with pytest.raises(OutboxValueError, match="does not use the inbox"):
        record.apply_async(("x",), inbox_key="invoice:1")


def test_a_key_header_never_reaches_a_task_without_the_inbox() -> None:
    tag = f"plain-{uuid.uuid4().hex[:8]}"
    result = add.apply((1, 2), kwargs={"tag": tag}, headers={"inbox_key": "k", "a": 1})
    assert result.state == states.SUCCESS
    assert effects("default", tag) == ["3"]


def test_keys_the_table_cannot_hold_are_refused() -> None:
    with pytest.raises(OutboxValueError, match="at most 255"):
        inbox_record.apply_async(("x",), inbox_key="k" * 256)
    with pytest.raises(OutboxValueError, match="non-empty string"):
        inbox_record.apply_async(("x",), inbox_key="")


def test_the_setting_puts_every_task_through_the_inbox(
    settings: Any, skipped: list[dict[str, Any]]
) -> None:
    settings.CELERY_OUTBOX_INBOX = True
    settings.CELERY_OUTBOX_INBOX_DATABASE = "default"
    tag, task_id = f"all-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    deliver(record, task_id, tag)
    deliver(record, task_id, tag)
    assert len(effects("default", tag)) == 1
    assert len(skipped) == 1


def test_tasks_without_the_inbox_run_every_delivery() -> None:
    tag, task_id = f"plain-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    deliver(record, task_id, tag)
    deliver(record, task_id, tag)
    assert len(effects("default", tag)) == 2
    assert not InboxEntry.objects.filter(key=task_id).exists()


def test_a_direct_call_runs_the_body_without_the_inbox() -> None:
    tag = f"direct-{uuid.uuid4().hex[:8]}"
    assert inbox_record(tag) == tag
    assert inbox_record(tag) == tag
    assert len(effects("default", tag)) == 2


def test_a_duplicate_inside_an_outer_transaction_leaves_it_usable(on: str) -> None:
    tag, task_id = f"outer-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    deliver(inbox_record, task_id, tag, 1, on)
    with transaction.atomic(using=on):
        assert deliver(inbox_record, task_id, tag, 2, on).state == states.IGNORED
        TaskRun.objects.using(on).create(task_id=task_id, task_name="t", tag=tag)
    assert effects(on, tag) == ["1", ""]


def test_concurrent_deliveries_run_the_body_once(on: str) -> None:
    """Two threads (two connections) get one message; one waits, then skips."""
    tag, task_id = f"race-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    states_seen: list[str] = []
    errors: list[BaseException] = []

    def worker(delay: float) -> None:
        time.sleep(delay)
        try:
            states_seen.append(deliver(inbox_slow, task_id, tag, 1.0, on).state)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(d,)) for d in (0.0, 0.3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert sorted(states_seen) == [states.IGNORED, states.SUCCESS]
    assert len(effects(on, tag)) == 1
    skips = TaskRun.objects.using(on).filter(
        task_name=DUPLICATE_TASK_NAME, task_id=task_id
    )
    assert skips.count() == 1


def test_purge_deletes_rows_older_than_the_retention(on: str, settings: Any) -> None:
    settings.CELERY_OUTBOX_INBOX_RETENTION = "1h"
    store = InboxStore(on)
    for n in range(5):
        store.record("t", f"old-{n}")
    store.record("t", "new")
    hours_ago = InboxEntry.objects.using(on).filter(key__startswith="old-")
    from datetime import timedelta

    from django.utils import timezone

    hours_ago.update(created_at=timezone.now() - timedelta(hours=2))
    assert purge.apply(kwargs={"chunk": 2}).result == {
        "deleted": 5,
        "retention_seconds": 3600.0,
    }
    keys = InboxEntry.objects.using(on).values_list("key", flat=True)
    assert list(keys) == ["new"]


def test_the_check_warns_when_retention_is_shorter_than_redeliveries(
    settings: Any,
) -> None:
    settings.CELERY_OUTBOX_INBOX_RETENTION = "10m"
    found = [m for m in checks.run_checks() if m.id == "celery_outbox_inbox.W001"]
    assert len(found) == 1
    assert "shorter than" in found[0].msg
    settings.CELERY_OUTBOX_INBOX_RETENTION = "7d"
    assert not [
        m for m in checks.run_checks() if m.id.startswith("celery_outbox_inbox")
    ]


def test_the_inbox_adds_one_statement_to_the_task(on: str) -> None:
    """The cost target: the INSERT of the inbox row is the only extra statement.

    Compared with the same body in a transaction of its own: the inbox's transaction
    takes its place.
    """
    from django.test.utils import CaptureQueriesContext

    def statements(task: Any) -> list[str]:
        with CaptureQueriesContext(connections[on]) as captured:
            task.apply((f"cost-{uuid.uuid4().hex[:8]}", 0, on))
        return [query["sql"] for query in captured.captured_queries]

    plain, inbox = statements(record_on), statements(inbox_record)
    assert len(inbox) == len(plain) + 1
    extra = [sql for sql in inbox if "celery_outbox_inbox" in sql]
    assert len(extra) == 1
    assert extra[0].lstrip().upper().startswith("INSERT")
