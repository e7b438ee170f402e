"""The LISTEN/NOTIFY hint wakes an idle relay on PostgreSQL; polling stays the safety net."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import transaction

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.conf import OutboxSettings
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.store import OutboxStore
from celery_outbox.store.notify import PgNotifyListener
from tests.project.shop.tasks import record

from .builders import start_in_thread

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def idle_relay() -> Iterator[tuple[Relay, InMemoryPublisher]]:
    """A relay that would poll only every 30 s, running in a thread."""
    publisher = InMemoryPublisher()
    config = RelayConfig.from_settings(
        OutboxSettings(poll_interval=30.0), min_poll_interval=30.0
    )
    relay = Relay(
        OutboxStore("default"),
        publisher,
        config,
        listeners=(),
        wakeup=PgNotifyListener("default"),
    )

    thread = start_in_thread(relay)
    time.sleep(0.5)  # let it reach its idle wait
    yield relay, publisher
    relay.stop()
    thread.join(10)
    assert not thread.is_alive()


def wait_for(publisher: InMemoryPublisher, count: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if len(publisher.published) >= count:
            return True
        time.sleep(0.01)
    return False


def test_a_commit_wakes_the_relay(idle_relay: tuple[Relay, InMemoryPublisher]) -> None:
    relay, publisher = idle_relay
    assert relay.wakeup is not None
    with transaction.atomic():
        result = record.delay("wake")
    assert wait_for(publisher, 1, 5.0), "the relay slept through the commit"
    assert [e.task_id for e in publisher.published] == [result.id]


def test_without_the_hint_the_relay_waits_for_its_poll(
    idle_relay: tuple[Relay, InMemoryPublisher], settings: Any
) -> None:
    _, publisher = idle_relay
    settings.CELERY_OUTBOX_NOTIFY = False
    with transaction.atomic():
        record.delay("quiet")
    assert not wait_for(publisher, 1, 1.5)
