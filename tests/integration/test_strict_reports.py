"""A strict task's worker reports, through Celery's own tracer, on every database.

The tracer is what a worker runs for each message (``task_prerun``, the body,
``task_postrun``); here it runs in the test's process with the claimed message's
headers as the request, so the reports are the worker's own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from celery import shared_task
from celery.app.trace import build_tracer
from celery.signals import worker_process_shutdown
from django.db import connections, transaction

from celery_outbox.envelope import StoredMessage
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.ordering.core import ordered_settlement
from celery_outbox.ordering.options import Ordering
from celery_outbox.ordering.worker import wait_for_reports
from celery_outbox.outcomes import Settlement
from celery_outbox.store import RelayStore, Stores
from celery_outbox.store.notify import CHANNEL
from celery_outbox.text import REPLACEMENT
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import record

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


@shared_task(name="tests.strict.unstorable_failure")
def unstorable_failure(mode: str) -> str:
    """Fails, when ``mode`` is "fail", with a NUL in its text (PostgreSQL stores none)."""
    if mode == "fail":
        raise ValueError("nul\x00here")
    return mode


@pytest.fixture
def on_alias(alias: str, settings: Any) -> Iterator[str]:
    settings.CELERY_OUTBOX_DATABASE = alias
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False
    yield alias
    # As a worker process ends: the reporter thread ends and closes its connection
    # (the test database can then be dropped).
    worker_process_shutdown.send(sender=None, pid=os.getpid(), exitcode=0)


def publish_heads(store: RelayStore) -> tuple[StoredMessage, ...]:
    """Claim the due heads and settle them as the relay does once they are published."""
    claim = store.claim(10, 30)
    settlement = Settlement(delete=tuple(m.id for m in claim.messages))
    store.settle(claim.token, ordered_settlement(settlement, claim.messages, 300.0))
    return claim.messages


def run_on_worker(message: StoredMessage, task: Any) -> str:
    """Run a published message as a worker does; the state it ended in."""
    trace = build_tracer(task.name, task, store_errors=False, app=task.app)
    headers = dict(message.envelope.headers)
    args, kwargs, _ = task.app.backend.decode(message.envelope.body)
    request = {"id": headers["id"], "headers": headers, "delivery_info": {}}
    info = trace(headers["id"], args, kwargs, request).info  # None: it succeeded
    assert wait_for_reports(10.0)  # the process's reporter thread wrote them
    return "SUCCESS" if info is None else str(info.state)


def test_a_done_report_takes_its_own_row_not_another_with_the_task_id(
    on_alias: str,
) -> None:
    # Celery accepts a caller's task id; two strict rows may carry the same one.
    with transaction.atomic(using=on_alias):
        for tag in ("first", "second"):
            record.apply_async(
                (tag,), task_id="caller-id", ordering_key="K", ordering="strict"
            )
    store = Stores(on_alias).relay()
    (head,) = publish_heads(store)
    assert run_on_worker(head, record) == "SUCCESS"
    # The second row is still there, and is the key's next head.
    (following,) = publish_heads(store)
    assert following.id > head.id
    assert run_on_worker(following, record) == "SUCCESS"
    tags = TaskRun.objects.filter(task_id="caller-id").values_list("tag", flat=True)
    assert sorted(tags) == ["first", "second"]
    assert not OutboxMessage.objects.using(on_alias).exists()


@pytest.mark.parametrize("policy", ["block", "skip"])
def test_a_failure_whose_text_no_database_stores_still_applies_the_policy(
    on_alias: str, policy: str
) -> None:
    with transaction.atomic(using=on_alias):
        for mode in ("fail", "pass"):
            unstorable_failure.apply_async(
                (mode,), ordering_key="K", ordering="strict", ordering_policy=policy
            )
    stores = Stores(on_alias)
    store, ordering_store = stores.relay(), stores.ordering()
    (head,) = publish_heads(store)
    assert run_on_worker(head, unstorable_failure) == "FAILURE"
    expected = f"ValueError: nul{REPLACEMENT}here"
    if policy == "block":
        (blocked,) = ordering_store.blocked_heads()
        assert (blocked.id, blocked.last_error) == (head.id, expected)
        assert publish_heads(store) == ()  # the key waits for an operator
    else:
        dead = DeadLetter.objects.using(on_alias).get(original_id=head.id)
        assert (dead.last_error, dead.attempts) == (expected, 1)
        (following,) = publish_heads(store)  # the key went on
        assert following.id > head.id


def test_a_done_report_wakes_listening_relays_only_when_a_row_went(
    on_alias: str,
) -> None:
    connection = connections[on_alias]
    if connection.vendor != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    with transaction.atomic(using=on_alias):
        record.apply_async(("woken",), ordering_key="K", ordering="strict")
    stores = Stores(on_alias)
    store, ordering_store = stores.relay(), stores.ordering()
    (head,) = publish_heads(store)
    listener = connection.get_new_connection(connection.get_connection_params())
    try:
        listener.autocommit = True
        listener.execute(f"LISTEN {CHANNEL}")
        assert run_on_worker(head, record) == "SUCCESS"
        assert [n.channel for n in listener.notifies(timeout=2.0)] == [CHANNEL]
        # The same report again (a duplicate run): nothing went, nobody is woken.
        ordering = Ordering.read("K", head.envelope.headers)
        assert ordering_store.task_done(head.envelope.task_id, ordering.row_token) == 0
        assert list(listener.notifies(timeout=0.5)) == []
    finally:
        listener.close()


def test_a_retry_report_holds_its_own_row_not_another_with_the_task_id(
    on_alias: str,
) -> None:
    with transaction.atomic(using=on_alias):
        for key in ("K1", "K2"):
            record.apply_async(
                (key,), task_id="caller-id", ordering_key=key, ordering="strict"
            )
    stores = Stores(on_alias)
    store, ordering_store = stores.relay(), stores.ordering()
    first, second = publish_heads(store)  # two heads, each running for 300 s
    rows = OutboxMessage.objects.using(on_alias)
    before = rows.get(id=second.id).available_at
    token = Ordering.read("K1", first.envelope.headers).row_token
    assert ordering_store.task_retrying("caller-id", 3600.0, token) == 1
    assert rows.get(id=second.id).available_at == before
    assert rows.get(id=first.id).available_at > before
