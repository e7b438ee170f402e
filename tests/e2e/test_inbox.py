"""End to end: real Celery workers receive the same message more than once.

Messages are published straight to RabbitMQ by a plain Celery app (as a broker
redelivery or a relay re-publish would deliver them), so the same task id arrives
twice. Inbox tasks commit their effect once; plain tasks run every copy.

The tests of one worker share a stack (each on task ids and tags of its own; the
relay idles in those that publish straight to the broker); the race between two
workers has a stack of its own.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from django.db import transaction
from kombu import Connection

from tests.e2e.conftest import BROKER_AMQP, Stack, StackSpec, on_stack, wait_until
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import DUPLICATE_TASK_NAME, inbox_record

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(240),
    pytest.mark.django_db(transaction=True),
]

E2EFactory = Callable[..., Stack]
RUN_TIMEOUT = 60.0
#: A threads worker of two and a relay.
ONE_WORKER = on_stack(StackSpec(concurrency=2))


@pytest.fixture
def plain(test_queue: str) -> Iterator[Callable[..., None]]:
    """``publish(name, args, task_id)``: one message straight to the broker."""
    app = Celery("inbox-e2e", broker=BROKER_AMQP, set_as_current=False)

    def publish(name: str, args: tuple[Any, ...], task_id: str) -> None:
        app.send_task(name, args, task_id=task_id, queue=test_queue)

    yield publish
    app.close()


def rows(tag: str) -> list[TaskRun]:
    return list(TaskRun.objects.filter(tag=tag).order_by("id"))


def skips(task_id: str) -> list[TaskRun]:
    return list(TaskRun.objects.filter(task_name=DUPLICATE_TASK_NAME, task_id=task_id))


def consumers(queue: str) -> int:
    """How many consumers RabbitMQ has on ``queue`` (0 while it does not exist)."""
    with Connection(BROKER_AMQP) as conn:
        channel = conn.channel()
        try:
            return int(channel.queue_declare(queue, passive=True).consumer_count)
        except conn.channel_errors:
            return 0
        finally:
            with contextlib.suppress(Exception):
                channel.close()


def wait_for(count: Callable[[], int], expected: int, what: str) -> None:
    wait_until(lambda: count() >= expected, RUN_TIMEOUT, what, lambda: f"{count()}")


@ONE_WORKER
def test_a_message_delivered_twice_runs_an_inbox_task_once(
    stack: Stack, plain: Callable[..., None]
) -> None:
    inbox_tag, plain_tag = (f"{n}-{uuid.uuid4().hex[:8]}" for n in ("inbox", "plain"))
    inbox_id, plain_id = uuid.uuid4().hex, uuid.uuid4().hex
    for _ in range(2):
        plain("shop.inbox_record", (inbox_tag,), inbox_id)
        plain("shop.record", (plain_tag,), plain_id)
    wait_for(lambda: len(skips(inbox_id)), 1, "the duplicate to be skipped")
    wait_for(lambda: len(rows(plain_tag)), 2, "the plain task to run twice")
    assert len(rows(inbox_tag)) == 1
    assert len(rows(plain_tag)) == 2  # without the inbox, the duplicate runs
    stack.assert_alive()


@ONE_WORKER
def test_a_callers_key_merges_two_messages_through_the_outbox(stack: Stack) -> None:
    tag, key = f"key-{uuid.uuid4().hex[:8]}", f"invoice:{uuid.uuid4().hex}"
    with transaction.atomic():
        first = inbox_record.apply_async((tag, 1), inbox_key=key)
    with transaction.atomic():
        second = inbox_record.apply_async((tag, 2), inbox_key=key)
    assert first.id != second.id
    wait_for(
        lambda: TaskRun.objects.filter(tag=f"skip:{key}").count(),
        1,
        "the second message to be skipped",
    )
    # Whichever message ran first wrote the one effect.
    assert len(rows(tag)) == 1


@ONE_WORKER
def test_a_task_failing_twice_writes_its_effect_once(
    stack: Stack, plain: Callable[..., None]
) -> None:
    tag = f"flaky-{uuid.uuid4().hex[:8]}"
    plain("shop.inbox_flaky", (tag,), uuid.uuid4().hex)
    wait_for(lambda: len(rows(tag)), 1, "the third run to commit")
    # The first two runs wrote a row each too, rolled back with their inbox rows.
    assert [run.value for run in rows(tag)] == ["2"]


def test_concurrent_deliveries_to_two_workers_run_the_body_once(
    e2e: E2EFactory, plain: Callable[..., None], test_queue: str
) -> None:
    stack = e2e("postgresql")
    workers = [stack.start_worker(concurrency=1) for _ in range(2)]
    wait_until(lambda: consumers(test_queue) >= 2, 60, "both workers to consume")
    tag, task_id = f"race-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    # The body holds its transaction for 3 s: the second copy, at the other worker,
    # waits on the inbox row's lock, then finds it committed and skips.
    plain("shop.inbox_slow", (tag, 3.0), task_id)
    plain("shop.inbox_slow", (tag, 3.0), task_id)
    wait_for(lambda: len(skips(task_id)), 1, "the second copy to be skipped")
    ran, skipped = rows(tag), skips(task_id)
    assert len(ran) == 1
    assert len(skipped) == 1
    assert ran[0].value != skipped[0].value, "both copies went to the same worker"
    for worker in workers:
        assert "ERROR" not in worker.output()
    stack.assert_alive()
