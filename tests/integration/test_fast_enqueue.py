"""Repeated calls built from a template (celery_outbox.fastpath), on real databases.

The message fidelity of repeated calls is checked against plain Celery, case by case,
in test_fidelity.py. These tests check that a template never outlives what it was
made from: the configuration, the publish signals, the thread, the process, and
that the inline INSERT keeps every value exactly.
"""

from __future__ import annotations

import gc
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import signals
from celery.utils.saferepr import saferepr
from django.conf import settings
from django.db import transaction

from celery_outbox import OutboxCelery, fastpath
from celery_outbox import app as outbox_app_module
from celery_outbox.celeryconf import MemoizedSettings
from celery_outbox.exceptions import OutboxSerializationError, OutboxValueError
from celery_outbox.models import OutboxMessage
from celery_outbox.signals import message_created
from celery_outbox.store import OutboxStore
from tests.project.shop.models import Order

from ..conftest import BROKER_AMQP
from .builders import envelope
from .conftest import ALIASES

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


@pytest.fixture
def app() -> Iterator[OutboxCelery]:
    """An OutboxCelery of its own (its configuration is changed by the tests)."""
    app = OutboxCelery("fast", set_as_current=False)
    app.conf.update(
        broker_url=BROKER_AMQP, task_default_queue="fast-q", result_backend=None
    )

    @app.task(name="fast.work", shared=False)
    def work(*args: Any, **kwargs: Any) -> None:
        return None

    yield app
    app.close()
    outbox_app_module._instances.discard(app)
    del app
    gc.collect()


def send(app: OutboxCelery, *args: Any, **options: Any) -> str:
    """``fast.work.apply_async(args, **options)`` in a committed transaction; the id."""
    with transaction.atomic():
        return str(app.tasks["fast.work"].apply_async(args, **options).id)


def row(task_id: str) -> OutboxMessage:
    return OutboxMessage.objects.get(task_id=task_id)


def reusable(app: OutboxCelery) -> int:
    conf = app.conf
    assert isinstance(conf, MemoizedSettings)
    return app._outbox_shapes.reusable(conf.version)


def test_a_template_is_made_once_and_rows_differ_only_per_call(
    app: OutboxCelery,
) -> None:
    first = send(app, 1)
    assert reusable(app) == 1
    second = send(app, 2, "two")
    assert reusable(app) == 1  # the same shape: no second template
    a, b = row(first), row(second)
    assert (a.queue, a.exchange, a.routing_key, a.declare_queues) == (
        b.queue,
        b.exchange,
        b.routing_key,
        b.declare_queues,
    )
    assert second in b.headers and first not in b.headers
    assert b.arguments_preview == "args=(2, 'two') kwargs={}"
    assert (
        bytes(b.body)
        == b'[[2, "two"], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
    )


def test_other_options_make_another_shape(app: OutboxCelery) -> None:
    send(app, 1)
    send(app, 1, priority=5)
    assert reusable(app) == 2
    last = send(app, 2, priority=5)
    assert '"priority": 5' in row(last).properties


def test_equal_options_of_another_type_make_another_shape(app: OutboxCelery) -> None:
    """``True == 1``, but Celery writes them differently into the message."""
    send(app, 1, ignore_result=True)
    send(app, 2, ignore_result=True)
    assert '"ignore_result": 1,' in row(send(app, 3, ignore_result=1)).headers
    assert reusable(app) == 2


def test_a_configuration_change_reaches_the_next_call(app: OutboxCelery) -> None:
    """Celery reads ``task_repr_maxlevels`` on every call: so must a template."""
    nested = ([1, [2, [3, [4]]]],)
    send(app, *nested)
    send(app, *nested)
    assert reusable(app) == 1
    app.conf.update(task_repr_maxlevels=1)
    assert reusable(app) == 0
    changed = send(app, *nested)
    assert reusable(app) == 1
    expected = saferepr(nested, 1024, maxlevels=1)
    assert expected != saferepr(nested, 1024, maxlevels=3)
    assert row(changed).arguments_preview == f"args={expected} kwargs={{}}"


def test_a_publish_signal_receiver_sees_every_call_from_when_it_connects(
    app: OutboxCelery,
) -> None:
    send(app, 1)
    send(app, 2)

    def stamp(headers: dict[str, Any], **_: Any) -> None:
        headers["x-stamped"] = "yes"

    signals.before_task_publish.connect(stamp)
    try:
        stamped = [send(app, n) for n in (3, 4)]
    finally:
        signals.before_task_publish.disconnect(stamp)
    assert all('"x-stamped": "yes"' in row(t).headers for t in stamped)
    assert '"x-stamped"' not in row(send(app, 5)).headers


def test_a_task_sent_from_a_message_created_receiver_teaches_nothing(
    app: OutboxCelery,
) -> None:
    # The receiver's call also goes through Celery while the first call of the outer
    # shape is being learned: only the outer call's own message may become its
    # template, or every later call would carry the other task's name.
    @app.task(name="fast.audit", shared=False)
    def audit(*args: Any) -> None:
        return None

    def also_audit(task_name: str, **_: Any) -> None:
        if task_name == "fast.work":
            audit.delay(7)

    message_created.connect(also_audit)
    try:
        ids = [send(app, 7) for _ in range(3)]
    finally:
        message_created.disconnect(also_audit)
    for task_id in ids:
        stored = row(task_id)
        assert stored.task_name == "fast.work"
        assert json.loads(stored.headers)["task"] == "fast.work"
    assert OutboxMessage.objects.filter(task_name="fast.audit").count() == 3


def test_an_argument_with_a_lone_surrogate_is_stored_with_the_preview_escaped(
    app: OutboxCelery, alias: str, settings: Any
) -> None:
    # Celery's argsrepr keeps a lone surrogate (a file name that is not UTF-8, say):
    # the JSON of the message escapes it, and so must the preview column.
    settings.CELERY_OUTBOX_DATABASE = alias
    name = "report-\udc80.csv"
    for _ in range(2):  # through Celery, then from the template
        with transaction.atomic(using=alias):
            task_id = str(app.tasks["fast.work"].delay(name).id)
        stored = OutboxMessage.objects.using(alias).get(task_id=task_id)
        assert stored.arguments_preview == "args=('report-\\udc80.csv',) kwargs={}"
        assert json.loads(bytes(stored.body))[0] == [name]
        assert json.loads(stored.headers)["argsrepr"] == f"('{name}',)"  # saferepr's


def test_each_thread_gets_its_own_reply_to(app: OutboxCelery) -> None:
    main = send(app, 1)
    found: dict[str, str] = {}

    def other_thread() -> None:
        try:
            found["oid"] = app.thread_oid
            found["id"] = send(app, 2)
            found["again"] = send(app, 3)
        finally:
            from django.db import connections

            connections.close_all()

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(30)
    assert found["oid"] != app.thread_oid
    assert f'"reply_to": "{app.thread_oid}"' in row(main).properties
    for key in ("id", "again"):
        assert f'"reply_to": "{found["oid"]}"' in row(found[key]).properties


def test_templates_made_before_a_fork_are_not_used_after_it(app: OutboxCelery) -> None:
    send(app, 1)
    assert reusable(app) == 1
    fastpath._forked()  # what os.register_at_fork runs in a child
    assert reusable(app) == 0
    send(app, 2)
    assert reusable(app) == 1


def test_switched_off_every_call_goes_through_celery(
    app: OutboxCelery, settings: Any
) -> None:
    settings.CELERY_OUTBOX_FAST_ENQUEUE = False
    ids = [send(app, n) for n in range(3)]
    assert reusable(app) == 0
    assert OutboxMessage.objects.filter(task_id__in=ids).count() == 3


def test_a_repeated_call_still_refuses_what_it_cannot_encode(app: OutboxCelery) -> None:
    send(app, 1)
    with transaction.atomic():
        Order.objects.create(number="kept")
        with pytest.raises(
            OutboxSerializationError,
            match=r"positional argument 0 of type builtins\.object",
        ):
            app.tasks["fast.work"].apply_async((object(),))
    assert Order.objects.count() == 1
    assert OutboxMessage.objects.count() == 1


def test_a_repeated_call_keeps_the_task_id_it_was_given(app: OutboxCelery) -> None:
    send(app, 1)
    chosen = f"chosen-{uuid.uuid4()}"
    assert send(app, 2, task_id=chosen) == chosen
    assert row(chosen).headers.count(chosen) == 2  # id and root_id


def test_a_repeated_call_refuses_a_task_id_rabbitmq_cannot_carry(
    app: OutboxCelery,
) -> None:
    # The id is also the message's correlation_id, an AMQP short string: 150
    # characters fit the column, their 300 bytes do not fit the frame.
    send(app, 1)
    assert reusable(app) == 1
    with transaction.atomic():
        Order.objects.create(number="kept")
        with pytest.raises(OutboxValueError, match="its task id is 300 bytes long"):
            app.tasks["fast.work"].apply_async((2,), task_id="é" * 150)
        fine = app.tasks["fast.work"].apply_async((3,), task_id="é" * 50)
    assert reusable(app) == 1  # the refused call took the template's path
    assert Order.objects.count() == 1
    assert OutboxMessage.objects.filter(task_id=fine.id).count() == 1
    assert OutboxMessage.objects.count() == 2


# -- the inline INSERT (PostgreSQL) -----------------------------------------------

TRICKY = "it's a \\ back\\slash, %s %(name)s $$ dollar $1, 'quoted'' ünïcødé ✓\nnew line\ttab"


def test_every_value_survives_the_inline_insert(alias: str) -> None:
    store = OutboxStore(alias)
    message = envelope(
        "tricky",
        task_name=f"shop.{TRICKY[:40]}",
        queue=TRICKY[:60],
        routing_key=TRICKY[:60],
        ordering_key=TRICKY[:50],
        body=bytes(range(256)) * 2,
        headers={"argsrepr": TRICKY, "nested": {"q": "'"}, "n": 1},
        properties={"correlation_id": TRICKY, "priority": 3},
        arguments_preview=TRICKY,
    )
    with transaction.atomic(using=alias):
        store.connection.ensure_connection()
        inline = store.insert_text([message], notify=False)
        store.insert([message])
    assert (inline is not None) == (store.connection.vendor == "postgresql")
    [claimed] = store.claim(10, 30).messages
    got = claimed.envelope
    assert got.task_name == message.task_name
    assert (got.queue, got.routing_key, got.ordering_key) == (
        message.queue,
        message.routing_key,
        message.ordering_key,
    )
    assert got.body == message.body
    assert dict(got.headers) == message.headers
    assert dict(got.properties) == message.properties
    assert got.arguments_preview == TRICKY


@pytest.mark.parametrize(
    ("column", "value", "refusal"),
    [
        ("routing_key", "a\x00b", "its routing_key contains a NUL"),
        (
            "arguments_preview",
            "args=('a\x00b',)",
            "its arguments_preview contains a NUL",
        ),
        ("routing_key", "a\udc80b", "its routing_key contains a lone surrogate"),
    ],
    ids=["NUL", "NUL in the preview", "lone surrogate"],
)
def test_text_no_database_can_store_is_refused_at_the_call(
    alias: str, column: str, value: str, refusal: str
) -> None:
    store = OutboxStore(alias)
    with (
        transaction.atomic(using=alias),
        pytest.raises(OutboxValueError, match=refusal),
    ):
        store.insert([envelope("refused", **{column: value})])
    assert store.stats().pending == 0


PG_ALIASES = [
    name for name in ALIASES if "postgresql" in settings.DATABASES[name]["ENGINE"]
]


@pytest.mark.parametrize("pg_alias", PG_ALIASES)
@pytest.mark.parametrize(
    "setting",
    ["standard_conforming_strings = off", "client_encoding = 'LATIN1'"],
)
def test_the_driver_binds_the_values_where_literals_would_not_be_exact(
    pg_alias: str, setting: str
) -> None:
    store = OutboxStore(pg_alias)
    tricky = TRICKY.replace("✓", "")  # LATIN1 has no check mark
    message = envelope(
        "session",
        headers={"argsrepr": tricky},
        properties={"correlation_id": tricky},
        body=bytes(range(256)),
        arguments_preview=tricky,
    )
    with transaction.atomic(using=pg_alias):
        with store.connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL {setting}")
        assert store.insert_text([message], notify=False) is None
        store.insert([message])
    with transaction.atomic(using=pg_alias):
        assert store.insert_text([message], notify=False) is not None  # reset at commit
    [claimed] = store.claim(10, 30).messages
    assert claimed.envelope.body == message.body
    assert dict(claimed.envelope.headers) == {"argsrepr": tricky}
    assert dict(claimed.envelope.properties) == {"correlation_id": tricky}
    assert claimed.envelope.arguments_preview == tricky
