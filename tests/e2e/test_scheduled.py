"""End to end: scheduled tasks and revoke before publish, with a real relay and workers.

* On Redis with a ``visibility_timeout`` shorter than the countdowns and two workers,
  tasks scheduled in the outbox each run once, on time; the same calls sent by stock
  Celery wait in the workers unacknowledged, are restored by kombu and run twice or
  more.
* A worker's ``retry(countdown=)`` beyond the threshold waits in the outbox too.
* Revoked tasks (inside the caller's transaction, after it, through
  ``app.control``) never run; the others run once.
"""

from __future__ import annotations

import ast
import datetime as dt
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from django.db import transaction

from celery_outbox.models import OutboxMessage
from tests.e2e.conftest import BROKER_AMQP, BROKER_REDIS, Stack, alias_for, wait_until
from tests.project.celery_app import app
from tests.project.shop.models import Order, TaskRun
from tests.project.shop.tasks import at_eta, record, retry_later

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(240),
    pytest.mark.django_db(transaction=True, databases=[alias_for("postgresql")]),
]

E2EFactory = Callable[..., Stack]

#: Redis's visibility timeout in these tests, and the countdowns, longer than it.
VISIBILITY = 2.0
COUNTDOWN = 7.0
#: The revoke test's countdown: room for its sends and revokes on a loaded machine
#: (a scheduled task must still be in the outbox when it is revoked).
REVOKE_COUNTDOWN = 15.0
#: ETAs further away than this are scheduled in the outbox.
SCHEDULE_AFTER = 3.0
#: After the last expected run: time for a duplicate to show.
GRACE = 3.0


def runs(prefix: str) -> Counter[str]:
    tags = TaskRun.objects.filter(tag__startswith=prefix)
    return Counter(tags.values_list("tag", flat=True))


def lateness(**which: Any) -> list[float]:
    """Seconds from each run's ETA (its message's ``eta`` header) to the run."""
    late = []
    for ran_at, value in TaskRun.objects.filter(**which).values_list("ran_at", "value"):
        eta = dt.datetime.fromisoformat(ast.literal_eval(value))
        late.append((ran_at - eta).total_seconds())
    return late


@pytest.fixture
def scheduling(settings: Any) -> Iterator[None]:
    settings.CELERY_OUTBOX_SCHEDULE_AFTER = SCHEDULE_AFTER
    yield


def stack_with(e2e: E2EFactory, broker: str, workers: int) -> Stack:
    stack = e2e("postgresql", broker)
    stack.env.update(
        OUTBOX_TEST_VISIBILITY_TIMEOUT=str(VISIBILITY),
        OUTBOX_TEST_SCHEDULE_AFTER=str(SCHEDULE_AFTER),
    )
    stack.start_relay()
    for _ in range(workers):
        stack.start_worker(pool="threads", concurrency=4)
    return stack


def stock_app(queue: str) -> Celery:
    """Stock Celery on the same Redis, queue and task names: it publishes at once."""
    stock = Celery("stock", set_as_current=False)
    stock.conf.update(broker_url=BROKER_REDIS, task_default_queue=queue)
    return stock


def test_scheduled_tasks_run_once_on_time_where_stock_celery_runs_them_again(
    e2e: E2EFactory, scheduling: None, test_queue: str
) -> None:
    stack = stack_with(e2e, BROKER_REDIS, workers=2)
    prefix = f"eta-{uuid.uuid4().hex[:8]}"
    outbox_tags = {f"{prefix}-outbox-{n}" for n in range(6)}
    stock_tags = {f"{prefix}-stock-{n}" for n in range(6)}

    stock = stock_app(test_queue)
    # Both workers consuming: a message must wait in one of them, not in the queue.
    wait_until(
        lambda: len(stock.control.ping(timeout=1.0)) == 2,
        60,
        "both workers to answer a ping",
    )
    with transaction.atomic():
        for tag in sorted(outbox_tags):
            at_eta.apply_async((tag,), countdown=COUNTDOWN)
    assert OutboxMessage.objects.filter(due_at__isnull=False).count() == 6
    try:
        for tag in sorted(stock_tags):
            stock.send_task("shop.at_eta", args=(tag,), countdown=COUNTDOWN)
    finally:
        stock.close()

    wait_until(
        lambda: (outbox_tags | stock_tags) <= set(runs(prefix)),
        COUNTDOWN + 30,
        "every task to run",
        lambda: f"ran: {sorted(runs(prefix))}",
    )
    time.sleep(GRACE)
    stack.assert_alive()
    counts = runs(prefix)
    assert {tag: counts[tag] for tag in outbox_tags} == dict.fromkeys(outbox_tags, 1)
    late = lateness(tag__startswith=f"{prefix}-outbox")
    assert all(-0.5 <= seconds <= 2.0 for seconds in late), late
    stock_runs = sum(counts[tag] for tag in stock_tags)
    assert stock_runs > len(stock_tags), (
        f"stock Celery ran {stock_runs} times for {len(stock_tags)} tasks"
    )


def test_a_workers_retry_with_a_far_countdown_waits_in_the_outbox(
    e2e: E2EFactory, scheduling: None
) -> None:
    stack = stack_with(e2e, BROKER_AMQP, workers=1)
    tag = f"retry-{uuid.uuid4().hex[:8]}"
    result = retry_later.delay(tag, COUNTDOWN)

    # The retry is a scheduled row of the same task id, written by the worker.
    wait_until(
        lambda: OutboxMessage.objects.filter(
            task_id=result.id, due_at__isnull=False
        ).exists(),
        30,
        "the worker's retry to be scheduled in the outbox",
    )
    wait_until(lambda: tag in runs(tag), COUNTDOWN + 30, "the retry to run")
    time.sleep(GRACE)
    stack.assert_alive()
    assert runs(tag) == Counter({f"{tag}-attempt-0": 1, f"{tag}-attempt-1": 1, tag: 1})
    (late,) = lateness(tag=tag)
    assert -0.5 <= late <= 2.0


def test_revoked_tasks_never_run_and_the_others_run_once(
    e2e: E2EFactory, scheduling: None
) -> None:
    stack = e2e("postgresql", BROKER_AMQP)
    stack.env.update(OUTBOX_TEST_SCHEDULE_AFTER=str(SCHEDULE_AFTER))
    prefix = f"revoke-{uuid.uuid4().hex[:8]}"

    def send(name: str, **options: Any) -> str:
        with transaction.atomic():
            return str(record.apply_async((f"{prefix}-{name}",), **options).id)

    # Before any relay runs: tasks due at once, still in the outbox.
    in_transaction = send("in-transaction")
    after = send("after")
    by_control = send("by-control")
    kept = send("kept")
    # Scheduled ones, revoked while a relay runs.
    later_revoked = send("later-revoked", countdown=REVOKE_COUNTDOWN)
    later_kept = send("later-kept", countdown=REVOKE_COUNTDOWN)

    with transaction.atomic():
        Order.objects.create(number=prefix)
        app.AsyncResult(in_transaction).revoke()
    app.AsyncResult(after).revoke()
    app.control.revoke(by_control)

    stack.start_relay()
    stack.start_worker(pool="threads", concurrency=4)
    app.control.revoke(later_revoked)

    expected = {f"{prefix}-kept", f"{prefix}-later-kept"}
    wait_until(
        lambda: expected <= set(runs(prefix)),
        REVOKE_COUNTDOWN + 30,
        "the kept tasks to run",
        lambda: f"ran: {sorted(runs(prefix))}",
    )
    time.sleep(GRACE)
    stack.assert_alive()
    assert runs(prefix) == Counter(dict.fromkeys(expected, 1))
    assert not OutboxMessage.objects.filter(
        task_id__in=[in_transaction, after, by_control, later_revoked, kept, later_kept]
    ).exists()
