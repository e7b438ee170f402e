"""Queues declared as the caller declared them, by a relay whose own app knows nothing of them.

A ``kombu.Queue`` given per call, or through ``task_routes``, may exist only in the
calling process. The relay must declare and route it from what the row stored: the
exchange and its type, the binding keys, the queue's arguments. Each case sends one
task through an outbox app configured like the caller, relays it with a separate
app that has no such queue, and reads the queue with a plain consumer.
"""

from __future__ import annotations

import gc
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.db import transaction
from kombu import Connection, Exchange, Queue, binding

from celery_outbox import OutboxCelery
from celery_outbox import app as outbox_app_module
from celery_outbox.broker import build_publisher
from celery_outbox.conf import get_settings
from celery_outbox.exceptions import OutboxValueError
from celery_outbox.models import OutboxMessage
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.store import outbox_stores
from celery_outbox.store.operator import OperatorQueries

from ..conftest import BROKER_AMQP, BROKER_REDIS
from .test_fidelity import delete_broker_names, receive

pytestmark = pytest.mark.django_db(transaction=True)

BROKERS = {"amqp": BROKER_AMQP, "redis": BROKER_REDIS}


@pytest.fixture(autouse=True)
def _relay_publishes(settings: Any) -> None:
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False


@dataclass(frozen=True)
class Names:
    queue: str
    other: str
    exchange: str

    @classmethod
    def new(cls) -> Names:
        tag = uuid.uuid4().hex[:12]
        return cls(f"decl-{tag}", f"decl-{tag}-other", f"decl-{tag}-ex")


#: (what the caller configures, what it passes per call, the queue to read).
Setup = Callable[[Names], tuple[dict[str, Any], dict[str, Any]]]


def per_call_topic(n: Names) -> tuple[dict[str, Any], dict[str, Any]]:
    queue = Queue(n.queue, Exchange(n.exchange, type="topic"), routing_key="orders.*")
    return {}, {"queue": queue, "routing_key": "orders.created"}


def per_call_priority(n: Names) -> tuple[dict[str, Any], dict[str, Any]]:
    queue = Queue(n.queue, queue_arguments={"x-max-priority": 10})
    return {}, {"queue": queue, "priority": 7}


def routed_topic(n: Names) -> tuple[dict[str, Any], dict[str, Any]]:
    queue = Queue(n.queue, Exchange(n.exchange, type="topic"), routing_key="mail.#")
    routes = {"decl.work": {"queue": queue, "routing_key": "mail.receipt.sent"}}
    return {"task_routes": routes}, {}


def per_call_bindings(n: Names) -> tuple[dict[str, Any], dict[str, Any]]:
    exchange = Exchange(n.exchange, type="direct")
    queue = Queue(
        n.queue, bindings=[binding(exchange, "first"), binding(exchange, "second")]
    )
    return {}, {"queue": queue, "exchange": n.exchange, "routing_key": "second"}


CASES: dict[str, Setup] = {
    "per-call-topic-exchange": per_call_topic,
    "per-call-max-priority": per_call_priority,
    "task-routes-topic-exchange": routed_topic,
    "per-call-several-bindings": per_call_bindings,
}


@pytest.fixture
def apps() -> Iterator[
    Callable[[str, dict[str, Any]], tuple[OutboxCelery, OutboxCelery]]
]:
    made: list[OutboxCelery] = []

    def make(broker: str, conf: dict[str, Any]) -> tuple[OutboxCelery, OutboxCelery]:
        caller = OutboxCelery("decl-caller", set_as_current=False)
        caller.conf.update(broker_url=BROKERS[broker], result_backend=None, **conf)
        relay_app = OutboxCelery("decl-relay", set_as_current=False)
        relay_app.conf.update(broker_url=BROKERS[broker], result_backend=None)

        @caller.task(name="decl.work", shared=False)
        def work(*args: Any) -> None:
            return None

        made.extend([caller, relay_app])
        return caller, relay_app

    yield make
    for app in made:
        app.close()
        outbox_app_module._instances.discard(app)
    made.clear()
    gc.collect()


def relay_all(relay_app: OutboxCelery, *, once: bool = False) -> OperatorQueries:
    """Relay what is due with a real relay; the operator's queries on the outbox."""
    settings = get_settings()
    stores = outbox_stores(settings)
    publisher = build_publisher(relay_app, settings)
    relay = Relay(
        stores.relay(), publisher, RelayConfig.from_settings(settings, until_empty=True)
    )
    try:
        relay.run_once() if once else relay.run()
    finally:
        publisher.close()
    return stores.operator()


@pytest.mark.parametrize("broker", ["amqp", "redis"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_relay_declares_the_callers_queue_and_the_message_arrives(
    apps: Any, broker: str, case: str
) -> None:
    names = Names.new()
    conf, options = CASES[case](names)
    caller, relay_app = apps(broker, conf)
    try:
        with transaction.atomic():
            result = caller.tasks["decl.work"].apply_async((1,), **options)
        store = relay_all(relay_app)
        stats = store.stats()
        assert (stats.pending, stats.dead) == (0, 0), stats
        [message] = receive(BROKERS[broker], names.queue, 1)
        assert message.headers["id"] == result.id
        if "priority" in options:
            assert message.properties.get("priority") == options["priority"]
        if broker == "amqp" and case == "per-call-max-priority":
            # Declaring it again with the same arguments succeeds: the relay declared
            # the queue with x-max-priority, not Celery's plain automatic queue.
            with Connection(BROKERS[broker], connect_timeout=5) as conn:
                Queue(names.queue, queue_arguments={"x-max-priority": 10})(
                    conn.default_channel
                ).declare()
    finally:
        delete_broker_names(BROKERS[broker], names, ())  # type: ignore[arg-type]


def test_a_message_redis_cannot_route_fails_instead_of_vanishing(apps: Any) -> None:
    """A named exchange with nothing bound: kombu would drop it; the row stays."""
    names = Names.new()
    caller, relay_app = apps("redis", {})
    with Connection(BROKER_REDIS) as conn:
        Exchange(names.exchange, type="direct")(conn.default_channel).declare()
    with transaction.atomic():
        caller.send_task(
            "decl.work", exchange=names.exchange, routing_key="nobody", declare=[]
        )
    store = relay_all(relay_app, once=True)
    stats = store.stats()
    assert stats.pending == 1, stats
    row = OutboxMessage.objects.get()
    assert row.attempts == 1
    assert "No queue is bound" in row.last_error


def test_a_queue_argument_json_cannot_hold_is_refused_at_the_call(apps: Any) -> None:
    names = Names.new()
    caller, _ = apps("amqp", {})
    queue = Queue(names.queue, queue_arguments={"x-odd": {1, 2}})
    with transaction.atomic(), pytest.raises(OutboxValueError, match=names.queue):
        caller.tasks["decl.work"].apply_async((1,), queue=queue)
    assert outbox_stores().operator().stats().pending == 0
