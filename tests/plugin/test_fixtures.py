"""The plugin's fixtures against real databases, with the test project's tasks."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any
from unittest.mock import ANY

import pytest
from celery import chain
from django.db import transaction
from kombu import Connection

from celery_outbox import signals
from celery_outbox.broker import InMemoryPublisher
from celery_outbox.envelope import StoredMessage
from celery_outbox.outcomes import Outcome, PublishResult
from celery_outbox.testing import OutboxDrainError, OutboxFixture
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import add, record, spawn, spawn_child, trace

from ..conftest import BROKER_AMQP

ALL = pytest.mark.django_db(databases="__all__")
ALL_TRANSACTIONAL = pytest.mark.django_db(databases="__all__", transaction=True)
BOTH_MODES = pytest.mark.parametrize(
    "mode",
    [
        pytest.param("testcase", marks=ALL),
        pytest.param("transaction", marks=ALL_TRANSACTIONAL),
    ],
)


def tags() -> list[str]:
    return sorted(TaskRun.objects.values_list("tag", flat=True))


# -- what is enqueued -----------------------------------------------------------


@ALL
def test_messages_decode_what_was_enqueued(alias: str, outbox: OutboxFixture) -> None:
    before = datetime.now(timezone.utc)
    with transaction.atomic(using=alias):
        first = record.delay("a", {"n": 1})
        second = add.apply_async((1, 2), {"tag": "sum"}, countdown=60, priority=3)
    [a, b] = outbox.messages
    assert (a.task_name, a.task_id, a.args, a.kwargs) == (
        "shop.record",
        first.id,
        ("a", {"n": 1}),
        {},
    )
    assert a.eta is None
    assert a.queue  # the app's default queue
    assert (b.task_name, b.task_id, b.args, b.kwargs) == (
        "shop.add",
        second.id,
        (1, 2),
        {"tag": "sum"},
    )
    assert b.eta is not None
    assert before + timedelta(seconds=59) < b.eta < before + timedelta(seconds=70)
    assert b.priority == 3
    assert b.call == "shop.add(1, 2, tag='sum')"
    assert outbox.task_names() == ["shop.record", "shop.add"]


@ALL
def test_clear_empties_the_outbox(alias: str, outbox: OutboxFixture) -> None:
    with transaction.atomic(using=alias):
        record.delay("a")
        record.delay("b")
    assert outbox.clear() == 2
    assert outbox.messages == []


def test_a_test_without_a_mark_gets_database_access(outbox: OutboxFixture) -> None:
    with transaction.atomic():
        record.delay("unmarked")
    outbox.assert_enqueued(record, args=("unmarked",))


# -- assert_enqueued ------------------------------------------------------------


@ALL
def test_assert_enqueued_matches_name_arguments_and_count(
    alias: str, outbox: OutboxFixture
) -> None:
    with transaction.atomic(using=alias):
        add.delay(1, 2)
        add.delay(1, 2)
        add.delay(3, 4, tag="x")
        record.delay("r", value=(1, (2, 3)))
    assert len(outbox.assert_enqueued(add)) == 3
    assert len(outbox.assert_enqueued("shop.add", args=(1, 2), count=2)) == 2
    outbox.assert_enqueued(add, args=[3, 4], kwargs={"tag": "x"}, count=1)
    # Expected values go through the message's serializer: tuples match JSON lists.
    outbox.assert_enqueued(record, args=("r",), kwargs={"value": (1, (2, 3))})
    outbox.assert_enqueued(record, kwargs={"value": [1, [2, 3]]})


def test_assert_enqueued_fails_listing_what_was_enqueued(outbox: OutboxFixture) -> None:
    with transaction.atomic():
        add.delay(1, 2)
        record.delay("other")
    with pytest.raises(AssertionError) as failure:
        outbox.assert_enqueued(add, args=(5, 6))
    text = str(failure.value)
    assert (
        "Expected shop.add(5, 6, **) to be enqueued at least once, found it 0 time(s)."
        in text
    )
    assert "shop.add with other arguments:\n  - shop.add(1, 2)  [id=" in text
    assert "Everything in the outbox (2):" in text
    assert "shop.record('other')" in text


def test_assert_enqueued_fails_on_a_wrong_count(outbox: OutboxFixture) -> None:
    with transaction.atomic():
        add.delay(1, 2)
        add.delay(1, 2)
    with pytest.raises(
        AssertionError, match=r"enqueued 1 time\(s\), found it 2 time\(s\)"
    ):
        outbox.assert_enqueued(add, args=(1, 2), count=1)


def test_assert_enqueued_fails_on_an_empty_outbox(outbox: OutboxFixture) -> None:
    with pytest.raises(AssertionError) as failure:
        outbox.assert_enqueued("shop.record", kwargs={"tag": "x"})
    assert "Expected shop.record(*, tag='x')" in str(failure.value)
    assert "Everything in the outbox (0):\n  (nothing)" in str(failure.value)


def test_assert_not_enqueued(outbox: OutboxFixture) -> None:
    with transaction.atomic():
        add.delay(1, 2)
    outbox.assert_not_enqueued(record)
    outbox.assert_not_enqueued(add, args=(2, 1))
    with pytest.raises(AssertionError) as failure:
        outbox.assert_not_enqueued(add, args=(1, 2))
    text = str(failure.value)
    assert "Expected shop.add(1, 2, **) not to be enqueued, found it 1 time(s):" in text
    assert "  - shop.add(1, 2)  [id=" in text


def test_a_rolled_back_call_is_not_enqueued(outbox: OutboxFixture) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        record.delay("never")
        raise RuntimeError("roll back")
    outbox.assert_not_enqueued(record)


# -- drain ----------------------------------------------------------------------


@BOTH_MODES
def test_drain_publishes_everything_through_the_relay(
    mode: str, alias: str, outbox: OutboxFixture, outbox_broker: InMemoryPublisher
) -> None:
    with transaction.atomic(using=alias):
        ids = [record.delay(f"t{i}").id for i in range(5)]
    published = outbox.drain()
    assert [e.task_id for e in published] == ids
    assert outbox_broker.published == published
    assert outbox.messages == []
    assert outbox.drain() == []
    assert [m.args for m in outbox.drained_messages()] == [(f"t{i}",) for i in range(5)]


@ALL
def test_the_outbox_drain_fixture_takes_any_publisher(
    alias: str, outbox_drain: Any, outbox: OutboxFixture
) -> None:
    mine = InMemoryPublisher()
    with transaction.atomic(using=alias):
        record.delay("mine")
    published = outbox_drain(mine)
    assert mine.task_names() == ["shop.record"]
    assert published == mine.published
    assert outbox.broker.published == []


def refuse_poison(message: StoredMessage) -> PublishResult | None:
    if "poison" in message.envelope.arguments_preview:
        return PublishResult(message.id, Outcome.FAILED, "PreconditionFailed: too big")
    return None


@ALL
def test_a_drain_that_cannot_publish_fails_naming_the_message(
    alias: str, outbox: OutboxFixture
) -> None:
    with transaction.atomic(using=alias):
        record.delay("fine")
        record.delay("poison")
    with pytest.raises(OutboxDrainError) as failure:
        outbox.drain(InMemoryPublisher(refuse_poison))
    text = str(failure.value)
    assert "published 1 message(s), but 1 were not confirmed" in text
    assert "shop.record('poison')" in text
    assert "failed PreconditionFailed: too big" in text


@ALL
def test_a_lenient_drain_leaves_refused_messages_to_the_retry_policy(
    alias: str, outbox: OutboxFixture
) -> None:
    with transaction.atomic(using=alias):
        record.delay("fine")
        record.delay("poison")
    published = outbox.drain(InMemoryPublisher(refuse_poison), strict=False)
    assert [e.arguments_preview for e in published] == ["args=('fine',) kwargs={}"]
    [left] = outbox.messages
    assert left.args == ("poison",)


@pytest.mark.django_db(transaction=True)
def test_drain_to_the_real_broker(outbox: OutboxFixture) -> None:
    queue = f"celery-outbox-plugin-{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        sent = record.apply_async(("real",), queue=queue)
    try:
        published = outbox.drain(broker="real")
        assert [e.task_id for e in published] == [sent.id]
        with Connection(BROKER_AMQP, connect_timeout=5) as conn:
            received = conn.SimpleQueue(queue, no_ack=True).get(timeout=10)
        assert received.headers["id"] == sent.id
        assert received.decode()[0] == ["real"]
    finally:
        with Connection(BROKER_AMQP, connect_timeout=5) as conn:
            conn.default_channel.queue_delete(queue)


# -- run_enqueued ---------------------------------------------------------------


@BOTH_MODES
def test_run_enqueued_runs_tasks_and_what_they_enqueue(
    mode: str, alias: str, outbox: OutboxFixture
) -> None:
    with transaction.atomic(using=alias):
        parent = spawn.delay("p")
        add.delay(2, 3, tag="sum")
    runs = outbox.run_enqueued()
    assert [(r.message.task_name, r.state) for r in runs] == [
        ("shop.spawn", "SUCCESS"),
        ("shop.add", "SUCCESS"),
        ("shop.record", "SUCCESS"),
    ]
    assert runs[0].message.task_id == parent.id
    assert [r.value for r in runs] == ["p", 5, "p-child"]
    assert tags() == ["p", "p-child", "sum"]
    assert outbox.messages == []


def test_run_enqueued_follows_chains_and_links(outbox_run: Any) -> None:
    with transaction.atomic():
        chain(
            add.s(1, 2, tag="one"), add.s(3, tag="two"), add.s(4, tag="three")
        ).delay()
        add.apply_async((5, 5), {"tag": "linked"}, link=record.s())
    runs = outbox_run()
    assert sorted((r.message.task_name, r.value) for r in runs) == [
        ("shop.add", 3),
        ("shop.add", 6),
        ("shop.add", 10),
        ("shop.add", 10),
        ("shop.record", "10"),
    ]
    assert tags() == ["10", "linked", "one", "three", "two"]


def test_run_enqueued_fails_when_tasks_keep_enqueueing(outbox: OutboxFixture) -> None:
    with transaction.atomic():
        spawn.delay("loop")
    with pytest.raises(AssertionError) as failure:
        outbox.run_enqueued(max_rounds=1)
    text = str(failure.value)
    assert "still being enqueued after 1 round(s)" in text
    assert "shop.record('loop-child')" in text


def test_run_enqueued_propagates_a_task_error(outbox: OutboxFixture) -> None:
    with transaction.atomic():
        add.delay("a", 1)
    with pytest.raises(TypeError):
        outbox.run_enqueued()


def test_run_enqueued_can_report_failures_instead(outbox: OutboxFixture) -> None:
    with transaction.atomic():
        add.delay("a", 1)
    [run] = outbox.run_enqueued(propagate=False)
    assert run.state == "FAILURE"
    assert isinstance(run.value, TypeError)


def test_run_enqueued_refuses_an_unknown_task(
    outbox: OutboxFixture, outbox_app: Any
) -> None:
    with transaction.atomic():
        outbox_app.send_task("shop.does_not_exist", args=(1,))
    with pytest.raises(
        LookupError, match=r"'shop.does_not_exist' .* is not registered"
    ):
        outbox.run_enqueued()


def test_assert_enqueued_accepts_mock_any(outbox: OutboxFixture) -> None:
    with transaction.atomic():
        add.delay(1, 2, tag="generated-tag")
    outbox.assert_enqueued(add, args=(1, ANY), kwargs={"tag": ANY})
    with pytest.raises(AssertionError, match=r"found it 0 time\(s\)"):
        outbox.assert_enqueued(add, args=(ANY,))


def test_filter_returns_the_matching_messages(outbox: OutboxFixture) -> None:
    with transaction.atomic():
        add.delay(1, 2)
        add.delay(3, 4)
        record.delay("r")
    assert [m.args for m in outbox.filter(add)] == [(1, 2), (3, 4)]
    assert [m.args for m in outbox.filter(args=("r",))] == [("r",)]
    assert outbox.filter("shop.add", kwargs={"tag": "x"}) == []


# -- a worker's view, the relay's signals ------------------------------------------


def test_run_enqueued_gives_a_task_the_lineage_a_worker_would(
    outbox: OutboxFixture,
) -> None:
    with transaction.atomic():
        parent = spawn_child.delay("p", atomic=True)
    outbox.run_enqueued()
    child = TaskRun.objects.get(tag="p-child")
    assert child.value == repr({"parent_id": parent.id, "root_id": parent.id})


def test_run_enqueued_keeps_the_lineage_the_message_names(
    outbox: OutboxFixture,
) -> None:
    with transaction.atomic():
        trace.apply_async(("deep",), parent_id="step-2", root_id="step-1")
        trace.delay("first")
    outbox.run_enqueued()
    assert TaskRun.objects.get(tag="deep").value == repr(
        {"parent_id": "step-2", "root_id": "step-1"}
    )
    first = TaskRun.objects.get(tag="first")
    assert first.value == repr({"parent_id": None, "root_id": first.task_id})


def test_drain_sends_the_relays_django_signals(outbox: OutboxFixture) -> None:
    published: list[str] = []

    def receiver(sender: Any, task_id: str, **kwargs: Any) -> None:
        published.append(task_id)

    signals.message_published.connect(receiver)
    try:
        with transaction.atomic():
            sent = record.delay("signalled")
        outbox.drain()
    finally:
        signals.message_published.disconnect(receiver)
    assert published == [sent.id]


@ALL
def test_drain_publishes_scheduled_tasks_too_unless_told_not_to(
    alias: str, outbox: OutboxFixture
) -> None:
    """An ETA an hour away waits in the outbox; a test does not wait for it."""
    with transaction.atomic(using=alias):
        later = record.apply_async(("later",), countdown=3600)
    assert outbox.drain(scheduled=False) == []
    assert [m.task_id for m in outbox.messages] == [later.id]
    (published,) = outbox.drain()
    assert published.task_id == later.id
    assert outbox.messages == []
    with transaction.atomic(using=alias):
        again = record.apply_async(("again",), countdown=3600)
    (run,) = outbox.run_enqueued()  # ETAs are not waited for
    assert (run.message.task_id, run.state) == (again.id, "SUCCESS")
