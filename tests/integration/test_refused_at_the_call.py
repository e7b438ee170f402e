"""A key or name no database can store is refused at the call, naming the character
and its position, and the caller's transaction goes on.

NUL: PostgreSQL refuses it in text. A lone surrogate (what Python decodes an
undecodable byte to): no database stores it as UTF-8. Refused by the driver, either
aborted the caller's transaction on PostgreSQL; an ``inbox_key`` holding one was
accepted and then failed every delivery.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Task, states
from django.db import transaction

from celery_outbox import OutboxCelery
from celery_outbox.exceptions import OutboxConfigurationError, OutboxValueError
from celery_outbox.handlers import emit
from celery_outbox.handlers.models import HandlerMessage
from celery_outbox.inbox.models import InboxEntry
from celery_outbox.models import DedupKey, OutboxMessage
from tests.project.celery_app import app
from tests.project.shop.models import Order, TaskRun
from tests.project.shop.tasks import inbox_record, record

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

NUL = "\x00"
SURROGATE = "\udc80"

#: Calls on the task path: (what is refused, the call).
TASK_CALLS: dict[str, Callable[[], Any]] = {
    "ordering_key": lambda: record.apply_async(("a",), ordering_key=f"org:{NUL}42"),
    "coalesce_key": lambda: record.apply_async(
        ("a",), coalesce_key=f"doc{SURROGATE}:1"
    ),
    "dedup_key": lambda: record.apply_async(("a",), dedup_key=f"inv{NUL}:1"),
    "flow_key": lambda: record.apply_async(("a",), flow_key=f"ten{SURROGATE}ant"),
    "task_id": lambda: record.apply_async(("a",), task_id=f"abc{SURROGATE}"),
    "task_name": lambda: app.send_task(f"shop.rec{NUL}ord", args=("a",)),
    "exchange": lambda: record.apply_async(
        ("a",), exchange=f"ex{NUL}", routing_key="rk"
    ),
    "queue": lambda: record.apply_async(("a",), queue=f"q{NUL}"),
    "inbox_key": lambda: inbox_record.apply_async(("a",), inbox_key=f"inv{NUL}:1"),
    "inbox_key ": lambda: inbox_record.apply_async(
        ("a",), headers={"inbox_key": f"inv{SURROGATE}:1"}
    ),
}
#: Where each refused character sits in its value.
POSITIONS = {
    "ordering_key": 4,
    "coalesce_key": 3,
    "dedup_key": 3,
    "flow_key": 3,
    "task_id": 3,
    "task_name": 8,
    "exchange": 2,
    "queue": 1,
    "inbox_key": 3,
    "inbox_key ": 3,
}


@pytest.mark.parametrize("refused", list(TASK_CALLS))
def test_a_refused_key_leaves_the_callers_transaction_usable(
    alias: str, settings: Any, refused: str
) -> None:
    settings.CELERY_OUTBOX_DATABASE = alias
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False
    number = f"kept-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using=alias):
        Order.objects.using(alias).create(number=f"{number}-before")
        with pytest.raises(OutboxValueError) as caught:
            TASK_CALLS[refused]()
        # The same transaction still writes, enqueues and commits.
        Order.objects.using(alias).create(number=f"{number}-after")
        sent = record.apply_async(("fine",)).id
    message = str(caught.value)
    assert refused.strip() in message
    assert f"at position {POSITIONS[refused]}" in message
    assert ("NUL" in message) or ("lone surrogate" in message)
    orders = Order.objects.using(alias).filter(number__startswith=number)
    assert orders.count() == 2
    assert list(
        OutboxMessage.objects.using(alias).values_list("task_id", flat=True)
    ) == [sent]
    assert not DedupKey.objects.using(alias).exists()


def test_a_delivery_with_a_key_no_table_holds_fails_once_with_the_reason(
    settings: Any,
) -> None:
    """A key another service sent (no check on its side): the task fails with the
    culprit named, and no statement of the inbox ran."""
    settings.CELERY_OUTBOX_INBOX_DATABASE = "default"
    tag = f"bad-key-{uuid.uuid4().hex[:8]}"
    entries = InboxEntry.objects.count()
    # Celery's own apply: the key is not checked at the call, as from another service.
    result = Task.apply(
        inbox_record, (tag,), task_id=uuid.uuid4().hex, headers={"inbox_key": f"k{NUL}"}
    )
    assert result.state == states.FAILURE
    assert isinstance(result.result, OutboxValueError)
    assert "at position 1" in str(result.result)
    assert not TaskRun.objects.filter(tag=tag).exists()
    assert InboxEntry.objects.count() == entries


@pytest.mark.parametrize(
    ("declare", "position"),
    [
        (lambda a: a.event(f"order.{NUL}created")(lambda: None), 6),
        (lambda a: a.subscriber(f"order.{SURROGATE}")(lambda: None), 6),
        (lambda a: a.subscriber("order.*", name=f"billing.on{NUL}order")(print), 10),
    ],
    ids=["event name", "subscriber pattern", "subscriber name"],
)
def test_event_and_subscriber_names_no_table_holds_are_refused(
    declare: Callable[[OutboxCelery], Any], position: int
) -> None:
    service = OutboxCelery(f"billing-{uuid.uuid4().hex[:8]}", set_as_current=False)
    with pytest.raises(OutboxConfigurationError) as caught:
        declare(service)
    message = str(caught.value)
    assert f"at position {position}" in message
    assert ("NUL" in message) or ("lone surrogate" in message)


#: ``emit()`` calls with a key no table holds: (what is refused, the call, where the
#: character sits).
EMITS: dict[str, tuple[Callable[[str], Any], int]] = {
    "category": (
        lambda alias: emit(
            f"org.upd{SURROGATE}", shard="o:1", object_id=1, using=alias
        ),
        7,
    ),
    "shard": (
        lambda alias: emit("org.update", shard=("org", NUL), object_id=1, using=alias),
        4,
    ),
    "shard ": (
        lambda alias: emit(
            "org.update", shard=f"caf{SURROGATE}", object_id=1, using=alias
        ),
        3,
    ),
    "object_id": (
        lambda alias: emit("org.update", shard="o:1", object_id=f"7{NUL}", using=alias),
        1,
    ),
    "object_id ": (
        lambda alias: emit(
            "org.update", shard="o:1", object_id=f"f{SURROGATE}", using=alias
        ),
        1,
    ),
}


@pytest.mark.parametrize("refused", list(EMITS))
def test_an_emit_with_a_key_no_table_holds_leaves_the_transaction_usable(
    alias: str, refused: str
) -> None:
    call, position = EMITS[refused]
    number = f"kept-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using=alias):
        Order.objects.using(alias).create(number=f"{number}-before")
        with pytest.raises(OutboxValueError) as caught:
            call(alias)
        # The same transaction still writes, emits and commits.
        Order.objects.using(alias).create(number=f"{number}-after")
        emit("org.update", shard="o:1", object_id=1, payload="fine", using=alias)
    message = str(caught.value)
    assert message.startswith("Cannot emit a handler message")
    assert f"{refused.strip()} " in message
    assert f"at position {position}" in message
    assert ("NUL" in message) or ("lone surrogate" in message)
    assert message.endswith("Nothing was written.")
    assert Order.objects.using(alias).filter(number__startswith=number).count() == 2
    assert list(
        HandlerMessage.objects.using(alias).values_list("payload", flat=True)
    ) == ['"fine"']
