"""The LISTEN/NOTIFY hint wakes an idle relay on PostgreSQL; polling stays the safety net."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, transaction

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.conf import OutboxSettings
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.listener import PgNotifyListener
from celery_outbox.relay.loop import Relay
from celery_outbox.store import Stores
from celery_outbox.store.notify import CHANNEL, COALESCE_SECONDS
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
        Stores("default").relay(),
        publisher,
        config,
        observers=(),
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


@pytest.mark.django_db(databases=["default", "postgresql_commit"], transaction=True)
def test_a_long_transaction_on_the_engine_wakes_the_relay_when_it_commits(
    idle_relay: tuple[Relay, InMemoryPublisher], settings: Any
) -> None:
    # The second transaction enqueues just after the first one's hint, then works on
    # for a while: by its commit the relay has long gone back to sleep.
    _, publisher = idle_relay
    settings.CELERY_OUTBOX_DATABASE = "postgresql_commit"
    with transaction.atomic(using="postgresql_commit"):
        first = record.delay("first")
    with transaction.atomic(using="postgresql_commit"):
        second = record.delay("second")
        assert wait_for(publisher, 1, 5.0), "the first commit did not wake the relay"
        time.sleep(0.2)
    assert wait_for(publisher, 2, 5.0), "the relay slept through the second commit"
    assert [e.task_id for e in publisher.published] == [first.id, second.id]


def test_a_hint_that_rolled_back_does_not_silence_the_next_commit(
    idle_relay: tuple[Relay, InMemoryPublisher],
) -> None:
    _, publisher = idle_relay
    with transaction.atomic():
        record.delay("rolled-back")
        transaction.set_rollback(True)
    with transaction.atomic():
        kept = record.delay("kept")
    assert wait_for(publisher, 1, 5.0), "the relay slept through the commit"
    assert [e.task_id for e in publisher.published] == [kept.id]


#: The burst of commits, one enqueue each.
COMMITS = 50


@pytest.mark.django_db(databases=["default", "postgresql_commit"], transaction=True)
@pytest.mark.parametrize("alias", ["default", "postgresql_commit"])
def test_a_burst_of_commits_sends_fewer_hints_than_commits(
    alias: str, settings: Any
) -> None:
    settings.CELERY_OUTBOX_DATABASE = alias
    wrapper = connections["default"]
    listener = wrapper.get_new_connection(wrapper.get_connection_params())
    try:
        listener.autocommit = True
        listener.execute(f"LISTEN {CHANNEL}")
        time.sleep(0.05)  # a hint committed by an earlier test is 20 ms old by now
        started = time.monotonic()
        for number in range(COMMITS):
            with transaction.atomic(using=alias):
                record.delay(f"burst-{number}")
        elapsed = time.monotonic() - started
        hints = sum(1 for _ in listener.notifies(timeout=1.0))
    finally:
        listener.close()
    # At most one hint per window, however fast this machine commits: a loaded one
    # takes longer than a window per commit, and then each commit may hint.
    assert 1 <= hints <= elapsed / COALESCE_SECONDS + 1, (hints, elapsed)
    assert hints < COMMITS or elapsed >= COMMITS * COALESCE_SECONDS, (hints, elapsed)
