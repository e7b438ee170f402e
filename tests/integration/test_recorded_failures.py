"""Every failure can be recorded, and recording a batch's failures costs what the batch is.

A reason holding a NUL (PostgreSQL cannot store it) or a lone surrogate (no database
stores it as UTF-8) used to make the settlement fail: the row was published again at
lease pace and never reached the dead letters. A receiver's exception holding one
stopped every handler shard (the processor exited), or ran a non-atomic receiver again
and again with no attempt charged. Reasons and errors now go through
:func:`celery_outbox.text.storable` on their way to every table.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.conf import OutboxSettings
from celery_outbox.envelope import StoredMessage
from celery_outbox.handlers import emit
from celery_outbox.handlers.models import (
    HandlerDeadLetter,
    HandlerMessage,
    HandlerProcessor,
)
from celery_outbox.handlers.processor import Processor, ProcessorConfig
from celery_outbox.handlers.registry import Category, Registry
from celery_outbox.models import DeadLetter, HistoryEvent, OutboxMessage, RelayHeartbeat
from celery_outbox.outcomes import Action, Decision, Outcome, PublishResult, Settlement
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.store import RelayStore, Stores
from celery_outbox.store.dialects import CASE_CHUNK
from celery_outbox.store.events import EventRows
from celery_outbox.store.handlers.sql import HandlerStore
from celery_outbox.text import REPLACEMENT

from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

#: What a broker or an exception may say: a NUL, and a byte Python decoded to a
#: lone surrogate.
REASON = "NOT_FOUND - no exchange 'bill\x00ing' (\udc80)"
RECORDED = f"NOT_FOUND - no exchange 'bill{REPLACEMENT}ing' ({REPLACEMENT})"


def refuse(message: StoredMessage) -> PublishResult:
    return PublishResult(message.id, Outcome.FAILED, REASON)


def test_a_refusal_that_cannot_be_stored_is_retried_then_dead_lettered(
    alias: str,
) -> None:
    task_id = envelope("t").task_id
    with transaction.atomic(using=alias):
        Stores(alias).writer().insert([envelope("t", task_id=task_id)])
    settings = OutboxSettings(
        max_attempts=2,
        retry_base_seconds=0.01,
        retry_max_seconds=0.02,
        poll_interval=0.05,
        history=True,
    )
    relay = Relay(
        Stores(alias, history=True).relay(),
        InMemoryPublisher(refuse),
        RelayConfig.from_settings(settings, until_empty=True),
        observers=(),
    )
    deadline = time.monotonic() + 15
    while OutboxMessage.objects.using(alias).exists() and time.monotonic() < deadline:
        relay.run()
        time.sleep(0.03)
    (dead,) = DeadLetter.objects.using(alias).filter(task_id=task_id)
    assert (dead.attempts, dead.last_error) == (2, RECORDED)
    history = HistoryEvent.objects.using(alias).filter(task_id=task_id).order_by("id")
    assert list(history.values_list("event", "attempt", "error")) == [
        ("retrying", 1, RECORDED),
        ("dead", 2, RECORDED),
    ]


def test_an_operators_reason_that_cannot_be_stored_is_recorded(alias: str) -> None:
    stores = Stores(alias, history=True)
    store = stores.operator()
    with transaction.atomic(using=alias):
        stores.writer().insert([envelope("t")])
    (row_id,) = OutboxMessage.objects.using(alias).values_list("id", flat=True)
    assert store.move_to_dead_letters([row_id], REASON) == [row_id]
    (dead,) = DeadLetter.objects.using(alias).all()
    assert dead.last_error == RECORDED
    (event,) = HistoryEvent.objects.using(alias).all()
    assert (event.event, event.error) == ("dead", RECORDED)


def test_an_archived_events_reason_that_cannot_be_stored_is_recorded(
    alias: str,
) -> None:
    with transaction.atomic(using=alias):
        EventRows(alias).insert_dead([envelope("event")], REASON)
    assert list(
        DeadLetter.objects.using(alias).values_list("last_error", flat=True)
    ) == [RECORDED]


def test_a_long_reason_is_cut_and_says_how_long_it_was(alias: str) -> None:
    stores = Stores(alias)
    store = stores.relay()
    with transaction.atomic(using=alias):
        stores.writer().insert([envelope("t")])
    claim = store.claim(10, 30)
    (message,) = claim.messages
    reason = "x" * 10_000
    decision = Decision(message.id, Action.RETRY, 60.0, reason)
    assert store.settle(claim.token, Settlement(retry=(decision,))).retried == 1
    (error,) = OutboxMessage.objects.using(alias).values_list("last_error", flat=True)
    assert len(error) == 4000
    assert error.endswith("10000 characters in all]")


def refused_batch(alias: str, rows: int, kind: str) -> tuple[RelayStore, Any, Any]:
    """``rows`` claimed rows, and the settlement of all of them as ``kind``."""
    stores = Stores(alias, history=True)
    store = stores.relay()
    with transaction.atomic(using=alias):
        stores.writer().insert([envelope(f"t{n}") for n in range(rows)])
    claim = store.claim(rows, 300)
    assert len(claim.messages) == rows
    action = Action.RETRY if kind == "retry" else Action.DEAD_LETTER
    decisions = tuple(
        Decision(m.id, action, 30.0 + m.id % 7, f"refused {m.id}")
        for m in claim.messages
    )
    return store, claim, Settlement.of(decisions)


@pytest.mark.parametrize("kind", ["retry", "dead_letter"])
def test_no_settling_statement_grows_with_the_batch(alias: str, kind: str) -> None:
    """Each row's reason and delay are picked by a CASE over the statement's ids, which
    the database reads for every row: a statement over the whole batch made settling
    N refusals cost N squared (16,000 rows: 8 s on PostgreSQL)."""
    rows = 3 * CASE_CHUNK + 7
    store, claim, settlement = refused_batch(alias, rows, kind)
    with CaptureQueriesContext(connections[alias]) as queries:
        report = store.settle(claim.token, settlement)
    assert (report.retried + report.dead_lettered) == rows
    whens = [query["sql"].count(" WHEN ") for query in queries]
    # A CASE for the reasons, one for the delays: each over one chunk of ids.
    assert max(whens) <= 2 * CASE_CHUNK
    assert sum(whens) >= 2 * rows  # every row got its own reason
    if kind == "retry":
        rows_left = OutboxMessage.objects.using(alias).order_by("id")
        first = rows_left.first()
        assert first is not None and first.last_error == f"refused {first.id}"
    else:
        dead = DeadLetter.objects.using(alias).order_by("id").last()
        assert dead is not None and dead.last_error == f"refused {dead.original_id}"
    assert HistoryEvent.objects.using(alias).count() == rows


#: What a receiver's exception may say: a file name Python decoded with
#: ``surrogateescape``, or a NUL.
RECEIVER_ERRORS = {"surrogate": "file name caf\udce9", "NUL": "file name caf\x00"}


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "non-atomic"])
@pytest.mark.parametrize("text", list(RECEIVER_ERRORS))
def test_a_receivers_error_that_cannot_be_stored_is_charged_then_dead_lettered(
    alias: str, text: str, atomic: bool
) -> None:
    name = f"test.{uuid.uuid4().hex[:8]}"
    runs: list[int] = []

    def receive(*, attempt: int, **_: Any) -> None:
        runs.append(attempt)
        raise ValueError(RECEIVER_ERRORS[text])

    categories = Registry()
    categories.add(Category(name, receive, max_attempts=2, atomic=atomic))
    with transaction.atomic(using=alias):
        emit(name, shard="files", object_id=1, using=alias)
        emit(name, shard="files", object_id=2, using=alias)
    config = ProcessorConfig(
        databases=(alias,),
        retry_base_seconds=0.01,
        retry_max_seconds=0.02,
        poll_interval=0.02,
        heartbeat_interval=None,
    )
    processor = Processor(config, categories)

    def serve() -> None:
        try:
            processor.run()
        finally:
            connections.close_all()  # this thread's

    # Until stopped, as `outbox handlers run` runs: it must neither die nor spin.
    thread = threading.Thread(target=serve)
    thread.start()
    deadline = time.monotonic() + 10
    messages = HandlerMessage.objects.using(alias)
    while messages.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    processor.stop()
    thread.join(10)
    # Each message ran twice and went to the dead letters: the shard went on.
    assert runs == [1, 2, 1, 2]
    dead = HandlerDeadLetter.objects.using(alias).order_by("message_id")
    assert [d.attempts for d in dead] == [2, 2]
    for letter in dead:
        assert letter.last_error.endswith(f"ValueError: file name caf{REPLACEMENT}\n")


def test_a_process_name_no_database_stores_is_recorded(alias: str) -> None:
    """A heartbeat names its process ``host:pid``; Python decodes a host name that
    is not UTF-8 with ``surrogateescape``. The first beat failed, and the relay or
    processor with it."""
    name = "caf\udce9-host:42"
    Stores(alias).registry().beat("r" * 32, name)
    HandlerStore(alias).beat("h" * 32, name)
    recorded = f"caf{REPLACEMENT}-host:42"
    assert RelayHeartbeat.objects.using(alias).get().name == recorded
    assert HandlerProcessor.objects.using(alias).get().name == recorded
