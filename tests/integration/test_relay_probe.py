"""At start the relay says where it connects and whether that worked.

Real databases and a real RabbitMQ; a broker that is down is a closed loopback port.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, transaction
from django.test import override_settings

from celery_outbox.cli.runner import build_relay
from celery_outbox.conf import get_settings
from celery_outbox.engine.loop import Turn
from celery_outbox.exceptions import OutboxConfigurationError
from celery_outbox.models import OutboxMessage
from celery_outbox.store import Stores

from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

#: Nothing listens here: connecting is refused at once.
DOWN = "amqp://relay:s3cr3t-pw@127.0.0.1:1//"


def relay_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "celery_outbox.relay"]


@pytest.fixture
def broker_down(outbox_app: Any) -> Iterator[None]:
    """The test app's broker URL points at a port nobody listens on."""
    was = outbox_app.conf.broker_url
    outbox_app.conf.broker_url = DOWN
    try:
        yield
    finally:
        outbox_app.conf.broker_url = was


def test_the_relay_names_the_broker_and_database_it_connected_to(
    alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        override_settings(CELERY_OUTBOX_DATABASE=alias),
        caplog.at_level(logging.INFO, logger="celery_outbox.relay"),
    ):
        relay = build_relay(get_settings())
    relay.publisher.close()
    connection = connections[alias]
    database, broker = (r for r in relay_lines(caplog) if "connected" in r.getMessage())
    assert database.levelno == logging.INFO
    text = database.getMessage()
    assert text.startswith(f"outbox database {alias!r} ({connection.vendor}")
    assert str(connection.settings_dict["NAME"]) in text
    if connection.vendor != "sqlite":
        settings = connection.settings_dict
        assert f"{settings['HOST']}:{settings['PORT']}" in text
    assert broker.levelno == logging.INFO
    assert broker.getMessage() == "broker amqp://guest:**@127.0.0.1:5672//: connected"
    assert not any(":guest@" in r.getMessage() for r in caplog.records)


@pytest.mark.usefixtures("broker_down")
def test_a_broker_down_at_start_is_a_warning_and_the_relay_runs_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with transaction.atomic():
        Stores("default").writer().insert([envelope("waits")])
    with caplog.at_level(logging.INFO, logger="celery_outbox.relay"):
        relay = build_relay(get_settings(), send_timeout=2.0)
        assert relay.run_once() is Turn.PARTIAL  # claimed, then put back: an outage
    [probe] = [r for r in relay_lines(caplog) if "at start" in r.getMessage()]
    assert probe.levelno == logging.WARNING
    text = probe.getMessage()
    assert text.startswith(
        "broker amqp://relay:**@127.0.0.1:1//: not reachable at start: "
    )
    assert "Connection refused" in text or "ConnectionRefusedError" in text
    assert "s3cr3t-pw" not in caplog.text
    [row] = OutboxMessage.objects.all()
    assert row.attempts == 0  # no attempt used, as for any outage
    relay.publisher.close()


@pytest.fixture
def unmigrated_sqlite() -> Iterator[str]:
    """The SQLite alias with its outbox table moved away (autocommit DDL), then back."""
    with connections["sqlite"].cursor() as cursor:
        cursor.execute("ALTER TABLE celery_outbox_message RENAME TO hidden_probe")
    try:
        with override_settings(CELERY_OUTBOX_DATABASE="sqlite"):
            yield "sqlite"
    finally:
        with connections["sqlite"].cursor() as cursor:
            cursor.execute("ALTER TABLE hidden_probe RENAME TO celery_outbox_message")


@pytest.mark.usefixtures("unmigrated_sqlite")
def test_a_database_without_the_tables_is_logged_with_where_it_is_then_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="celery_outbox.relay"),
        pytest.raises(OutboxConfigurationError, match="table missing"),
    ):
        build_relay(get_settings())
    name = str(connections["sqlite"].settings_dict["NAME"])
    [line] = [r for r in relay_lines(caplog) if "not usable" in r.getMessage()]
    assert line.levelno == logging.ERROR
    assert line.getMessage().startswith(
        f"outbox database 'sqlite' (sqlite, file {name!r}): not usable: table missing"
    )
    # The broker is still probed, so one start shows every problem.
    assert any(
        r.getMessage() == "broker amqp://guest:**@127.0.0.1:5672//: connected"
        for r in relay_lines(caplog)
    )


def test_a_message_rabbitmq_refuses_is_logged_with_its_reason_then_dead_lettered(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.CELERY_OUTBOX_MAX_ATTEMPTS = 2
    exchange = f"missing-{uuid.uuid4().hex[:10]}"
    refused = envelope("refused", exchange=exchange, declare=())
    with transaction.atomic():
        Stores("default").writer().insert([refused])
    relay = build_relay(get_settings())
    with caplog.at_level(logging.WARNING, logger="celery_outbox.relay"):
        relay.run_once()
        OutboxMessage.objects.update(
            available_at=OutboxMessage.objects.get().created_at
        )
        relay.run_once()
    relay.publisher.close()
    lines = [r for r in relay_lines(caplog) if refused.task_id in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.WARNING, logging.ERROR]
    retry, dead = (r.getMessage() for r in lines)
    assert retry.startswith(
        f"task shop.record [{refused.task_id}] refused by the broker (attempt 1), "
        f"retrying in "
    )
    assert dead.startswith(
        f"task shop.record [{refused.task_id}] dead-lettered after 2 attempts: "
    )
    for text in (retry, dead):
        assert f"no exchange '{exchange}'" in text  # RabbitMQ's own reason
