"""Revoke before publish: revoke() of a task still in the outbox deletes its row.

On every database, through the real OutboxCelery app: ``AsyncResult.revoke()``,
``GroupResult.revoke()`` and ``app.control.revoke()`` delete the rows no relay holds,
inside the caller's transaction when there is one; the history records it and
``outbox tasks inspect`` says so; Celery's broadcast to the workers still goes out.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from io import StringIO

import pytest
from celery import group
from django.core.management import call_command
from django.db import transaction
from django.test import override_settings
from kombu import Connection, Queue

from celery_outbox.outcomes import Settlement
from celery_outbox.store import Stores
from celery_outbox.testing import OutboxFixture
from tests.project.celery_app import app
from tests.project.shop.tasks import record

from ..conftest import BROKER_AMQP

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


@pytest.fixture
def on_alias(alias: str) -> Iterator[str]:
    """The outbox on each database in turn, with the history on."""
    with override_settings(CELERY_OUTBOX_DATABASE=alias, CELERY_OUTBOX_HISTORY=True):
        yield alias


def waiting(alias: str) -> list[str]:
    return [message.task_id for message in OutboxFixture(alias=alias).messages]


def committed(alias: str, *tags: str, **options: object) -> list[str]:
    with transaction.atomic(using=alias):
        return [record.apply_async((tag,), **options).id for tag in tags]


def test_revoke_deletes_the_row_so_it_is_never_published(on_alias: str) -> None:
    revoked, kept = committed(on_alias, "revoked", "kept")
    app.AsyncResult(revoked).revoke()
    assert waiting(on_alias) == [kept]
    claimed = Stores(on_alias).relay().claim(10, 30).messages
    assert [m.envelope.task_id for m in claimed] == [kept]


def test_inside_atomic_the_deletion_commits_or_rolls_back_with_the_caller(
    on_alias: str,
) -> None:
    first, second = committed(on_alias, "first", "second")
    with pytest.raises(RuntimeError), transaction.atomic(using=on_alias):
        app.AsyncResult(first).revoke()
        assert waiting(on_alias) == [second]
        raise RuntimeError("rollback")
    assert waiting(on_alias) == [first, second]
    with transaction.atomic(using=on_alias):
        app.control.revoke(first)
    assert waiting(on_alias) == [second]


def test_a_task_sent_and_revoked_in_one_transaction_never_reaches_the_table(
    on_alias: str,
) -> None:
    with transaction.atomic(using=on_alias):
        result = record.delay("gone")
        result.revoke()
    assert waiting(on_alias) == []


def test_control_revoke_takes_a_list_and_group_results_revoke_their_members(
    on_alias: str,
) -> None:
    a, b, c = committed(on_alias, "a", "b", "c")
    app.control.revoke([a, b])
    assert waiting(on_alias) == [c]
    with transaction.atomic(using=on_alias):
        members = group(record.s(f"g{i}") for i in range(3)).apply_async()
    members.revoke()
    assert waiting(on_alias) == [c]


def test_scheduled_tasks_are_revoked_the_same_way(on_alias: str) -> None:
    (later,) = committed(on_alias, "later", countdown=3600)
    app.AsyncResult(later).revoke()
    assert waiting(on_alias) == []


def test_a_row_a_relay_holds_is_left_to_it(on_alias: str) -> None:
    (leased,) = committed(on_alias, "leased")
    store = Stores(on_alias).relay()
    claim = store.claim(10, 30)
    app.control.revoke(leased)
    assert waiting(on_alias) == [leased]
    report = store.settle(
        claim.token, Settlement(delete=tuple(m.id for m in claim.messages))
    )
    assert report.deleted == 1


def test_the_history_records_the_revoke_and_inspect_says_so(on_alias: str) -> None:
    (task_id,) = committed(on_alias, "revoked")
    app.AsyncResult(task_id).revoke()
    out = StringIO()
    call_command("outbox", "tasks", "inspect", task_id, stdout=out)
    text = out.getvalue()
    assert "state        revoked" in text
    assert "before it was published" in text
    out = StringIO()
    call_command("outbox", "tasks", "inspect", task_id, "--format", "json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["state"] == "revoked"
    assert [e["event"] for e in data["history"]] == ["revoked"]


def test_an_unknown_task_id_changes_nothing(on_alias: str) -> None:
    (kept,) = committed(on_alias, "kept")
    app.control.revoke(str(uuid.uuid4()))
    assert waiting(on_alias) == [kept]


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_the_broadcast_to_the_workers_still_goes_out() -> None:
    """What a worker's mailbox receives: Celery's own revoke command."""
    (task_id,) = committed("default", "revoked")
    exchange = app.control.mailbox.exchange  # the workers' fanout "celery.pidbox"
    with Connection(BROKER_AMQP, connect_timeout=5) as conn:
        queue = Queue(
            f"revoke-probe-{uuid.uuid4().hex[:8]}", exchange, auto_delete=True
        )
        bound = queue(conn.default_channel)
        bound.declare()
        try:
            app.control.revoke(task_id, terminate=True, signal="SIGKILL")
            message = None
            for _ in range(50):
                message = bound.get(no_ack=True)
                if message is not None:
                    break
                time.sleep(0.1)
            assert message is not None, "no broadcast reached the mailbox exchange"
            body = message.decode()
        finally:
            bound.delete()
    assert body["method"] == "revoke"
    assert body["arguments"]["task_id"] == task_id
    assert body["arguments"]["terminate"] is True
    assert body["arguments"]["signal"] == "SIGKILL"
    assert waiting("default") == []
