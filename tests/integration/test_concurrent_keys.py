"""Concurrent writers of one key: nobody sees an error, one of them wins.

Three transactions write one key at once and the first rolls back. On MariaDB the
two others used to wait for the first with shared locks and then deadlock (error
1213) when both went on to insert: one caller's enqueue failed, one inbox copy ended
FAILURE instead of being skipped. Each test runs several rounds with real threads
(one connection each) on MariaDB and PostgreSQL.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import states
from django.db import connections, transaction

from celery_outbox.models import OutboxMessage
from tests.project.celery_app import app
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import record

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

ROUNDS = 5
#: How long the first writer holds its key before it rolls back.
HOLD = 0.6


class FirstRollsBack(Exception):
    """Raised by the first writer to roll its transaction back."""


def race(
    first: Callable[[threading.Event], Any],
    others: list[Callable[[threading.Event], Any]],
    alias: str,
) -> tuple[list[Any], list[BaseException]]:
    """Run ``first``; once it says it holds its key (the event), the others; what
    they returned."""
    results: list[Any] = []
    errors: list[BaseException] = []
    started = threading.Event()
    lock = threading.Lock()

    def run(call: Callable[[threading.Event], Any], is_first: bool) -> None:
        try:
            if not is_first:
                assert started.wait(10)
            value = call(started)
            with lock:
                results.append(value)
        except FirstRollsBack:
            pass
        except BaseException as exc:
            with lock:
                errors.append(exc)
        finally:
            started.set()
            connections[alias].close()

    threads = [threading.Thread(target=run, args=(first, True))]
    threads += [threading.Thread(target=run, args=(call, False)) for call in others]
    threads[0].start()
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    return results, errors


@pytest.mark.parametrize("alias", ["mysql", "default"])
def test_three_writers_of_one_dedup_key_enqueue_one_task(
    alias: str, settings: Any
) -> None:
    settings.CELERY_OUTBOX_DATABASE = alias
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False
    for round_ in range(ROUNDS):
        key = f"race-{uuid.uuid4().hex[:8]}"

        def first(holds: threading.Event, key: str = key) -> None:
            with transaction.atomic(using=alias):
                record.apply_async(("first",), dedup_key=key, ignore_result=True)
                holds.set()
                time.sleep(HOLD)  # the others wait for the key meanwhile
                raise FirstRollsBack

        def other(holds: threading.Event, key: str = key) -> str:
            with transaction.atomic(using=alias):
                sent = record.apply_async(("other",), dedup_key=key, ignore_result=True)
            return str(sent.id)

        results, errors = race(first, [other, other], alias)
        assert errors == [], f"round {round_}: {errors!r}"
        rows = list(
            OutboxMessage.objects.using(alias).values_list("task_id", flat=True)
        )
        # One task written; both callers got its id.
        assert len(rows) == 1, f"round {round_}: {rows}"
        assert results == rows * 2, f"round {round_}"
        OutboxMessage.objects.using(alias).all().delete()


#: Copies of one message run by the inbox task below: the first (its tag here) says
#: it holds the inbox row, waits, then fails; the others record their run.
_failing: dict[str, threading.Event] = {}


@app.task(bind=True, name="shop.inbox_race", inbox=True, shared=False)
def inbox_race(self: Any, tag: str, using: str) -> str:
    holds = _failing.pop(tag, None)
    if holds is not None:
        holds.set()
        time.sleep(HOLD)  # the other copies wait for the inbox row meanwhile
        raise RuntimeError("the first copy fails")
    TaskRun.objects.using(using).create(
        task_id=self.request.id, task_name=self.name, tag=tag, value="ran"
    )
    return tag


@pytest.mark.parametrize("alias", ["mysql", "default"])
def test_three_copies_of_one_inbox_message_run_once_and_skip_once(
    alias: str, settings: Any
) -> None:
    settings.CELERY_OUTBOX_INBOX_DATABASE = alias
    for round_ in range(ROUNDS):
        tag, task_id = f"copies-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex

        def deliver_first(
            holds: threading.Event, tag: str = tag, id: str = task_id
        ) -> str:
            _failing[tag] = holds
            return str(inbox_race.apply((tag, alias), task_id=id).state)

        def deliver(holds: threading.Event, tag: str = tag, id: str = task_id) -> str:
            return str(inbox_race.apply((tag, alias), task_id=id).state)

        results, errors = race(deliver_first, [deliver, deliver], alias)
        assert errors == [], f"round {round_}: {errors!r}"
        assert sorted(results) == [states.FAILURE, states.IGNORED, states.SUCCESS], (
            f"round {round_}"
        )
        assert TaskRun.objects.using(alias).filter(tag=tag).count() == 1
