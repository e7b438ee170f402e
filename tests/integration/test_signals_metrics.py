"""Django signals and metrics, as subscribers of a real relay on a real database."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import prometheus_client
import pytest
from django.db import connection, transaction

from celery_outbox import signals
from celery_outbox.broker import InMemoryPublisher
from celery_outbox.conf import OutboxSettings
from celery_outbox.envelope import StoredMessage
from celery_outbox.metrics import RelayMetrics
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.outcomes import Outcome, PublishResult
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.sinks import PrometheusSink, StatsdSink
from celery_outbox.store import Stores
from tests.project.shop.models import Order
from tests.project.shop.tasks import record

from .builders import envelope, keyed

pytestmark = pytest.mark.django_db(transaction=True)

SETTINGS = OutboxSettings(
    max_attempts=2, retry_base_seconds=30.0, retry_max_seconds=60.0
)


def refuse(prefix: str) -> Any:
    def behaviour(message: StoredMessage) -> PublishResult | None:
        if message.envelope.task_id.startswith(prefix):
            return PublishResult(
                message.id, Outcome.FAILED, "NotFound: no exchange 'x'"
            )
        return None

    return behaviour


@pytest.fixture
def received() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    calls: list[tuple[str, dict[str, Any]]] = []
    receivers = {}
    for name in ("message_published", "message_failed", "message_dead_lettered"):

        def receiver(sender: Any, name: str = name, **kwargs: Any) -> None:
            calls.append((name, kwargs))

        receivers[name] = receiver
        getattr(signals, name).connect(receiver)
    yield calls
    for name, receiver in receivers.items():
        getattr(signals, name).disconnect(receiver)


def test_relay_signals_follow_each_outcome(
    received: list[tuple[str, dict[str, Any]]],
) -> None:
    stores = Stores("default")
    with transaction.atomic():
        stores.writer().insert([envelope("good"), envelope("bad")])
    OutboxMessage.objects.filter(task_id__startswith="bad").update(attempts=0)
    relay = Relay(
        stores.relay(),
        InMemoryPublisher(refuse("bad")),
        RelayConfig.from_settings(SETTINGS),
        observers=[signals.send_relay_signals],
    )
    relay.run_once()
    kinds = {name: kwargs for name, kwargs in received}
    assert kinds["message_published"]["task_id"].startswith("good")
    assert kinds["message_published"]["attempts"] == 1
    assert kinds["message_failed"]["task_id"].startswith("bad")
    assert kinds["message_failed"]["error"] == "NotFound: no exchange 'x'"
    assert kinds["message_failed"]["retry_in"] >= 15.0
    OutboxMessage.objects.update(available_at=OutboxMessage.objects.get().created_at)
    relay.run_once()
    dead = [kwargs for name, kwargs in received if name == "message_dead_lettered"]
    assert len(dead) == 1
    assert dead[0]["attempts"] == 2


def test_a_receiver_with_a_database_error_cannot_undo_the_settlement() -> None:
    def broken(sender: Any, **kwargs: Any) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT * FROM no_such_table")

    signals.message_published.connect(broken)
    try:
        with transaction.atomic():
            Stores("default").writer().insert([envelope("a"), envelope("b")])
        relay = Relay(
            Stores("default").relay(),
            InMemoryPublisher(),
            RelayConfig.from_settings(SETTINGS),
            observers=[signals.send_relay_signals],
        )
        relay.run_once()
    finally:
        signals.message_published.disconnect(broken)
    assert OutboxMessage.objects.count() == 0


def test_a_failing_created_receiver_leaves_the_callers_transaction_intact() -> None:
    seen: list[str] = []

    def broken(sender: Any, task_id: str, **kwargs: Any) -> None:
        seen.append(task_id)
        with connection.cursor() as cursor:
            cursor.execute("SELECT * FROM no_such_table")

    signals.message_created.connect(broken)
    try:
        with transaction.atomic():
            Order.objects.create(number="1")
            result = record.delay("created")
            Order.objects.create(number="2")  # the transaction is still usable
    finally:
        signals.message_created.disconnect(broken)
    assert seen == [result.id]
    assert Order.objects.count() == 2
    assert list(OutboxMessage.objects.values_list("task_id", flat=True)) == [result.id]


def run_batch_with(listener: RelayMetrics) -> None:
    with transaction.atomic():
        Stores("default").writer().insert(
            [envelope("m1"), envelope("m2"), envelope("bad")]
        )
    Relay(
        Stores("default").relay(),
        InMemoryPublisher(refuse("bad")),
        RelayConfig.from_settings(SETTINGS),
        observers=[listener],
    ).run_once()


def test_prometheus_metrics() -> None:
    registry = prometheus_client.CollectorRegistry()
    run_batch_with(RelayMetrics(PrometheusSink(registry), Stores("default").operator()))
    value = registry.get_sample_value
    assert value("celery_outbox_published_total") == 2
    assert value("celery_outbox_failed_total") == 1
    assert value("celery_outbox_dead_lettered_total") == 0
    assert value("celery_outbox_batch_duration_seconds_count") == 1
    assert value("celery_outbox_commit_to_publish_seconds_count") == 2
    assert value("celery_outbox_pending") == 1  # the refused row waits for its retry
    assert value("celery_outbox_due") == 0


def test_statsd_metrics_over_udp() -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.settimeout(2.0)
    try:
        port = server.getsockname()[1]
        sink = StatsdSink(f"127.0.0.1:{port}")
        run_batch_with(RelayMetrics(sink, Stores("default").operator()))
        sink.close()
        lines = set()
        while True:
            try:
                lines.add(server.recv(1024).decode())
            except TimeoutError:
                break
            if "celery_outbox_pending:1|g" in lines:
                break
    finally:
        server.close()
    assert "celery_outbox_published_total:2|c" in lines
    assert "celery_outbox_failed_total:1|c" in lines
    assert any(line.startswith("celery_outbox_publish_seconds:") for line in lines)


def test_dead_letter_count_is_exposed() -> None:
    registry = prometheus_client.CollectorRegistry()
    sink = PrometheusSink(registry)
    with transaction.atomic():
        Stores("default").writer().insert([envelope("bad")])
    OutboxMessage.objects.update(attempts=1)
    Relay(
        Stores("default").relay(),
        InMemoryPublisher(refuse("bad")),
        RelayConfig.from_settings(SETTINGS),
        observers=[RelayMetrics(sink, Stores("default").operator())],
    ).run_once()
    assert registry.get_sample_value("celery_outbox_dead_lettered_total") == 1
    assert registry.get_sample_value("celery_outbox_dead") == 1
    assert DeadLetter.objects.count() == 1


def test_a_blocked_key_is_exposed_until_an_operator_acts() -> None:
    registry = prometheus_client.CollectorRegistry()
    metrics = RelayMetrics(
        PrometheusSink(registry), Stores("default").operator(), sample_every=0.0
    )
    with transaction.atomic():
        Stores("default").writer().insert(
            [keyed("bad-head", "org:1"), keyed("next", "org:1")]
        )
    OutboxMessage.objects.filter(task_id__startswith="bad-head").update(attempts=1)
    Relay(
        Stores("default").relay(),
        InMemoryPublisher(refuse("bad")),
        RelayConfig.from_settings(SETTINGS),
        observers=[metrics],
    ).run_once()
    # The head failed for good under the `block` policy: its key waits for an operator.
    assert registry.get_sample_value("celery_outbox_blocked_total") == 1
    assert registry.get_sample_value("celery_outbox_blocked_keys") == 1
    assert Stores("default").ordering().retry_head("org:1") == 1
    metrics.sample()
    assert registry.get_sample_value("celery_outbox_blocked_keys") == 0


def test_an_idle_relay_keeps_the_backlog_gauges_fresh() -> None:
    from celery_outbox.relay.observations import Idle

    registry = prometheus_client.CollectorRegistry()
    metrics = RelayMetrics(
        PrometheusSink(registry), Stores("default").operator(), sample_every=0.0
    )
    metrics(Idle(1.0))
    assert registry.get_sample_value("celery_outbox_pending") == 0
    with transaction.atomic():
        Stores("default").writer().insert([envelope("w1"), envelope("w2")])
    metrics(Idle(1.0))
    assert registry.get_sample_value("celery_outbox_pending") == 2


def test_the_breaker_gauge_falls_once_the_broker_answers_again() -> None:
    registry = prometheus_client.CollectorRegistry()
    publisher = InMemoryPublisher(refuse("bad"))
    relay = Relay(
        Stores("default").relay(),
        publisher,
        RelayConfig.from_settings(
            OutboxSettings(
                max_attempts=5,
                retry_base_seconds=30.0,
                retry_max_seconds=60.0,
                broker_outage_cooldown=0.05,
            ),
            breaker_threshold=1,
        ),
        observers=[RelayMetrics(PrometheusSink(registry))],
    )
    with transaction.atomic():
        Stores("default").writer().insert([envelope("bad")])
    publisher.down = True
    relay.run_once()
    assert registry.get_sample_value("celery_outbox_breaker_open") == 1
    publisher.down = False
    time.sleep(0.2)  # the cool-down passes; the broker is back and refuses the row
    relay.run_once()
    assert registry.get_sample_value("celery_outbox_failed_total") == 1
    assert not relay.breaker.is_open(time.monotonic())
    assert registry.get_sample_value("celery_outbox_breaker_open") == 0


def test_statsd_metrics_reach_an_ipv6_address() -> None:
    server = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    server.bind(("::1", 0))
    server.settimeout(2.0)
    try:
        sink = StatsdSink(f"[::1]:{server.getsockname()[1]}")
        sink.count("published_total", 3)
        sink.close()
        assert server.recv(1024) == b"celery_outbox_published_total:3|c"
    finally:
        server.close()


def test_a_statsd_port_out_of_range_is_refused_when_the_sink_is_built() -> None:
    with pytest.raises(ValueError, match="host:8125"):
        StatsdSink("127.0.0.1:99999")


class CountingResolver:
    """``socket.getaddrinfo`` that counts its calls and can be made to fail."""

    def __init__(self) -> None:
        self.calls = 0
        self.failing = False

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.failing:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return socket.getaddrinfo(*args)


def datagrams(server: socket.socket) -> list[bytes]:
    found = []
    while True:
        try:
            found.append(server.recv(1024))
        except (TimeoutError, BlockingIOError):
            return found


@pytest.fixture
def udp_server() -> Iterator[socket.socket]:
    """A StatsD server stand-in on loopback: a bound UDP socket to read datagrams from."""
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.settimeout(0.5)
    yield server
    server.close()


def sink_for(server: socket.socket, resolve: Any, now: list[float]) -> StatsdSink:
    """A sink sending to ``server`` by host name, with its lookups and clock given."""
    return StatsdSink(
        f"localhost:{server.getsockname()[1]}", resolve=resolve, clock=lambda: now[0]
    )


def test_the_statsd_host_is_looked_up_once_a_minute_not_per_datagram(
    udp_server: socket.socket,
) -> None:
    now = [1000.0]
    resolver = CountingResolver()
    sink = sink_for(udp_server, resolver, now)
    for n in range(20):
        sink.count("published_total", n)
    assert resolver.calls == 1
    now[0] += 61
    sink.gauge("pending", 1)
    assert sink.refreshed(5.0)
    assert resolver.calls == 2
    sink.close()
    assert len(datagrams(udp_server)) == 21


def test_statsd_metrics_start_once_an_unknown_host_resolves(
    udp_server: socket.socket,
) -> None:
    now = [1000.0]
    resolver = CountingResolver()
    resolver.failing = True
    sink = sink_for(udp_server, resolver, now)
    sink.count("published_total", 1)  # dropped: nowhere to send it
    resolver.failing = False
    now[0] += 6
    sink.count("published_total", 2)  # starts the lookup on its thread
    assert sink.refreshed(5.0)
    sink.count("published_total", 3)
    sink.close()
    received = datagrams(udp_server)
    assert b"celery_outbox_published_total:3|c" in received
    assert b"celery_outbox_published_total:1|c" not in received
    assert resolver.calls == 2


def test_a_slow_statsd_lookup_never_holds_up_the_relay(
    udp_server: socket.socket,
) -> None:
    now = [1000.0]
    release = threading.Event()

    def resolve(*args: Any) -> Any:
        if now[0] > 1000.0:
            release.wait(10)  # a DNS server that takes its time
        return socket.getaddrinfo(*args)

    try:
        sink = sink_for(udp_server, resolve, now)
        now[0] += 61
        for n in range(5):
            sink.count("published_total", n)
        # Every datagram went out while the lookup still waits for its answer.
        assert not sink.refreshed(0)
        release.set()
        assert sink.refreshed(5.0)
        sink.close()
    finally:
        release.set()
    assert len(datagrams(udp_server)) == 5  # to the last good address meanwhile
