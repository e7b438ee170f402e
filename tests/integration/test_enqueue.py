"""The enqueue path through a real OutboxCelery app and real databases."""

from __future__ import annotations

import gc
import json
import logging
import uuid
from decimal import Decimal
from typing import Any

import pytest
from celery import chain, group
from django.db import transaction
from django.test import override_settings
from kombu import Connection

from celery_outbox import app as outbox_app_module
from celery_outbox.app import OutboxCelery, resolve_app
from celery_outbox.conf import get_settings
from celery_outbox.exceptions import (
    OutboxConfigurationError,
    OutboxSerializationError,
    OutboxTransactionError,
    OutboxValueError,
)
from celery_outbox.models import OutboxMessage
from tests.project.shop.models import Order, TaskRun
from tests.project.shop.tasks import add, record

from ..conftest import BROKER_AMQP

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


def rows(alias: str = "default") -> list[OutboxMessage]:
    return list(OutboxMessage.objects.using(alias).order_by("id"))


def test_delay_writes_a_row_in_the_callers_transaction() -> None:
    with transaction.atomic():
        Order.objects.create(number="1")
        result = record.delay("hello", {"when": Decimal("1.50"), "id": uuid.uuid4()})
        assert [r.task_id for r in rows()] == [result.id]
    [row] = rows()
    assert row.task_name == "shop.record"
    assert row.headers and result.id in row.headers
    assert "hello" in row.arguments_preview


def test_a_rollback_writes_nothing() -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        Order.objects.create(number="1")
        record.delay("never")
        raise RuntimeError("rollback")
    assert rows() == []
    assert Order.objects.count() == 0


def test_canvas_writes_one_row_per_message() -> None:
    with transaction.atomic():
        group(record.s(f"g{i}") for i in range(3)).apply_async()
        chain(add.s(1, 2), add.s(3)).apply_async()
    names = sorted(r.task_name for r in rows())
    assert names == ["shop.add", "shop.record", "shop.record", "shop.record"]


def test_outside_a_transaction_warns_once_per_task_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_outbox")
    add.delay(1, 1)
    add.delay(2, 2)
    warnings = [
        r for r in caplog.records if "outside transaction.atomic()" in r.getMessage()
    ]
    assert (
        len(warnings) <= 1
    )  # once per process: an earlier test may already have warned
    assert len(rows()) == 2


def test_eager_mode_from_override_settings_starts_and_ends_with_it() -> None:
    with transaction.atomic():
        add.delay(1, 1)  # Celery's configuration is read (and memoized) here
    with override_settings(CELERY_TASK_ALWAYS_EAGER=True), transaction.atomic():
        eager = add.delay(2, 3)
    assert eager.get() == 5
    assert TaskRun.objects.filter(task_id=eager.id).count() == 1
    with transaction.atomic():
        add.delay(4, 4)
    assert [r.task_name for r in rows()] == ["shop.add", "shop.add"]
    assert eager.id not in {r.task_id for r in rows()}


def test_strict_mode_refuses_calls_outside_a_transaction(settings: Any) -> None:
    settings.CELERY_OUTBOX_OUTSIDE_TRANSACTION = "raise"
    with pytest.raises(OutboxTransactionError, match=r"outside transaction\.atomic"):
        record.delay("strict")
    assert rows() == []
    with transaction.atomic():
        record.delay("inside")
    assert len(rows()) == 1


def test_allow_mode_is_silent(settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    settings.CELERY_OUTBOX_OUTSIDE_TRANSACTION = "allow"
    caplog.set_level(logging.WARNING, logger="celery_outbox")
    record.delay(f"quiet-{uuid.uuid4()}")
    assert not [
        r for r in caplog.records if "outside transaction.atomic()" in r.getMessage()
    ]
    assert len(rows()) == 1


def test_business_data_on_another_alias_is_refused() -> None:
    with (
        pytest.raises(
            OutboxTransactionError, match=r"'mysql'.*outbox lives on 'default'"
        ),
        transaction.atomic(using="mysql"),
    ):
        Order.objects.using("mysql").create(number="1")
        record.delay("split")
    assert rows() == []
    assert Order.objects.using("mysql").count() == 0


@pytest.mark.parametrize("alias", ["mysql", "sqlite"])
def test_the_outbox_can_live_on_another_alias(settings: Any, alias: str) -> None:
    settings.CELERY_OUTBOX_DATABASE = alias
    with transaction.atomic(using=alias):
        Order.objects.using(alias).create(number="1")
        result = record.delay("elsewhere")
    assert [r.task_id for r in rows(alias)] == [result.id]
    assert rows("default") == []


def test_unencodable_arguments_fail_at_the_call_and_write_nothing() -> None:
    class Money:
        pass

    with transaction.atomic():
        Order.objects.create(number="kept")
        with pytest.raises(OutboxSerializationError) as raised:
            record.delay("bad", Money())
        # The caller's transaction is still usable: the error came before any write.
        Order.objects.create(number="also kept")
    message = str(raised.value)
    assert "'shop.record'" in message
    assert "positional argument 1" in message
    assert "Money" in message
    assert "'json'" in message
    assert rows() == []
    assert Order.objects.count() == 2


@pytest.mark.parametrize("alias", ["default", "postgresql_commit", "mysql", "sqlite"])
@pytest.mark.parametrize(
    ("options", "where"),
    [
        ({"headers": {"tags": {"a", "b"}}}, "headers['tags']: set"),
        ({"headers": {"x": {"y": [1, 2, object()]}}}, "headers['x']['y'][2]: object"),
        ({"headers": {"z": 1j}}, "headers['z']: complex"),
        ({"headers": {"k": {(1, 2): "tuple key"}}}, "headers['k'][(1, 2)] (its key)"),
    ],
)
def test_a_header_json_cannot_hold_is_refused_at_the_call_on_every_engine(
    settings: Any, alias: str, options: dict[str, Any], where: str
) -> None:
    """Refused inside the caller's transaction, naming the path, on every engine.

    The write-on-commit engine used to accept it and fail the caller's COMMIT.
    """
    settings.CELERY_OUTBOX_DATABASE = alias
    with transaction.atomic(using=alias):
        Order.objects.using(alias).create(number="kept")
        with pytest.raises(OutboxSerializationError) as raised:
            record.apply_async(("x",), **options)
        Order.objects.using(alias).create(number="also kept")
    assert where in str(raised.value)
    assert "Nothing was written" in str(raised.value)
    assert rows(alias) == []
    assert Order.objects.using(alias).count() == 2


def test_a_project_without_the_django_app_is_told_how_to_fix_it(
    settings: Any,
) -> None:
    app = OutboxCelery("not-installed", set_as_current=False)
    app.conf.update(broker_url=BROKER_AMQP, result_backend=None)
    installed = [name for name in settings.INSTALLED_APPS if name != "celery_outbox"]
    try:
        with (
            override_settings(INSTALLED_APPS=installed),
            transaction.atomic(),
            pytest.raises(OutboxConfigurationError) as raised,
        ):
            app.send_task("shop.record", ("x",))
    finally:
        app.close()
        outbox_app_module._instances.discard(app)
    assert "Add 'celery_outbox' to INSTALLED_APPS" in str(raised.value)
    assert "migrate celery_outbox" in str(raised.value)


def test_a_serialization_error_names_the_path_to_the_value() -> None:
    with transaction.atomic(), pytest.raises(OutboxSerializationError) as raised:
        record.delay("x", value={"a": {"b": [1, 2, {3, 4}]}})
    assert "keyword argument 'value' of type builtins.dict" in str(raised.value)
    assert "(kwargs['value']['a']['b'][2]: set)" in str(raised.value)
    assert rows() == []


def test_excluded_tasks_go_straight_to_the_broker(
    settings: Any, test_queue: str
) -> None:
    settings.CELERY_OUTBOX_EXCLUDE_TASKS = ["shop.rec*"]
    tag = f"direct-{uuid.uuid4()}"
    with transaction.atomic():
        record.delay(tag)
    assert rows() == []
    with Connection(BROKER_AMQP) as conn:
        queue = conn.SimpleQueue(test_queue)
        try:
            bodies = []
            while True:
                try:
                    message = queue.get(timeout=1)
                except queue.Empty:
                    break
                message.ack()
                bodies.append(message.decode())
        finally:
            queue.close()
    assert any(tag in repr(body) for body in bodies)


def test_resolve_app_names_what_to_set(settings: Any) -> None:
    settings.CELERY_OUTBOX_APP = "tests.project.celery_app.app"
    assert isinstance(resolve_app(get_settings()), OutboxCelery)
    settings.CELERY_OUTBOX_APP = "tests.project.shop.models.Order"
    with pytest.raises(OutboxConfigurationError, match="not an OutboxCelery"):
        resolve_app(get_settings())
    settings.CELERY_OUTBOX_APP = "nowhere.celery.app"
    with pytest.raises(OutboxConfigurationError, match="cannot be imported"):
        resolve_app(get_settings())


def test_a_group_is_written_in_one_insert() -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        result = group(record.s(f"bulk-{i}") for i in range(200)).apply_async()
    inserts = [
        q["sql"]
        for q in queries.captured_queries
        if "INSERT INTO celery_outbox_message" in q["sql"]
    ]
    assert len(inserts) == 1
    assert sorted(r.task_id for r in rows()) == sorted(
        child.id for child in result.results
    )


def test_a_failed_group_call_writes_nothing() -> None:
    with transaction.atomic(), pytest.raises(OutboxSerializationError):
        group([record.s("fine"), record.s("bad", object())]).apply_async()
    assert rows() == []


def test_an_ordering_key_is_stored_beside_the_message_not_in_it() -> None:
    with transaction.atomic():
        result = record.apply_async(("k",), ordering_key="customer-42")
    [row] = rows()
    assert row.task_id == result.id
    assert row.ordering_key == "customer-42"
    assert "customer-42" not in row.headers
    assert "customer-42" not in row.properties
    assert b"customer-42" not in bytes(row.body)


@pytest.mark.parametrize("alias", ["default", "postgresql_commit"])
@pytest.mark.parametrize(
    ("option", "refusal"),
    [
        # Too wide for its column.
        ({"ordering_key": "k" * 256}, "ordering_key is .* at most 255"),
        # With an AMQP broker the id is refused as the message's correlation_id
        # ("its task id is 300 bytes long ... at most 255") before the column says so.
        ({"task_id": "t" * 300}, "its task.id is .* at most 255"),
        # JSON and the table take these; an AMQP frame cannot. Without the check the
        # row would fail at the relay on every attempt and end as a dead letter.
        ({"headers": {"n": 2**70}}, "its header 'n' holds a value AMQP cannot carry"),
        ({"headers": {"k" * 300: 1}}, r"its header name 'k+'\.\.\. is 300 bytes long"),
        ({"priority": 300}, "its priority property 300 is not a valid AMQP octet"),
        # Celery routes by the queue: its name becomes the routing key.
        ({"queue": "é" * 200}, "its routing key is 400 bytes long"),
        ({"task_id": "é" * 200}, "its task id is 400 bytes long"),
        # RabbitMQ closes the whole connection for a header frame past frame_max.
        ({"headers": {"blob": "x" * 200_000}}, r"take 200,\d+ bytes in AMQP"),
        ({"headers": {"ids": list(range(40_000))}}, r"take \d+,\d+ bytes in AMQP"),
    ],
    ids=[
        "ordering key column",
        "task id column",
        "integer over 64 bits",
        "long header name",
        "priority",
        "routing key",
        "id",
        "header frame past frame_max",
        "many small header values past frame_max",
    ],
)
def test_a_value_that_cannot_be_stored_or_sent_fails_at_the_call(
    settings: Any, alias: str, option: dict[str, Any], refusal: str
) -> None:
    settings.CELERY_OUTBOX_DATABASE = alias
    with transaction.atomic(using=alias):
        Order.objects.using(alias).create(number="kept")
        with pytest.raises(OutboxValueError, match=refusal):
            record.apply_async(("x",), **option)
        fine = record.delay("fine")
    assert [r.task_id for r in rows(alias)] == [fine.id]
    assert Order.objects.using(alias).count() == 1


def test_a_group_with_a_message_rabbitmq_cannot_carry_writes_nothing() -> None:
    # A group's members are collected by a producer of their own, then written in
    # one INSERT: one refused member refuses the group.
    with transaction.atomic():
        Order.objects.create(number="kept")
        with pytest.raises(OutboxValueError, match="its header 'n' holds a value"):
            group(record.s("a"), record.s("b").set(headers={"n": 2**70})).apply_async()
        fine = record.delay("fine")
    assert [r.task_id for r in rows()] == [fine.id]
    assert Order.objects.count() == 1


def test_headers_just_inside_one_amqp_frame_are_accepted() -> None:
    with transaction.atomic():
        result = record.apply_async(("x",), headers={"blob": "x" * 120_000})
    assert [r.task_id for r in rows()] == [result.id]


def test_values_only_amqp_refuses_are_written_for_a_redis_broker() -> None:
    app = OutboxCelery("redis-broker", set_as_current=False)
    app.conf.update(broker_url="redis://127.0.0.1:6379/0", result_backend=None)

    @app.task(name="shop.redis_only", shared=False)
    def redis_only() -> None:
        return None

    try:
        with transaction.atomic():
            result = redis_only.apply_async(
                headers={"n": 2**70, "blob": "x" * 200_000}, priority=300
            )
        [row] = rows()
        assert row.task_id == result.id
        assert str(2**70) in row.headers
    finally:
        app.close()
        outbox_app_module._instances.discard(app)


def found_app() -> object:
    """What the lookup without CELERY_OUTBOX_APP gives: the app, or its error's text."""
    try:
        return resolve_app(get_settings())
    except OutboxConfigurationError as refused:
        return str(refused)


def test_an_app_dropped_but_not_yet_collected_does_not_make_the_choice_ambiguous(
    settings: Any,
) -> None:
    # The lookup itself: with no app named, the only OutboxCelery alive. What else
    # this process holds depends on the tests it ran before, so the test compares
    # the answer before and after an app is dropped, whatever it is.
    settings.CELERY_OUTBOX_APP = None
    gc.collect()
    before = found_app()
    gc.disable()  # as if the collector had not run since the app was dropped
    try:
        dropped = OutboxCelery("dropped", set_as_current=False)
        dropped.conf.update(itself=dropped)  # a reference cycle, as Celery apps have
        del dropped
        assert found_app() == before
    finally:
        gc.enable()


def test_ordering_options_reach_the_row_and_the_headers_task_defaults_included() -> (
    None
):
    from celery_outbox.ordering_options import HEADER
    from tests.project.shop.tasks import ordered

    with transaction.atomic():
        record.apply_async(("a",), ordering="strict", ordering_key="org:1")
        record.s("b").set(coalesce_key="obj:9").apply_async()
        ordered.ordering = "strict"
        try:
            ordered.apply_async(("c",), ordering_key="org:2")
            ordered.apply_async(("d",))  # no key: the task's default does not apply
        finally:
            ordered.ordering = None
    found = [(r.ordering_key, json.loads(r.headers).get(HEADER)) for r in rows()]
    # A strict row also carries its own token, which its worker's reports name.
    flags = [(key, value and value.split(",row=")[0]) for key, value in found]
    assert flags == [
        ("org:1", "strict"),
        ("obj:9", "coalesce"),
        ("org:2", "strict"),
        (None, None),
    ]
    tokens = {
        value.split(",row=")[1] for _, value in found if value and "row=" in value
    }
    assert len(tokens) == 2
