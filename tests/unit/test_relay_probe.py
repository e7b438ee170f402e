"""What the start-up probe writes about the broker: the URL an operator checks, no password."""

from __future__ import annotations

import logging

import pytest
from celery import Celery

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.relay.probe import broker_location, probe_broker


def location(url: str | None) -> str:
    return broker_location(Celery("probe", broker=url, set_as_current=False))


def test_the_broker_password_is_masked() -> None:
    assert (
        location("amqp://relay:s3cret@rabbit:5672/prod")
        == "amqp://relay:**@rabbit:5672/prod"
    )
    assert location("redis://:s3cret@cache:6379/0") == "redis://:**@cache:6379/0"


def test_every_url_of_a_failover_list_is_masked() -> None:
    found = location("amqp://a:first@h1//; amqp://b:second@h2//")
    assert found == "amqp://a:**@h1//;amqp://b:**@h2//"


def test_celerys_default_broker_is_named_too() -> None:
    assert location(None).startswith("amqp://guest:**@localhost:5672/")


def test_a_broker_that_answers_is_an_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="celery_outbox.relay"):
        probe = probe_broker(InMemoryPublisher(), "memory://")
    assert probe.ok
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "broker memory://: connected")
    ]


def test_a_broker_that_is_down_is_a_warning_with_the_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = InMemoryPublisher()
    publisher.down = True
    with caplog.at_level(logging.INFO, logger="celery_outbox.relay"):
        probe = probe_broker(publisher, "memory://")
    assert probe.error == "ConnectionRefusedError: in-memory broker is down"
    [line] = caplog.records
    assert line.levelno == logging.WARNING
    assert line.getMessage().startswith(
        "broker memory://: not reachable at start: ConnectionRefusedError: in-memory "
        "broker is down. The relay starts anyway"
    )
