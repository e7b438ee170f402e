"""Events against a real database and RabbitMQ: firing writes one row in the caller's
transaction; the topology is declared idempotently; the archive can be listed,
replayed and purged."""

from __future__ import annotations

import io
import json
import logging
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.db import transaction
from django.test import override_settings
from kombu import Connection

from celery_outbox import OutboxCelery
from celery_outbox.broker import build_publisher
from celery_outbox.conf import get_settings
from celery_outbox.events import DELIVER_TASK, EVENT_HEADER, archive, dbarchive
from celery_outbox.events.declare import declare
from celery_outbox.events.modes import Retries
from celery_outbox.events.registry import registry_of
from celery_outbox.events.topology import ServiceTopology
from celery_outbox.exceptions import OutboxConfigurationError
from celery_outbox.inbox.signals import duplicate_skipped
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.signals import message_created
from celery_outbox.store import Stores
from tests.events_project.catalog import declare_events
from tests.project.shop.models import TaskRun

from ..conftest import BROKER_AMQP, BROKER_REDIS

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def exchange() -> Iterator[str]:
    """A unique events exchange; every queue and exchange under it is deleted after."""
    name = f"test-events-{uuid.uuid4().hex[:8]}"
    with override_settings(
        CELERY_OUTBOX_EVENTS_EXCHANGE=name, CELERY_OUTBOX_EVENTS_MAX_RETRIES=2
    ):
        yield name
    delete_topology(name, ["billing"], 2)


@pytest.fixture(name="order_created")
def order_created_fixture() -> Iterator[Any]:
    """``order.created`` on a shop app of this test only: an app left alive would
    make the in-process relay of later tests unable to tell which app is theirs."""
    app = OutboxCelery("shop", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    yield declare_events(app)


def delete_topology(
    name: str, services: list[str], steps: int, patterns: tuple[str, ...] = ("order.*",)
) -> None:
    with Connection(BROKER_AMQP, connect_timeout=5) as connection:
        channel = connection.channel()
        queues = [f"{name}:unrouted"]
        exchanges = [name, f"{name}:unrouted"]
        for service in services:
            prefix = f"{name}:{service}"
            queues += [f"{prefix}:{p}" for p in patterns] + [f"{prefix}:archive"]
            queues += [f"{prefix}:retry:{n}" for n in range(steps)]
            exchanges += [f"{prefix}:recover", f"{prefix}:archive"]
            exchanges += [f"{prefix}:retry:{n}" for n in range(steps)]
        for queue in queues:
            channel.queue_delete(queue)
        for each in exchanges:
            channel.exchange_delete(each)
        channel.close()


def test_fire_writes_one_row_to_the_events_exchange(
    exchange: str, order_created: Any
) -> None:
    with transaction.atomic():
        order_created(7, "9.90")
    (row,) = OutboxMessage.objects.all()
    assert row.exchange == exchange
    assert row.routing_key == "order.created"
    assert row.task_name == "celery_outbox.events.deliver"
    assert json.loads(row.headers)["outbox_event"] == "order.created"
    assert f"{exchange}:unrouted" in row.declare_queues


def test_validation_error_and_rollback_write_nothing(
    exchange: str, order_created: Any
) -> None:
    with pytest.raises(ValueError, match="negative"), transaction.atomic():
        order_created(-1, "0")
    with pytest.raises(RuntimeError), transaction.atomic():
        order_created.fire(1, "1")
        raise RuntimeError("roll back")
    assert OutboxMessage.objects.count() == 0


def test_declare_is_idempotent_and_a_changed_queue_is_explained(exchange: str) -> None:
    topology = ServiceTopology(get_settings(), "billing", ("order.*",))
    with Connection(BROKER_AMQP, connect_timeout=5) as connection:
        declare(connection, topology.all_queues(), get_settings())
        declare(connection, topology.all_queues(), get_settings())
        assert archive.stats(connection, topology)[topology.archive_name] == 0
        with override_settings(CELERY_OUTBOX_EVENTS_ARCHIVE_MAX_LENGTH=5):
            changed = ServiceTopology(get_settings(), "billing", ("order.*",))
            with pytest.raises(OutboxConfigurationError, match="exists with other"):
                declare(connection, changed.all_queues(), get_settings())


def test_an_event_nobody_handles_is_not_refused_by_the_broker(exchange: str) -> None:
    """The relay publishes with ``mandatory``: the alternate exchange takes it."""
    import amqp

    topology = ServiceTopology(get_settings(), "billing", ("order.*",))
    with Connection(BROKER_AMQP, connect_timeout=5) as connection:
        declare(connection, topology.all_queues(), get_settings())
        returned: list[Any] = []
        channel = connection.channel()
        channel.events["basic_return"].add(lambda *a: returned.append(a))
        channel.basic_publish_confirm(
            amqp.Message(b"{}"),
            exchange=exchange,
            routing_key="nobody.cares",
            mandatory=True,
        )
        channel.close()
    assert returned == []


def test_archive_list_replay_and_purge(exchange: str) -> None:
    import amqp

    topology = ServiceTopology(get_settings(), "billing", ("order.*",))
    queue = topology.queue_name("order.*")
    with Connection(BROKER_AMQP, connect_timeout=5) as connection:
        declare(connection, topology.all_queues(), get_settings())
        channel = connection.channel()
        for number in range(3):
            headers = {
                "id": f"id-{number}",
                "outbox_event": f"order.e{number}",
                "retries": 2,
                "outbox_error": "boom",
            }
            channel.basic_publish_confirm(
                amqp.Message(b"[]", application_headers=headers),
                exchange=topology.archive_name,
                routing_key=queue,
            )
        channel.close()
        assert archive.count(connection, topology) == 3
        listed = archive.list_archive(connection, topology)
        assert [(e.id, e.queue, e.retries, e.error) for e in listed] == [
            (f"id-{n}", queue, 2, "boom") for n in range(3)
        ]
        assert archive.count(connection, topology) == 3  # listing took nothing
        progress: list[tuple[int, int]] = []
        result = archive.replay(
            connection,
            topology,
            ids=["id-1"],
            on_progress=lambda *a: progress.append(a),
        )
        assert (result.replayed, result.left) == (1, 2)
        assert progress == [(1, 3)]
        result = archive.replay(connection, topology, event="order.e2")
        assert result.replayed == 1
        assert archive.count(connection, topology) == 1
        channel = connection.channel()
        back = [channel.basic_get(queue, no_ack=True) for _ in range(2)]
        channel.close()
        assert sorted(m.headers["id"] for m in back) == ["id-1", "id-2"]
        assert all(
            m.headers["retries"] == 0 and "outbox_error" not in m.headers for m in back
        )
        assert archive.purge(connection, topology) == 1
        assert archive.count(connection, topology) == 0


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_a_retried_message_comes_back_to_its_own_queue_only(
    exchange: str, queue_type: str
) -> None:
    """Retry step 0 holds it 1 s, then the recover exchange routes it back by the
    queue's name: to the queue it failed in, not to the service's other queues."""
    import time

    import amqp

    with override_settings(CELERY_OUTBOX_EVENTS_QUEUE_TYPE=queue_type):
        topology = ServiceTopology(get_settings(), "billing", ("order.*", "pay.*"))
        with Connection(BROKER_AMQP, connect_timeout=5) as connection:
            try:
                declare(connection, topology.all_queues(), get_settings())
                channel = connection.channel()
                sent = time.monotonic()
                channel.basic_publish_confirm(
                    amqp.Message(b"[]", application_headers={"id": "r"}),
                    exchange=topology.retry_exchange(0).name,
                    routing_key=topology.queue_name("order.*"),
                )
                message = None
                while message is None and time.monotonic() - sent < 10:
                    time.sleep(0.05)
                    message = channel.basic_get(
                        topology.queue_name("order.*"), no_ack=True
                    )
                waited = time.monotonic() - sent
                assert message is not None and message.headers["id"] == "r"
                assert 0.9 <= waited <= 1.6
                other = channel.basic_get(topology.queue_name("pay.*"), no_ack=True)
                assert other is None
                channel.close()
            finally:
                delete_topology(exchange, ["billing"], 2, ("order.*", "pay.*"))


# -- Retries held by the database: Redis ("auto"), and RabbitMQ when the setting says
# "database". One copy per bound service queue; retries and archive in the outbox.


class HeldServices:
    """Service apps of one test on one broker, under an exchange of this test only."""

    def __init__(self, exchange: str, broker: str) -> None:
        self.exchange = exchange
        self.broker = broker
        self.on_redis = broker.startswith("redis://")
        self.tag = exchange.rsplit("-", 1)[-1]
        self.apps: list[OutboxCelery] = []
        self.services: list[str] = []

    def app(self, service: str) -> OutboxCelery:
        app = OutboxCelery(f"{service}-{self.tag}", set_as_current=False)
        app.config_from_object("django.conf:settings", namespace="CELERY")
        # The namespaced name: before Celery 5.7, CELERY_BROKER_URL from the
        # settings wins over a plain broker_url.
        app.conf.update(CELERY_BROKER_URL=self.broker)
        self.apps.append(app)
        self.services.append(app.main)
        return app

    def declare(self, app: OutboxCelery) -> ServiceTopology:
        topology = registry_of(app).topology()
        with Connection(self.broker) as connection:
            retries = declare(
                connection, topology.all_queues(), get_settings(), topology.service
            )
        assert retries is Retries.DATABASE
        return topology

    def ids_in(self, queue: str) -> list[int]:
        """The order ids of the event messages waiting in a queue (taken from it)."""
        found: list[int] = []
        with Connection(self.broker) as connection:
            channel: Any = connection.default_channel
            while (message := channel.basic_get(queue, no_ack=True)) is not None:
                found.append(json.loads(message.body)[0][0])
        return sorted(found)

    def cleanup(self) -> None:
        if not self.on_redis:
            patterns = ("order.*", "order.created")
            delete_topology(self.exchange, self.services, 0, patterns)
            return
        client = redis.Redis.from_url(self.broker)
        for pattern in (f"{self.exchange}*", f"_kombu.binding*{self.exchange}*"):
            for key in client.scan_iter(pattern):
                client.delete(key)
        client.close()


@pytest.fixture(
    params=[(BROKER_REDIS, "auto"), (BROKER_AMQP, "database")],
    ids=["redis", "rabbitmq-database"],
)
def held(request: pytest.FixtureRequest) -> Iterator[HeldServices]:
    broker, retries = request.param
    name = f"test-events-{uuid.uuid4().hex[:8]}"
    with override_settings(
        CELERY_OUTBOX_EVENTS_EXCHANGE=name,
        CELERY_OUTBOX_EVENTS_MAX_RETRIES=2,
        CELERY_OUTBOX_EVENTS_RETRIES=retries,
    ):
        services = HeldServices(name, broker)
        try:
            yield services
        finally:
            services.cleanup()


def relay_until_empty(app: OutboxCelery) -> None:
    """Publish every due row with ``app``'s broker, as ``outbox relay`` would."""
    settings = get_settings()
    publisher = build_publisher(app, settings)
    try:
        config = RelayConfig.from_settings(settings, until_empty=True)
        Relay(Stores("default").relay(), publisher, config, observers=()).run()
    finally:
        publisher.close()


def test_held_each_service_gets_its_own_copy_of_every_committed_event(
    held: HeldServices, caplog: pytest.LogCaptureFixture
) -> None:
    billing_app = held.app("billing")
    registry_of(billing_app).add_subscriber("order.*", _record_effect)
    with caplog.at_level(logging.WARNING, logger="celery_outbox.events"):
        billing = held.declare(billing_app)
    # Said at start when the choice was ours (auto on Redis), not when it was asked for.
    warned = "broker-side retries are not available" in caplog.text
    assert warned is held.on_redis
    shipping_app = held.app("shipping")
    registry_of(shipping_app).add_subscriber("order.created", _record_effect)
    shipping = held.declare(shipping_app)
    shop = held.app("shop")
    order_created = declare_events(shop)
    for number in range(1, 6):
        with transaction.atomic():
            order_created(number, "9.90")
            if number == 3:
                transaction.set_rollback(True)
    relay_until_empty(shop)
    assert OutboxMessage.objects.count() == 0
    for topology, pattern in ((billing, "order.*"), (shipping, "order.created")):
        assert held.ids_in(topology.queue_name(pattern)) == [1, 2, 4, 5]


def _record_effect(order_id: int, *rest: object) -> None:
    TaskRun.objects.create(task_id=str(order_id), task_name="effect", tag="effect")


def effects() -> int:
    """Effects the subscribers committed (the test project also records skips)."""
    return int(TaskRun.objects.filter(task_name="effect").count())


def flaky(failures: int, calls: list[int]) -> Callable[..., None]:
    """A subscriber that fails its first ``failures`` calls; each call writes its effect
    first, so a rolled-back failure shows as a missing row."""

    def on_order(order_id: int, *rest: object) -> None:
        calls.append(order_id)
        _record_effect(order_id)
        if len(calls) <= failures:
            raise RuntimeError(f"failure {len(calls)}")

    return on_order


def deliver_once(app: OutboxCelery, event_id: str, retries: int) -> Any:
    """Run the delivering task as a worker would for one copy of ``order.created``."""
    task = app.tasks[DELIVER_TASK]
    return task.apply(
        args=(7, "9.90"),
        task_id=event_id,
        retries=retries,
        headers={EVENT_HEADER: "order.created"},
        throw=True,
    )


def test_held_a_failed_subscriber_is_retried_through_the_outbox_then_archived(
    held: HeldServices,
) -> None:
    app = held.app("billing")
    registry_of(app).add_subscriber("order.*", flaky(99, []))
    topology = held.declare(app)
    queue = topology.queue_name("order.*")
    event_id = str(uuid.uuid4())
    for retries in range(2):
        deliver_once(app, event_id, retries)
        (row,) = OutboxMessage.objects.all()
        headers = json.loads(row.headers)
        assert (row.task_id, row.exchange, row.routing_key) == (event_id, "", queue)
        assert headers["retries"] == retries + 1
        assert headers[EVENT_HEADER] == "order.created"
        delay = (row.available_at - row.created_at).total_seconds()
        assert abs(delay - 2**retries) < 0.05, delay
        # Due now: the relay sends it to the failing subscriber's queue only.
        Stores("default").operator().retry_now([row.id])
        relay_until_empty(app)
        assert held.ids_in(queue) == [7]
    assert effects() == 2  # each failure committed its effect (no inbox)
    deliver_once(app, event_id, 2)  # the last step: archived
    assert OutboxMessage.objects.count() == 0
    assert dbarchive.count(topology) == 1
    (archived,) = dbarchive.list_archive(topology)
    assert (archived.id, archived.event, archived.queue) == (
        event_id,
        "order.created",
        queue,
    )
    assert archived.retries == 2 and "failure 3" in archived.error
    other = ServiceTopology(get_settings(), f"shipping-{held.tag}", ())
    assert dbarchive.count(other) == 0  # another service's archive is its own
    result = dbarchive.replay(topology, event="order.*")
    assert (result.replayed, result.left) == (1, 0)
    (row,) = OutboxMessage.objects.all()
    assert (row.task_id, row.routing_key) == (event_id, queue)
    assert json.loads(row.headers)["retries"] == 0  # a fresh count
    assert dbarchive.count(topology) == 0


def test_held_a_retry_written_to_the_outbox_sends_message_created(
    held: HeldServices,
) -> None:
    app = held.app("billing")
    registry_of(app).add_subscriber("order.*", flaky(99, []))
    topology = held.declare(app)
    event_id = str(uuid.uuid4())
    seen: list[tuple[str, str, str]] = []

    def receiver(task_id: str, task_name: str, queue: str, **kwargs: Any) -> None:
        seen.append((task_id, task_name, queue))

    message_created.connect(receiver)
    try:
        deliver_once(app, event_id, 0)
    finally:
        message_created.disconnect(receiver)
    (row,) = OutboxMessage.objects.all()
    assert seen == [(event_id, DELIVER_TASK, topology.queue_name("order.*"))]
    assert row.queue == topology.queue_name("order.*")


#: The app ``outbox events --app`` imports in the command test (set only during it:
#: an app left alive would make the relay and the checks of later tests guess).
command_app: OutboxCelery | None = None


def test_the_archive_commands_work_on_the_dead_letters(
    held: HeldServices, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``outbox events stats|inspect|replay|purge`` when the database holds the
    retries: the service's dead letters, and only its own."""
    from django.core.management import call_command

    def events(*args: str) -> str:
        out = io.StringIO()
        with override_settings(CELERY_OUTBOX_EVENTS_RETRIES="database"):
            call_command(
                "outbox", "events", "--app", f"{__name__}.command_app",
                *args, stdout=out,
            )  # fmt: skip
        return out.getvalue()

    app = held.app("billing")
    registry_of(app).add_subscriber("order.*", flaky(99, []), max_retries=0)
    held.declare(app)
    monkeypatch.setattr(sys.modules[__name__], "command_app", app)

    def archived() -> int:
        counts = json.loads(events("stats", "--format", "json"))
        return int(counts["outbox: archived (dead letters)"])

    other = held.app("shipping")
    registry_of(other).add_subscriber("order.*", flaky(99, []), max_retries=0)
    ids = [str(uuid.uuid4()) for _ in range(3)]
    for event_id in ids:
        deliver_once(app, event_id, 0)  # no retry steps: archived at once
    deliver_once(other, str(uuid.uuid4()), 0)
    assert archived() == 3
    listed = events("inspect")
    assert sorted(line.split("\t")[0] for line in listed.splitlines()) == sorted(ids)
    assert "order.created" in listed and "failure 1" in listed
    assert "replayed 1, left 2" in events("replay", ids[0])
    (row,) = OutboxMessage.objects.all()
    assert row.task_id == ids[0]
    assert "purged 2" in events("purge", "--all")
    assert archived() == 0
    assert DeadLetter.objects.count() == 1  # shipping's is left alone
    stats = events("stats")
    assert "outbox: retries waiting\t1" in stats
    assert "outbox: archived (dead letters)\t0" in stats


def test_a_retry_that_cannot_be_written_is_requeued_by_name_not_dropped(
    held: HeldServices,
) -> None:
    """Redis drops a message rejected without requeue, and one requeued when it came
    through the events exchange (kombu restores it by a routing the worker's
    channel does not know): the worker publishes it again to its queue, as it came."""
    app = held.app("billing")
    registry_of(app).add_subscriber("order.*", flaky(99, []))
    topology = held.declare(app)
    with override_settings(CELERY_OUTBOX_DATABASE="no-such-alias"):
        result = deliver_once(app, str(uuid.uuid4()), 0)
    assert result.state == "SUCCESS"  # acknowledged: its copy is in the queue
    assert held.ids_in(topology.queue_name("order.*")) == [7]


@pytest.mark.parametrize("everywhere", [False, True])
def test_a_subscriber_with_the_inbox_runs_once_per_event(
    held: HeldServices, everywhere: bool
) -> None:
    """Delivered twice: one effect. Failing twice then succeeding: one effect (each
    failure rolled back its effect with the inbox row, so the retry ran it again)."""
    app = held.app("billing")
    calls: list[int] = []
    options: dict[str, Any] = {} if everywhere else {"inbox": True}
    skipped: list[dict[str, Any]] = []

    def on_skip(**kwargs: Any) -> None:
        skipped.append(kwargs)

    duplicate_skipped.connect(on_skip)
    try:
        with override_settings(CELERY_OUTBOX_INBOX=everywhere):
            registry_of(app).add_subscriber("order.*", flaky(2, calls), **options)
            event_id = str(uuid.uuid4())
            for retries in range(3):
                deliver_once(app, event_id, retries)
            deliver_once(app, event_id, 0)  # the same event delivered again
            deliver_once(app, event_id, 0)
    finally:
        duplicate_skipped.disconnect(on_skip)
    assert len(calls) == 3
    assert effects() == 1
    assert OutboxMessage.objects.count() == 2  # the two retries, nothing archived
    assert len(skipped) == 2 and skipped[0]["key"] == event_id
    subscriber = f"{__name__}.flaky.<locals>.on_order"
    assert skipped[0]["task_name"] == f"billing-{held.tag}:{subscriber}"


def test_another_service_handling_the_same_event_has_its_own_inbox_key(
    held: HeldServices,
) -> None:
    event_id = str(uuid.uuid4())
    for service in ("billing", "shipping"):
        app = held.app(service)
        registry_of(app).add_subscriber("order.*", _record_effect, inbox=True)
        deliver_once(app, event_id, 0)
        deliver_once(app, event_id, 0)
    assert effects() == 2


# -- How a subscriber ends its event: Ignore ends it, Reject(requeue=False) rejects
# it (archived), Reject(requeue=True) asks for a retry.


def ends_with(
    ending: Callable[[], BaseException], calls: list[int]
) -> Callable[..., None]:
    """A subscriber that writes its effect, then raises ``ending()`` (made at each
    call: one kept in the subscriber would keep its traceback's frames alive)."""

    def on_order(order_id: int, *rest: object) -> None:
        calls.append(order_id)
        _record_effect(order_id)
        raise ending()

    return on_order


@pytest.mark.parametrize("inbox", [True, False], ids=["inbox", "no-inbox"])
def test_a_subscriber_that_ignores_its_event_ends_it_and_keeps_its_effect(
    held: HeldServices, inbox: bool
) -> None:
    """``Ignore``: the subscriber chose to end without a result. Nothing is retried
    or archived, and through the inbox its effect commits with the row, so another
    delivery of the event is skipped."""
    from celery.exceptions import Ignore

    app = held.app("billing")
    calls: list[int] = []
    registry_of(app).add_subscriber("order.*", ends_with(Ignore, calls), inbox=inbox)
    topology = held.declare(app)
    event_id = str(uuid.uuid4())
    assert deliver_once(app, event_id, 0).state == "IGNORED"
    assert not OutboxMessage.objects.exists()  # no retry
    assert dbarchive.count(topology) == 0
    assert effects() == 1
    deliver_once(app, event_id, 0)  # delivered again
    assert len(calls) == (1 if inbox else 2)


def test_a_subscriber_that_rejects_its_event_has_it_archived_at_once(
    held: HeldServices,
) -> None:
    from celery.exceptions import Reject

    app = held.app("billing")

    def rejected() -> Reject:
        return Reject("cannot read it", requeue=False)

    registry_of(app).add_subscriber("order.*", ends_with(rejected, []), inbox=True)
    topology = held.declare(app)
    event_id = str(uuid.uuid4())
    deliver_once(app, event_id, 0)  # retry steps left: not used
    assert not OutboxMessage.objects.exists()
    (archived,) = dbarchive.list_archive(topology)
    assert (archived.id, archived.retries) == (event_id, 0)
    assert archived.error == "reject requeue=False: cannot read it"
    assert effects() == 0  # rolled back with the inbox row: a replay runs it again


def test_a_subscriber_that_requeues_its_event_takes_the_next_step_then_the_archive(
    held: HeldServices,
) -> None:
    """``Reject(requeue=True)``: retried on the lane's schedule whatever
    ``retry_for`` says (never at once and for ever), archived after the last step."""
    from celery.exceptions import Reject

    app = held.app("billing")

    def requeued() -> Reject:
        return Reject("not now", requeue=True)

    registry_of(app).add_subscriber(
        "order.*", ends_with(requeued, []), retry_for=(KeyError,)
    )
    topology = held.declare(app)
    event_id = str(uuid.uuid4())
    deliver_once(app, event_id, 0)
    (row,) = OutboxMessage.objects.all()
    assert json.loads(row.headers)["retries"] == 1
    row.delete()
    deliver_once(app, event_id, 2)  # the last step used
    assert not OutboxMessage.objects.exists()
    (archived,) = dbarchive.list_archive(topology)
    assert (archived.id, archived.retries) == (event_id, 2)
    assert "not now" in archived.error
