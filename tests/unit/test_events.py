"""Events: names and patterns, the retry decision and the topology (pure, no broker)."""

from __future__ import annotations

import logging

import pytest
from celery import Celery
from celery.exceptions import Reject, Retry, TimeLimitExceeded, WorkerLostError

from celery_outbox import OutboxCelery
from celery_outbox.conf import OutboxSettings
from celery_outbox.events.delivery import Decision, Fate, decide, decision_for
from celery_outbox.events.modes import Retries
from celery_outbox.events.names import check_event_name, check_service, matches, overlap
from celery_outbox.events.registry import registry_of
from celery_outbox.events.topology import ServiceTopology, retry_delay
from celery_outbox.exceptions import OutboxConfigurationError


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("order.created", "order.created", True),
        ("order.*", "order.created", True),
        ("order.*", "order.created.eu", False),
        ("order.#", "order.created.eu", True),
        ("order.#", "order", True),
        ("#", "anything.at.all", True),
        ("*.created", "order.created", True),
        ("*.created", "order.paid", False),
    ],
)
def test_topic_matching_follows_rabbitmq(
    pattern: str, name: str, expected: bool
) -> None:
    assert matches(pattern, name) is expected


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ("order.*", "order.created", True),
        ("order.*", "*.created", True),
        ("order.*", "invoice.*", False),
        ("order.#", "#.paid", True),
        ("order.*.eu", "order.*", False),
        ("a.#.b", "a.b", True),
    ],
)
def test_pattern_overlap(first: str, second: str, expected: bool) -> None:
    assert overlap(first, second) is expected
    assert overlap(second, first) is expected


@pytest.mark.parametrize("name", ["", "order.*", "order..created", "a:b", "x" * 200])
def test_bad_event_names_are_refused(name: str) -> None:
    with pytest.raises(OutboxConfigurationError):
        check_event_name(name)


@pytest.mark.parametrize("name", [None, "", "__main__", "bill:ing"])
def test_a_service_needs_a_usable_name(name: object) -> None:
    with pytest.raises(OutboxConfigurationError, match="service name"):
        check_service(name)


def test_retry_then_archive() -> None:
    assert decide(0, 3, retryable=True) == Decision(Fate.RETRY, 0)
    assert decide(2, 3, retryable=True) == Decision(Fate.RETRY, 2)
    assert decide(3, 3, retryable=True) == Decision(Fate.ARCHIVE)
    assert decide(0, 3, retryable=False) == Decision(Fate.ARCHIVE)
    assert decide(0, 0, retryable=True) == Decision(Fate.ARCHIVE)


class NotRetried(Exception):
    """A subscriber's exception outside its ``retry_for``."""


@pytest.mark.parametrize(
    ("exc", "at_step_0", "after_the_last"),
    [
        (ValueError("a failure"), Decision(Fate.RETRY, 0), Decision(Fate.ARCHIVE)),
        (NotRetried(), Decision(Fate.ARCHIVE), Decision(Fate.ARCHIVE)),
        (TimeLimitExceeded(2), Decision(Fate.RETRY, 0), Decision(Fate.ARCHIVE)),
        (WorkerLostError(), Decision(Fate.RETRY, 0), Decision(Fate.ARCHIVE)),
        # Rejected: archived at once, retries left or not.
        (Reject("bad", requeue=False), Decision(Fate.ARCHIVE), Decision(Fate.ARCHIVE)),
        # A retry asked for: the next step whatever retry_for says, counted all the same.
        (
            Reject("later", requeue=True),
            Decision(Fate.RETRY, 0),
            Decision(Fate.ARCHIVE),
        ),
        (Retry(), Decision(Fate.RETRY, 0), Decision(Fate.ARCHIVE)),
    ],
)
def test_how_a_subscriber_ended_decides_its_events_fate(
    exc: BaseException, at_step_0: Decision, after_the_last: Decision
) -> None:
    retry_for = (ValueError, TimeLimitExceeded, WorkerLostError)
    assert decision_for(exc, 0, 2, retry_for) == at_step_0
    assert decision_for(exc, 2, 2, retry_for) == after_the_last


def test_topology_retry_steps_archive_and_quorum() -> None:
    settings = OutboxSettings(events_exchange="ev", events_max_retries=3)
    topology = ServiceTopology(settings, "billing", ("order.*",))
    steps = [q.queue_arguments["x-message-ttl"] for q in topology.support_queues()[:-1]]
    assert steps == [1000, 2000, 4000]
    assert [retry_delay(n) for n in range(3)] == [1.0, 2.0, 4.0]
    queue = topology.event_queue("order.*")
    assert queue.name == "ev:billing:order.*"
    assert queue.queue_arguments == {
        "x-dead-letter-exchange": "ev:billing:retry:0",
        "x-dead-letter-routing-key": "ev:billing:order.*",
    }
    assert {(b.exchange.name, b.routing_key) for b in queue.bindings} == {
        ("ev", "order.*"),
        ("ev:billing:recover", "ev:billing:order.*"),
    }
    archive = topology.archive_queue()
    assert archive.queue_arguments == {
        "x-message-ttl": 604800000,
        "x-max-length": 10000,
    }
    quorum = ServiceTopology(
        OutboxSettings(events_queue_type="quorum"), "billing", ("a",)
    )
    assert all(
        q.queue_arguments["x-queue-type"] == "quorum"
        for q in [*quorum.event_queues(), *quorum.support_queues()]
    )


def test_overlapping_subscribers_in_one_service_are_refused() -> None:
    app = OutboxCelery("overlap-service", set_as_current=False)
    app.subscriber("order.*")(lambda order_id: None)
    with pytest.raises(OutboxConfigurationError, match="overlap"):
        app.subscriber("order.created")(lambda order_id: None)


def test_two_apps_with_one_name_are_refused() -> None:
    first = OutboxCelery("twin-service", set_as_current=False)
    first.subscriber("a.b")(lambda: None)
    second = OutboxCelery("twin-service", set_as_current=False)
    with pytest.raises(OutboxConfigurationError, match="both named 'twin-service'"):
        second.subscriber("c.d")(lambda: None)


def test_an_app_without_a_name_is_refused() -> None:
    app = OutboxCelery(set_as_current=False)
    with pytest.raises(OutboxConfigurationError, match="unique service name"):
        app.subscriber("a.b")(lambda: None)


def test_registry_is_per_app() -> None:
    app = Celery("plain-service", set_as_current=False)
    registry = registry_of(app)
    registry.add_subscriber("x.y", lambda: None)
    assert registry_of(app) is registry
    assert registry.subscriber_for("x.y") is not None
    assert registry.subscriber_for("x.z") is None


def test_a_subscriber_is_found_by_its_pattern_with_its_retries() -> None:
    app = OutboxCelery("subscribing-service", set_as_current=False)
    task = app.subscriber("order.*", max_retries=2)(lambda order_id: None)
    found = registry_of(app).subscriber_for("order.created")
    assert found is not None and found.task is task and found.max_retries == 2


class _Transport:
    def __init__(self, driver_type: str) -> None:
        self.driver_type = driver_type


class _Connection:
    """Only what :func:`check_broker` reads of a kombu connection."""

    def __init__(self, driver_type: str, version: str = "3.13.0") -> None:
        self.transport = _Transport(driver_type)
        self.connection = type("Raw", (), {"server_properties": {"version": version}})


def test_retries_are_held_by_the_broker_on_rabbitmq_and_by_the_database_elsewhere() -> (
    None
):
    from celery_outbox.events.declare import check_broker

    assert check_broker(_Connection("amqp"), OutboxSettings()) is Retries.BROKER
    assert check_broker(_Connection("redis"), OutboxSettings()) is Retries.DATABASE
    held = OutboxSettings(events_retries="database")
    assert check_broker(_Connection("amqp"), held) is Retries.DATABASE
    assert check_broker(_Connection("redis"), held) is Retries.DATABASE
    broker = OutboxSettings(events_retries="broker")
    assert check_broker(_Connection("amqp"), broker) is Retries.BROKER
    with pytest.raises(OutboxConfigurationError, match="dead-letter exchanges"):
        check_broker(_Connection("redis"), broker)


def test_auto_on_redis_warns_at_start_and_an_explicit_choice_does_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from celery_outbox.events.modes import announce

    with caplog.at_level(logging.INFO, logger="celery_outbox.events"):
        announce(Retries.DATABASE, "redis", "auto", "billing")
        announce(Retries.DATABASE, "redis", "database", "billing")
        announce(Retries.BROKER, "amqp", "auto", "billing")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "broker-side retries are not available" in warnings[0].getMessage()
    assert "billing" in warnings[0].getMessage()


def test_a_service_whose_database_holds_the_retries_has_plain_event_queues() -> None:
    settings = OutboxSettings(events_exchange="ev", events_max_retries=3)
    topology = ServiceTopology(settings, "billing", ("order.*",), Retries.DATABASE)
    assert topology.support_queues() == []
    queue = topology.event_queue("order.*")
    assert queue.name == "ev:billing:order.*"
    assert not queue.queue_arguments
    assert [(b.exchange.name, b.routing_key) for b in queue.bindings] == [
        ("ev", "order.*")
    ]
    assert [q.name for q in topology.all_queues()] == [
        "ev:unrouted",
        "ev:billing:order.*",
    ]


def test_the_retries_setting_is_validated() -> None:
    from celery_outbox.conf import load_settings

    class Bad:
        CELERY_OUTBOX_EVENTS_RETRIES = "redis"

    with pytest.raises(OutboxConfigurationError, match="EVENTS_RETRIES"):
        load_settings(Bad)


def test_a_subscriber_inbox_key_is_per_service_and_subscriber() -> None:
    from celery_outbox.events.once import inbox_name, uses_inbox

    assert inbox_name("billing", "b.on_order") != inbox_name("audit", "b.on_order")
    app = OutboxCelery("inbox-flag-service", set_as_current=False)

    def once() -> None: ...

    def plain() -> None: ...

    with_inbox = app.subscriber("a.b", inbox=True)(once)
    without = app.subscriber("c.d")(plain)
    assert uses_inbox(with_inbox) is True
    assert uses_inbox(without) is False


def test_quorum_queues_need_a_rabbitmq_that_honours_their_ttl() -> None:
    from celery_outbox.events.declare import check_broker

    quorum = OutboxSettings(events_queue_type="quorum")
    with pytest.raises(OutboxConfigurationError, match=r"RabbitMQ 3\.9"):
        check_broker(_Connection("amqp", "3.9.29"), quorum)
    check_broker(_Connection("amqp", "3.10.8"), quorum)


def test_event_settings_are_validated() -> None:
    from celery_outbox.conf import load_settings

    class Good:
        CELERY_OUTBOX_EVENTS_ARCHIVE_TTL = "2d"
        CELERY_OUTBOX_EVENTS_QUEUE_TYPE = "quorum"
        CELERY_OUTBOX_EVENTS_MAX_RETRIES = 0

    loaded = load_settings(Good)
    assert (loaded.events_archive_ttl, loaded.events_max_retries) == (172800.0, 0)

    class Bad:
        CELERY_OUTBOX_EVENTS_QUEUE_TYPE = "stream"
        CELERY_OUTBOX_EVENTS_MAX_RETRIES = 30
        CELERY_OUTBOX_EVENTS_EXCHANGE = "a:b"

    with pytest.raises(OutboxConfigurationError, match="3 celery-outbox settings"):
        load_settings(Bad)
