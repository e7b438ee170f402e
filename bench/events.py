"""The events part of the benchmark: events fired to two services, on each broker.

For each broker (RabbitMQ, Redis) two services (``billing``, ``shipping``) declare
one subscriber each (``order.*``, ``order.created``) under an exchange of this run. The
part fires ``order.created`` in transactions of ``PER_COMMIT`` events (the fire cost
is the time per event of those transactions), then drains the outbox with an
in-process relay (``until_empty``) and checks that each service's queue holds every
event exactly once. The drain figure is events per second, each published as one
copy per service (on RabbitMQ the topic exchange makes the copies, on Redis the
relay pushes one per bound list). Each figure is the median of the repeats.

Then, end to end (``bench.events_e2e``): a relay process and one worker process per
service handle events fired to both services, in transactions of ``PER_COMMIT`` and
in one burst (handled/s, from the first commit to the last handled), and a subscriber failing three times measures the retry delays
against the steps 1, 2 and 4 s: held by RabbitMQ's TTL queues, by the database on
Redis. One run per broker.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from bench import env
from bench.events_e2e import STEPS as E2E_STEPS
from bench.events_e2e import E2EResult, E2ESizes, forget, run_broker
from bench.harness import BenchError, median, prepare

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
        # 5,000 (not 10,000) per repeat keeps the whole part, end to end included,
        # under about 90 s on a busy machine.
        sizes = cls(2_000, 1) if quick else cls(5_000, 3)
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
    e2e_sizes = E2ESizes.pick(quick)
    e2e: dict[str, E2EResult] = {}
    e2e_exchange = f"bench-events-e2e-{env.RUN_ID}"
    for kind, retries in (("amqp", "broker"), ("redis", "database")):
        with override_settings(
            CELERY_OUTBOX_EVENTS_EXCHANGE=e2e_exchange,
            CELERY_OUTBOX_EVENTS_RETRIES=retries,
            CELERY_OUTBOX_EVENTS_MAX_RETRIES=E2E_STEPS,
            CELERY_OUTBOX_OUTSIDE_TRANSACTION="raise",
        ):
            e2e[kind] = run_broker(kind, retries, e2e_exchange, e2e_sizes)
    return _render(results, sizes) + "\n" + _render_e2e(e2e, e2e_sizes)


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
        forget(shop, kind, exchange, topologies)
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
    from celery_outbox.relay.config import RelayConfig
    from celery_outbox.relay.loop import Relay
    from celery_outbox.store import outbox_stores

    settings = get_settings()
    publisher = build_publisher(app, settings)
    try:
        config = RelayConfig.from_settings(settings, until_empty=True)
        relay = Relay(outbox_stores(settings).relay(), publisher, config, observers=())
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


def _render_e2e(results: dict[str, E2EResult], sizes: E2ESizes) -> str:
    from celery_outbox.conf import get_settings

    labels = {"amqp": "RabbitMQ", "redis": "Redis"}
    poll = get_settings().poll_interval
    held = {"amqp": "broker (TTL queues)", "redis": f"database (poll {poll:g} s)"}
    names = list(next(iter(results.values())).rounds[0].per_service)
    lines = [
        f"  end to end: {sizes.events:,} events, a relay and one worker per service "
        f"(threads), handled/s from the first commit to the last handled",
        f"  {'broker':<10} {'per commit':>10} {'fired in s':>10} {'then s':>7} "
        + " ".join(f"{name:>15}" for name in names)
        + f" {'both copies/s':>14} {'duplicates':>10}",
    ]
    for kind, result in results.items():
        for handled in result.rounds:
            lines.append(
                f"  {labels[kind]:<10} {handled.per_commit:>10,} "
                f"{handled.fired:>10.2f} {handled.lag:>7.2f} "
                + " ".join(f"{handled.per_service[name]:>15,.0f}" for name in names)
                + f" {handled.overall:>14,.0f} {handled.duplicates:>10}"
            )
    lines.append(
        f"  retry delays: {sizes.probes} events x {len(names)} services failing "
        f"{E2E_STEPS} times, steps 1, 2, 4 s, between a subscriber's attempts"
    )
    lines.append(
        f"  {'broker':<10} {'retries held by':<24} {'delays':>6} "
        f"{'max |error| s':>14} {'max |error| %':>14} {'mean error s':>13}"
    )
    for kind, result in results.items():
        errors = result.errors()
        seconds = [abs(error) for error, _ in errors]
        percent = [abs(pct) for _, pct in errors]
        mean = sum(error for error, _ in errors) / len(errors)
        lines.append(
            f"  {labels[kind]:<10} {held[kind]:<24} {len(errors):>6} "
            f"{max(seconds):>14.3f} {max(percent):>14.1f} {mean:>+13.3f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    prepare()
    print(bench_events("--quick" in sys.argv))
