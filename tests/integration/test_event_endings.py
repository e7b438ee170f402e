"""The endings of a delivery that a worker's main process sees, on a real broker.

A hard time limit and a lost process end a delivery outside the process that ran
it; Celery then tells the main process's request (``on_failure``, then
``on_timeout`` for a time limit, as billiard's pool calls them), and each Celery
line acks, rejects or requeues the message its own way. Here the delivering task's
own request class is built from a message taken from the subscriber's queue, as the
worker's consumer builds it, and told each ending as the pool tells it: the retry
takes the lane's next step (on RabbitMQ's TTL queues, or an outbox row when the
database holds the retries) and the message is acknowledged, on every Celery line.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from billiard.einfo import ExceptionInfo
from celery import Celery
from celery.exceptions import TimeLimitExceeded, WorkerLostError
from celery.utils.imports import symbol_by_name
from django.test import override_settings
from kombu import Connection, Queue

from celery_outbox import OutboxCelery
from celery_outbox.broker.topics import use_rabbit_topics
from celery_outbox.conf import get_settings
from celery_outbox.events import DELIVER_TASK, EVENT_HEADER, archive, dbarchive
from celery_outbox.events.declare import declare
from celery_outbox.events.registry import registry_of
from celery_outbox.events.topology import ServiceTopology, events_exchange
from celery_outbox.models import OutboxMessage

from ..conftest import BROKER_AMQP, BROKER_REDIS
from .test_events import delete_topology

pytestmark = pytest.mark.django_db(transaction=True)

#: Retry steps of the subscriber.
STEPS = 2


def on_order(order_id: int, *rest: object) -> None:
    """The subscriber; never run here: its delivery ends outside any process."""


@dataclass
class Service:
    """One service on one broker, its subscriber to ``order.*`` declared."""

    app: OutboxCelery
    topology: ServiceTopology
    broker: str

    @property
    def queue(self) -> str:
        return self.topology.queue_name("order.*")

    @property
    def on_broker(self) -> bool:
        return self.topology.retries.value == "broker"

    def send(self, retries: int = 0, **options: Any) -> str:
        """Publish one ``order.created`` as the relay does (to the events exchange,
        by the event's name); its id."""
        event_id = str(uuid.uuid4())
        with self.app.connection_for_write() as connection:
            producer = connection.Producer()
            exchange = events_exchange(get_settings())
            exchange(producer.channel).declare()
            use_rabbit_topics(producer.channel)  # Redis: RabbitMQ's routing
            Celery.send_task(
                self.app, DELIVER_TASK, args=[7, "9.90"], task_id=event_id,
                retries=retries, headers={EVENT_HEADER: "order.created"},
                exchange=exchange.name, routing_key="order.created",
                producer=producer, declare=[], ignore_result=True, **options,
            )  # fmt: skip
        return event_id

    def waiting(self) -> list[dict[str, Any]]:
        """The headers of the copies in the subscriber's queue (taken from it)."""
        found = []
        with Connection(self.broker) as connection:
            channel: Any = connection.default_channel
            while (message := channel.basic_get(self.queue, no_ack=True)) is not None:
                found.append(dict(message.headers))
        return found


@pytest.fixture(
    params=[(BROKER_AMQP, "auto"), (BROKER_REDIS, "auto"), (BROKER_AMQP, "database")],
    ids=["rabbitmq", "redis", "rabbitmq-database"],
)
def service(request: pytest.FixtureRequest) -> Iterator[Service]:
    broker, retries = request.param
    exchange = f"test-endings-{uuid.uuid4().hex[:8]}"
    with override_settings(
        CELERY_OUTBOX_EVENTS_EXCHANGE=exchange,
        CELERY_OUTBOX_EVENTS_MAX_RETRIES=STEPS,
        CELERY_OUTBOX_EVENTS_RETRIES=retries,
    ):
        app = OutboxCelery(f"endings-{exchange[-8:]}", set_as_current=False)
        app.config_from_object("django.conf:settings", namespace="CELERY")
        # The namespaced name: before Celery 5.7, CELERY_BROKER_URL from the
        # settings wins over a plain broker_url.
        app.conf.update(CELERY_BROKER_URL=broker)
        # Celery 5.7 would send its own retry of a lost task besides the lane's.
        app.conf.update(CELERY_TASK_RETRY_ON_WORKER_LOST=True)
        registry_of(app).add_subscriber(
            "order.*", on_order, soft_time_limit=1, time_limit=2
        )
        topology = registry_of(app).topology()
        with Connection(broker) as connection:
            declare(connection, topology.all_queues(), get_settings(), app.main)
        try:
            yield Service(app, topology, broker)
        finally:
            if broker == BROKER_AMQP:
                delete_topology(exchange, [app.main], STEPS)
            else:
                client = redis.Redis.from_url(broker)
                for pattern in (f"{exchange}*", f"_kombu.binding*{exchange}*"):
                    for key in client.scan_iter(pattern):
                        client.delete(key)
                client.close()


def delivered(service: Service, connection: Any) -> Any:
    """The delivering task's request of the next copy in the subscriber's queue, as
    the worker's consumer makes it (acks and rejects go to the broker)."""
    task = service.app.tasks[DELIVER_TASK]
    queue = Queue(service.queue, channel=connection.default_channel)
    message = None
    deadline = time.monotonic() + 10
    while message is None and time.monotonic() < deadline:
        message = queue.get(no_ack=False, accept=["json"])
    assert message is not None
    request_class = symbol_by_name(task.Request)
    return request_class(
        message,
        on_ack=message.ack_log_error,
        on_reject=message.reject_log_error,
        app=service.app,
        task=task,
        connection_errors=connection.connection_errors,
    )


def ended(request: Any, exc: BaseException) -> None:
    """Tell ``request`` its run ended with ``exc`` as the prefork pool does."""
    try:
        raise exc
    except type(exc):
        einfo = ExceptionInfo()
    request.on_failure(einfo)
    if isinstance(exc, TimeLimitExceeded):
        request.on_timeout(False, 2.0)


#: How the pool ends a run outside its process. A factory: an exception made once
#: for every test would keep each test's request (and app) alive in its traceback.
ENDINGS = pytest.mark.parametrize(
    "ending",
    [
        lambda: TimeLimitExceeded(2.0),
        lambda: WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL)."),
    ],
    ids=["hard-time-limit", "lost-process"],
)


def next_copy(service: Service, event_id: str) -> dict[str, Any]:
    """The retry of ``event_id``: once it is due, what reaches the subscriber's queue
    (RabbitMQ's TTL queue, or the outbox row the relay would send)."""
    if not service.on_broker:
        (row,) = OutboxMessage.objects.all()
        assert (row.task_id, row.routing_key) == (event_id, service.queue)
        delay = (row.available_at - row.created_at).total_seconds()
        assert abs(delay - 1.0) < 0.05, delay
        return dict(json.loads(row.headers))
    sent = time.monotonic()
    copies: list[dict[str, Any]] = []
    while not copies and time.monotonic() - sent < 10:
        time.sleep(0.05)
        copies = service.waiting()
    (copy,) = copies
    return copy


@ENDINGS
def test_a_delivery_ended_outside_its_process_takes_the_next_retry_step(
    service: Service, ending: Callable[[], BaseException]
) -> None:
    event_id = service.send()
    with Connection(service.broker) as connection:
        request = delivered(service, connection)
        ended(request, ending())
        assert request.acknowledged
    assert service.waiting() == []  # acknowledged: not requeued, not redelivered
    copy = next_copy(service, event_id)
    assert copy["id"] == event_id
    assert copy["retries"] == 1
    # Counted by the lane, not by a rejection (the TTL queue's expiry is no retry).
    assert [d["reason"] for d in copy.get("x-death", [])] in ([], ["expired"])
    assert service.waiting() == []  # one copy, though 5.7 tells a time limit twice


@ENDINGS
def test_a_delivery_ended_outside_its_process_after_the_last_step_is_archived(
    service: Service, ending: Callable[[], BaseException]
) -> None:
    event_id = service.send(retries=STEPS)
    exc = ending()
    with Connection(service.broker) as connection:
        ended(delivered(service, connection), exc)
    assert service.waiting() == []
    if service.on_broker:
        with Connection(service.broker) as connection:
            (kept,) = archive.list_archive(connection, service.topology)
    else:
        (kept,) = dbarchive.list_archive(service.topology)
        assert not OutboxMessage.objects.exists()
    assert (kept.id, kept.retries) == (event_id, STEPS)
    assert type(exc).__name__ in kept.error


def test_a_retry_that_cannot_be_written_is_requeued_by_name(
    service: Service,
) -> None:
    """The database holding the retries is down: the event goes back to its queue,
    as it came. A requeue would lose it on Redis: kombu restores a copy by the
    events exchange's routing, which the worker's channel does not know."""
    if service.on_broker:
        pytest.skip("the broker holds the retries: nothing is written to a database")
    event_id = service.send()
    with (
        override_settings(CELERY_OUTBOX_DATABASE="no-such-alias"),
        Connection(service.broker) as connection,
    ):
        ended(delivered(service, connection), TimeLimitExceeded(2.0))
    (back,) = service.waiting()
    assert back["id"] == event_id and back["retries"] == 0


def test_a_delivery_gets_its_subscribers_time_limits_unless_its_message_has_its_own(
    service: Service,
) -> None:
    service.send()
    service.send(time_limit=30)
    with Connection(service.broker) as connection:
        first, second = delivered(service, connection), delivered(service, connection)
        assert tuple(first.time_limits) == (2, 1)
        assert tuple(second.time_limits) == (30, 1)
        first.acknowledge()
        second.acknowledge()
