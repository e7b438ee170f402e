"""Publish-on-commit: the producing process publishes its rows right after commit."""

from __future__ import annotations

import gc
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone
from kombu import Connection

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.conf import OutboxSettings
from celery_outbox.models import OutboxMessage
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.store import Stores
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


def relay_sends() -> list[str]:
    """The task ids a relay finds to publish, running until the outbox is empty."""
    publisher = InMemoryPublisher()
    config = RelayConfig.from_settings(OutboxSettings(), until_empty=True)
    Relay(Stores("default").relay(), publisher, config, observers=()).run()
    return [e.task_id for e in publisher.published]


@pytest.mark.parametrize("end", ["rollback", "commit"])
def test_a_manual_transaction_leaves_its_rows_to_the_relay(
    settings: Any, test_queue: str, end: str
) -> None:
    # transaction.set_autocommit(False) opens a transaction that is not atomic(), and
    # on_commit() cannot follow it: nothing may reach the broker from the call, before
    # or without its commit. The relay sends what was committed.
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = True
    settings.CELERY_OUTBOX_OUTSIDE_TRANSACTION = "allow"
    drain_queue(test_queue)
    transaction.set_autocommit(False)
    try:
        sent = record.delay(f"manual-{end}").id
        getattr(transaction, end)()
    finally:
        transaction.set_autocommit(True)
    assert drain_queue(test_queue) == []
    committed = [sent] if end == "commit" else []
    assert list(OutboxMessage.objects.values_list("task_id", flat=True)) == committed
    assert relay_sends() == committed


@pytest.fixture
def failing_settlement() -> Iterator[Callable[[], None]]:
    """Makes every DELETE of an outbox row fail (a database error at settlement).

    Calling the fixture's value ends the failure.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION outbox_test_refuse_delete() RETURNS trigger "
            "LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'database went away'; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER outbox_test_refuse_delete BEFORE DELETE ON "
            "celery_outbox_message FOR EACH ROW "
            "EXECUTE FUNCTION outbox_test_refuse_delete()"
        )

    def recover() -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER IF EXISTS outbox_test_refuse_delete "
                "ON celery_outbox_message"
            )

    try:
        yield recover
    finally:
        recover()
        with connection.cursor() as cursor:
            cursor.execute("DROP FUNCTION IF EXISTS outbox_test_refuse_delete()")


def test_a_settlement_lost_to_a_database_error_is_retried_at_the_next_commit(
    settings: Any, test_queue: str, failing_settlement: Callable[[], None]
) -> None:
    # The first row was published but its settlement failed: left leased, it would
    # go to the broker a second time once its lease ran out.
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = True
    drain_queue(test_queue)
    with transaction.atomic():
        first = record.delay("settle-fails").id
    assert drain_queue(test_queue) == [first]
    failing_settlement()  # the database is back
    with transaction.atomic():
        second = record.delay("settle-works").id
    assert drain_queue(test_queue) == [second]
    # As if the lease ran out: a relay must find nothing left to publish.
    OutboxMessage.objects.update(available_at=timezone.now() - timedelta(seconds=1))
    assert relay_sends() == []
    assert not OutboxMessage.objects.exists()


def open_files() -> int:
    """How many file descriptors this process holds."""
    return len(os.listdir("/proc/self/fd"))


def test_short_lived_threads_leave_no_open_files_behind(
    settings: Any, test_queue: str
) -> None:
    # A server that runs each request on a new thread (or greenlet) publishes from
    # each: what a thread opened for that must not outlive it.
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = True
    drain_queue(test_queue)
    sent: list[str] = []

    def request() -> None:
        try:
            with transaction.atomic():
                sent.append(record.apply_async(("thread",), ignore_result=True).id)
        finally:
            connections.close_all()

    def serve(requests: int) -> None:
        for _ in range(requests):
            thread = threading.Thread(target=request)
            thread.start()
            thread.join()
        gc.collect()

    serve(2)  # what the process opens once (imports, the first connections)
    before = open_files()
    serve(30)
    assert open_files() - before < 10
    assert sorted(drain_queue(test_queue)) == sorted(sent)
    assert not OutboxMessage.objects.exists()


def test_a_forked_child_publishes_without_disturbing_its_parent(
    settings: Any, test_queue: str
) -> None:
    # A process that published on commit, then forked (a pre-fork server, a
    # multiprocessing pool): parent and child must not share one broker channel.
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = True
    drain_queue(test_queue)
    with transaction.atomic():
        sent = [record.apply_async(("parent",), ignore_result=True).id]
    connections.close_all()  # what a process does before it forks
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            with transaction.atomic():
                child = record.apply_async(("child",), ignore_result=True).id
            os.write(write, child.encode())
            connections.close_all()
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as from_child:
        sent.append(from_child.read())
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    with transaction.atomic():
        sent.append(record.apply_async(("parent-after",), ignore_result=True).id)
    assert not OutboxMessage.objects.exists(), "the parent's publish failed"
    assert sorted(drain_queue(test_queue)) == sorted(sent)
