"""Publish-on-commit: the producing process publishes its rows right after commit."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.db import transaction
from kombu import Connection

from celery_outbox.models import OutboxMessage
from tests.project.shop.tasks import record

from ..conftest import BROKER_AMQP

pytestmark = pytest.mark.django_db(transaction=True)


def drain_queue(queue: str) -> list[str]:
    """Task ids of every message waiting in ``queue`` (consumed)."""
    ids = []
    with Connection(BROKER_AMQP) as conn:
        simple = conn.SimpleQueue(queue)
        try:
            while True:
                try:
                    message = simple.get(timeout=0.5)
                except simple.Empty:
                    break
                message.ack()
                ids.append(message.headers["id"])
        finally:
            simple.close()
    return ids


def test_rows_are_published_as_the_transaction_commits(
    settings: Any, test_queue: str
) -> None:
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = True
    drain_queue(test_queue)
    tag = uuid.uuid4().hex
    with transaction.atomic():
        sent = [record.delay(f"{tag}-{i}").id for i in range(3)]
        assert OutboxMessage.objects.count() == 3  # written, not published yet
    # on_commit ran synchronously at commit: published, confirmed and settled.
    assert OutboxMessage.objects.count() == 0
    assert sorted(drain_queue(test_queue)) == sorted(sent)


def test_a_rollback_publishes_nothing(settings: Any, test_queue: str) -> None:
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = True
    drain_queue(test_queue)
    with pytest.raises(RuntimeError), transaction.atomic():
        record.delay("never")
        raise RuntimeError("rollback")
    assert OutboxMessage.objects.count() == 0
    assert drain_queue(test_queue) == []


def test_without_the_setting_rows_wait_for_the_relay(test_queue: str) -> None:
    drain_queue(test_queue)
    with transaction.atomic():
        record.delay("later")
    assert OutboxMessage.objects.count() == 1
    assert drain_queue(test_queue) == []


def test_a_rolled_back_savepoint_leaves_the_rest_published_on_commit(
    settings: Any, test_queue: str
) -> None:
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = True
    drain_queue(test_queue)
    with transaction.atomic():
        with pytest.raises(RuntimeError), transaction.atomic():
            record.delay("rolled-back")
            raise RuntimeError("savepoint")
        kept = record.delay("kept").id
    assert OutboxMessage.objects.count() == 0
    assert drain_queue(test_queue) == [kept]


def test_a_rolled_back_call_of_a_decorated_view_does_not_stop_later_ones(
    settings: Any, test_queue: str
) -> None:
    # @transaction.atomic keeps one Atomic object for every call of the function.
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = True
    drain_queue(test_queue)

    @transaction.atomic
    def view(fail: bool) -> str:
        task_id = str(record.delay("view").id)
        if fail:
            raise RuntimeError("rollback")
        return task_id

    with pytest.raises(RuntimeError):
        view(True)
    sent = [view(False), view(False)]
    assert OutboxMessage.objects.count() == 0
    assert sorted(drain_queue(test_queue)) == sorted(sent)
