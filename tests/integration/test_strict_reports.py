"""A strict task's worker reports, through Celery's own tracer, on every database.

The tracer is what a worker runs for each message (``task_prerun``, the body,
``task_postrun``); here it runs in the test's process with the claimed message's
headers as the request, so the reports are the worker's own.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterator
from typing import Any

import pytest
from celery import shared_task
from celery.app.task import Context
from celery.app.trace import build_tracer
from celery.exceptions import Reject, Retry, TimeLimitExceeded, WorkerLostError
from celery.signals import (
    task_failure,
    task_received,
    task_retry,
    task_revoked,
    task_unknown,
    worker_process_shutdown,
)
from celery.worker.request import Request
from django.db import connections, transaction
from kombu.message import Message

from celery_outbox.conf import get_settings
from celery_outbox.engine.reports import wait_for_reports
from celery_outbox.envelope import StoredMessage
from celery_outbox.flow.gate import FlowGate
from celery_outbox.models import DeadLetter, FlowSlot, OutboxMessage
from celery_outbox.ordering.core import ordered_settlement
from celery_outbox.ordering_options import Ordering
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


# -- every way a task ends, each settling its head (the worker's signals) ------------


@shared_task(name="tests.strict.rejects")
def rejects(requeue: bool) -> None:
    """Refuses its message, as a task may (``Reject``)."""
    raise Reject("refused", requeue=requeue)


def strict_pair(alias: str, task: Any, *args: Any, policy: str = "block") -> None:
    """``task(*args)`` and a ``record`` after it, strict, in key K."""
    with transaction.atomic(using=alias):
        task.apply_async(
            args, ordering_key="K", ordering="strict", ordering_policy=policy
        )
        record.apply_async(("next",), ordering_key="K", ordering="strict")


def delivered(message: StoredMessage, task: Any) -> Request:
    """The request a worker's main process makes of the published message."""
    envelope = message.envelope
    received = Message(
        body=envelope.body,
        content_type=envelope.content_type,
        content_encoding=envelope.content_encoding,
        headers=dict(envelope.headers),
        properties=dict(envelope.properties),
        delivery_info={},
    )
    request = Request(received, app=task.app, task=task)
    task_received.send(sender=None, request=request)
    return request


def head_row(alias: str, message: StoredMessage) -> Any:
    return OutboxMessage.objects.using(alias).filter(id=message.id).first()


@pytest.mark.parametrize("policy", ["block", "skip"])
def test_a_head_that_rejects_its_message_follows_its_policy(
    on_alias: str, policy: str
) -> None:
    strict_pair(on_alias, rejects, False, policy=policy)
    stores = Stores(on_alias)
    store = stores.relay()
    (head,) = publish_heads(store)
    assert run_on_worker(head, rejects) == "REJECTED"
    if policy == "block":
        (blocked,) = stores.ordering().ordering_stats().blocked
        assert blocked.id == head.id
        assert blocked.last_error == "reject requeue=False: refused"
        assert publish_heads(store) == ()
    else:
        dead = DeadLetter.objects.using(on_alias).get(original_id=head.id)
        assert dead.last_error == "reject requeue=False: refused"
        (following,) = publish_heads(store)
        assert following.id > head.id


def test_a_head_that_requeues_its_message_stays_held_for_a_new_lease(
    on_alias: str, settings: Any
) -> None:
    settings.CELERY_OUTBOX_STRICT_LEASE_SECONDS = 3600.0
    strict_pair(on_alias, rejects, True)
    store = Stores(on_alias).relay()
    (head,) = publish_heads(store)  # running for 300 s
    before = head_row(on_alias, head).available_at
    assert run_on_worker(head, rejects) == "REJECTED"
    after = head_row(on_alias, head)
    assert after.state == "running"
    assert after.available_at - before > dt.timedelta(minutes=30)


@pytest.mark.parametrize(
    ("terminated", "expired"), [(False, False), (False, True), (True, False)]
)
def test_a_revoked_head_goes_and_its_key_moves_on(
    on_alias: str, terminated: bool, expired: bool
) -> None:
    strict_pair(on_alias, record, "head")
    store = Stores(on_alias).relay()
    (head,) = publish_heads(store)
    request = delivered(head, record)
    # As the worker's main process announces it, in the queue or while it runs.
    task_revoked.send(
        sender=record,
        request=Context(request.request_dict),
        terminated=terminated,
        signum=15 if terminated else None,
        expired=expired,
    )
    assert wait_for_reports(10.0)
    assert head_row(on_alias, head) is None
    assert not DeadLetter.objects.using(on_alias).exists()
    (following,) = publish_heads(store)
    assert following.id > head.id


def test_a_head_killed_by_its_hard_time_limit_blocks_its_key(on_alias: str) -> None:
    strict_pair(on_alias, record, "head")
    stores = Stores(on_alias)
    store = stores.relay()
    (head,) = publish_heads(store)
    request = delivered(head, record)
    # Sent by the worker's main process once the pool killed the child.
    task_failure.send(
        sender=record,
        task_id=request.id,
        exception=TimeLimitExceeded(1.0),
        args=[],
        kwargs={},
        traceback=None,
        einfo=None,
    )
    assert wait_for_reports(10.0)
    (blocked,) = stores.ordering().ordering_stats().blocked
    assert (blocked.id, blocked.last_error) == (head.id, "TimeLimitExceeded(1.0)")
    assert publish_heads(store) == ()


def test_a_head_whose_worker_process_died_is_published_again_at_once(
    on_alias: str,
) -> None:
    strict_pair(on_alias, record, "head")
    store = Stores(on_alias).relay()
    (head,) = publish_heads(store)  # running for 300 s
    request = delivered(head, record)
    task_failure.send(
        sender=record,
        task_id=request.id,
        exception=WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL)."),
        args=[],
        kwargs={},
        traceback=None,
        einfo=None,
    )
    assert wait_for_reports(10.0)
    (again,) = publish_heads(store)
    assert again.id == head.id
    assert again.republish


def test_a_retried_head_stays_held_for_its_delay_and_a_lease(
    on_alias: str, settings: Any
) -> None:
    settings.CELERY_OUTBOX_STRICT_LEASE_SECONDS = 600.0
    strict_pair(on_alias, record, "head")
    store = Stores(on_alias).relay()
    (head,) = publish_heads(store)  # running for 300 s
    before = head_row(on_alias, head).available_at
    request = delivered(head, record)
    # Sent by whichever process retried it: the task's (self.retry()), or the
    # worker's main one (5.7's retry_on_worker_lost).
    task_retry.send(
        sender=record,
        request=Context(request.request_dict),
        reason=Retry(when=3000),
        einfo=None,
    )
    assert wait_for_reports(10.0)
    after = head_row(on_alias, head)
    assert after.state == "running"
    assert after.available_at - before > dt.timedelta(seconds=3000)
    assert publish_heads(store) == ()


def test_a_head_the_worker_does_not_know_blocks_its_key(on_alias: str) -> None:
    strict_pair(on_alias, record, "head")
    stores = Stores(on_alias)
    store = stores.relay()
    (head,) = publish_heads(store)
    # A worker without the task (a deploy under way) rejects the message.
    task_unknown.send(
        sender=None,
        message=Message(body=head.envelope.body, headers=dict(head.envelope.headers)),
        exc=KeyError(record.name),
        name=record.name,
        id=head.envelope.task_id,
    )
    assert wait_for_reports(10.0)
    (blocked,) = stores.ordering().ordering_stats().blocked
    assert blocked.id == head.id
    assert "never registered" in blocked.last_error


# -- a flow key's task that puts its message back ----------------------------------


@shared_task(name="tests.flow.rejects_late", acks_late=True)
def rejects_late(requeue: bool) -> None:
    """``rejects``, acknowledged late: a requeue puts its message back."""
    raise Reject("refused", requeue=requeue)


def flow_slots_after_a_reject(alias: str, task: Any) -> list[tuple[str, bool]]:
    """A flow key's ``task(True)`` published (a slot of key "a" taken under
    ``running: 1``, a second task of the key parked) and run; the key's slots
    then, and whether the parked task was woken."""
    with transaction.atomic(using=alias):
        task.apply_async((True,), flow_key="a")
        record.apply_async(("next",), flow_key="a")
    stores = Stores(alias)
    store = stores.relay()
    claim = store.claim(10, 30)
    gate = FlowGate(get_settings().flows, stores.flows())
    (published,) = gate.admit(claim.messages, claim.token).admitted
    store.settle(claim.token, Settlement(delete=(published.id,)))
    assert run_on_worker(published, task) == "REJECTED"
    slots = FlowSlot.objects.using(alias).filter(flow="partner", flow_key="a")
    return [
        (published.envelope.task_id == task_id, started)
        for task_id, started in slots.values_list("task_id", "started")
    ]


FLOWS = {
    "partner": {
        "tasks": [rejects.name, rejects_late.name, record.name],
        "running": 1,
    }
}


def test_a_flow_keys_task_that_requeues_its_message_keeps_its_slot_queued(
    on_alias: str, settings: Any
) -> None:
    # Reject(requeue=True) of an acks_late task: it runs again. Its slot freed,
    # the key's next task would be published and run beside it: two under
    # running 1.
    settings.CELERY_OUTBOX_FLOWS = FLOWS
    slots = flow_slots_after_a_reject(on_alias, rejects_late)
    assert slots == [(True, False)]  # its own, back in the queue, not started
    store = Stores(on_alias).relay()
    assert store.claim(10, 30).messages == ()  # "next" still waits its turn


def test_a_flow_keys_task_whose_requeue_puts_nothing_back_frees_its_slot(
    on_alias: str, settings: Any
) -> None:
    # Acknowledged as its run began: Celery's reject does nothing, the task
    # never runs again, and its slot would wait for the lease.
    settings.CELERY_OUTBOX_FLOWS = FLOWS
    assert flow_slots_after_a_reject(on_alias, rejects) == []
    (woken,) = Stores(on_alias).relay().claim(10, 30).messages
    assert woken.envelope.task_name == record.name
