"""The events part of the benchmark: events fired to two services, on each broker.

For each broker (RabbitMQ, Redis) two services (``billing``, ``shipping``) declare
one handler each (``order.*``, ``order.created``) under an exchange of this run. The
part fires ``order.created`` in transactions of ``PER_COMMIT`` events (the fire cost
is the time per event of those transactions), then drains the outbox with an
in-process relay (``until_empty``) and checks that each service's queue holds every
event exactly once. The drain figure is events per second, each published as one
copy per service (on RabbitMQ the topic exchange makes the copies, on Redis the
relay pushes one per bound list).

Each figure is the median of the repeats. Handler-side figures (handled per second
through real workers, retry delay error) come from the end-to-end tests
(``tests/e2e/test_events.py``), which print them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from bench import env
from bench.run import BenchError, median

SERVICES = (("billing", "order.*"), ("shipping", "order.created"))
#: Events per transaction when firing.
PER_COMMIT = 100


@dataclass(frozen=True)
class EventSizes:
    """Events fired per repeat, and repeats per broker."""

    events: int
    repeats: int

    @classmethod
    def pick(cls, quick: bool, repeats: int | None = None) -> EventSizes:
        sizes = cls(2_000, 1) if quick else cls(10_000, 3)
        if repeats is None:
            return sizes
        return dataclasses.replace(sizes, repeats=max(1, repeats))


@dataclass
class BrokerResult:
    """Samples of one broker: µs per fired event, events drained per second."""

    fire_us: list[float] = dataclasses.field(default_factory=list)
    drain_rate: list[float] = dataclasses.field(default_factory=list)


def bench_events(quick: bool, repeats: int | None = None) -> str:
    """Run the part on both brokers; returns its table."""
    from django.test import override_settings

    sizes = EventSizes.pick(quick, repeats)
    results: dict[str, BrokerResult] = {}
    exchange = f"bench-events-{env.RUN_ID}"
    # Said explicitly: "auto" would warn (rightly) at each Redis declare.
    for kind, retries in (("amqp", "broker"), ("redis", "database")):
        with override_settings(
            CELERY_OUTBOX_EVENTS_EXCHANGE=exchange,
            CELERY_OUTBOX_EVENTS_RETRIES=retries,
            CELERY_OUTBOX_OUTSIDE_TRANSACTION="raise",
        ):
            results[kind] = _run_broker(kind, exchange, sizes)
    return _render(results, sizes)


def _run_broker(kind: str, exchange: str, sizes: EventSizes) -> BrokerResult:
    from celery_outbox import OutboxCelery
    from celery_outbox.conf import get_settings
    from celery_outbox.events.declare import declare
    from celery_outbox.events.modes import resolve
    from celery_outbox.events.topology import ServiceTopology
    from celery_outbox.models import OutboxMessage

    if OutboxMessage.objects.exists():
        raise BenchError("events: the bench outbox is not empty; drain it first")
    shop = OutboxCelery(f"bench-shop-{kind}", set_as_current=False)
    shop.config_from_object("django.conf:settings", namespace="CELERY")
    shop.conf.update(broker_url=env.broker_url(kind))

    @shop.event("order.created")
    def order_created(order_id: int, total: str) -> None:
        """An order was committed."""

    settings = get_settings()
    retries = resolve(settings.events_retries, kind)  # kombu names them alike
    topologies = [
        ServiceTopology(settings, f"bench-{name}-{env.RUN_ID}", (pattern,), retries)
        for name, pattern in SERVICES
    ]
    result = BrokerResult()
    with shop.connection_for_write() as connection:
        for topology in topologies:
            declare(connection, topology.all_queues(), settings, topology.service)
    try:
        for _ in range(sizes.repeats):
            result.fire_us.append(_fire(order_created, sizes.events))
            result.drain_rate.append(_drain(shop, sizes.events))
            for topology, (_, pattern) in zip(topologies, SERVICES, strict=True):
                held = _take(shop, kind, topology.queue_name(pattern))
                if held != sizes.events:
                    raise BenchError(
                        f"events on {kind}: {topology.service} got {held} of "
                        f"{sizes.events} events"
                    )
    finally:
        _forget(shop, kind, exchange, topologies)
    return result


def _fire(order_created: Any, count: int) -> float:
    """Fire ``count`` events in transactions of PER_COMMIT; µs per event."""
    from django.db import transaction

    started = time.perf_counter()
    for first in range(0, count, PER_COMMIT):
        with transaction.atomic():
            for number in range(first, min(first + PER_COMMIT, count)):
                order_created(number, "9.90")
    return (time.perf_counter() - started) * 1e6 / count


def _drain(app: Any, count: int) -> float:
    """Publish the whole outbox with an in-process relay; events per second."""
    from celery_outbox.broker import build_publisher
    from celery_outbox.conf import get_settings
    from celery_outbox.enqueue import outbox_alias
    from celery_outbox.relay.config import RelayConfig
    from celery_outbox.relay.loop import Relay
    from celery_outbox.store import OutboxStore

    settings = get_settings()
    publisher = build_publisher(app, settings)
    try:
        config = RelayConfig.from_settings(settings, until_empty=True)
        relay = Relay(
            OutboxStore(outbox_alias(settings)), publisher, config, listeners=()
        )
        started = time.perf_counter()
        relay.run()
        elapsed = time.perf_counter() - started
    finally:
        publisher.close()
    return count / elapsed


def _take(app: Any, kind: str, queue: str) -> int:
    """How many messages ``queue`` holds; empties it."""
    with app.connection_for_write() as connection:
        if kind == "redis":
            client = connection.default_channel.client
            held = int(client.llen(queue))
            client.delete(queue)
            return held
        channel = connection.default_channel
        held = int(channel.queue_declare(queue, passive=True).message_count)
        channel.queue_purge(queue)
        return held


def _forget(app: Any, kind: str, exchange: str, topologies: list[Any]) -> None:
    """Delete what this part declared on the broker."""
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        if kind == "redis":
            client = channel.client
            for key in client.scan_iter(f"*{exchange}*"):
                client.delete(key)
            return
        for topology in topologies:
            for queue in topology.all_queues():
                channel.queue_delete(queue.name)
        for name in (exchange, f"{exchange}:unrouted"):
            channel.exchange_delete(name)


def _render(results: dict[str, BrokerResult], sizes: EventSizes) -> str:
    labels = {"amqp": "RabbitMQ", "redis": "Redis"}
    lines = [
        f"7. events to two services ({sizes.events:,} fired per repeat, "
        f"{sizes.repeats} repeat(s), medians)",
        f"  {'broker':<10} {'fire (µs/event)':>16} {'relay drain (events/s)':>24} "
        f"{'copies/s':>10}",
    ]
    for kind, result in results.items():
        rate = median(result.drain_rate)
        lines.append(
            f"  {labels[kind]:<10} {median(result.fire_us):>16,.0f} {rate:>24,.0f} "
            f"{rate * len(SERVICES):>10,.0f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    from bench.run import prepare

    prepare()
    print(bench_events("--quick" in sys.argv))
