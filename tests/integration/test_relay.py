"""The relay loop on a real database, with the in-memory publisher as the broker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.db import transaction

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.conf import OutboxSettings
from celery_outbox.envelope import StoredMessage
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.core import Outcome, PublishResult
from celery_outbox.relay.events import RelayEvent, StopReason
from celery_outbox.relay.loop import Cycle, Relay
from celery_outbox.store import OutboxStore

from .builders import envelope, start_in_thread

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

FAST = OutboxSettings(
    max_attempts=3,
    retry_base_seconds=0.01,
    retry_max_seconds=0.02,
    broker_outage_cooldown=60.0,
    poll_interval=0.05,
)


def relay_for(alias: str, publisher: InMemoryPublisher, **overrides: object) -> Relay:
    config = RelayConfig.from_settings(FAST, **overrides)
    return Relay(OutboxStore(alias), publisher, config, listeners=())


def enqueue(alias: str, *tags: str) -> None:
    with transaction.atomic(using=alias):
        OutboxStore(alias).insert([envelope(tag) for tag in tags])


def test_until_empty_publishes_everything_and_returns(alias: str) -> None:
    enqueue(alias, *[f"t{i}" for i in range(30)])
    publisher = InMemoryPublisher()
    assert (
        relay_for(alias, publisher, batch_size=7, until_empty=True).run()
        is StopReason.EMPTY
    )
    assert len(publisher.published) == 30
    assert len({e.task_id for e in publisher.published}) == 30
    assert OutboxMessage.objects.using(alias).count() == 0


def refuse_poison(message: StoredMessage) -> PublishResult | None:
    if message.envelope.task_id.startswith("poison"):
        return PublishResult(
            message.id, Outcome.FAILED, "PreconditionFailed: body too large"
        )
    return None


def test_a_poison_message_is_dead_lettered_after_its_attempts_and_blocks_nothing(
    alias: str,
) -> None:
    enqueue(alias, "good-1", "poison", "good-2")
    publisher = InMemoryPublisher(refuse_poison)
    relay = relay_for(alias, publisher, until_empty=True)
    deadline = time.monotonic() + 10
    while OutboxMessage.objects.using(alias).exists() and time.monotonic() < deadline:
        relay.run()
        time.sleep(0.02)
    assert sorted(e.task_id.split("-")[0] for e in publisher.published) == [
        "good",
        "good",
    ]
    dead = DeadLetter.objects.using(alias).get()
    assert dead.task_id.startswith("poison")
    assert dead.attempts == 3
    assert dead.last_error == "PreconditionFailed: body too large"


def test_an_outage_uses_no_attempts_and_opens_the_breaker(alias: str) -> None:
    enqueue(alias, "a", "b")
    publisher = InMemoryPublisher()
    publisher.down = True
    relay = relay_for(alias, publisher, breaker_threshold=1, broker_outage_cooldown=0.3)
    assert relay.run_once() is Cycle.PARTIAL
    rows = list(
        OutboxMessage.objects.using(alias).values_list("attempts", "lease_token")
    )
    assert rows == [(0, None), (0, None)]
    assert relay.breaker.is_open(relay.clock())
    assert relay.run_once() is Cycle.PAUSED  # claims nothing while open
    publisher.down = False
    time.sleep(0.35)
    assert relay.run_once() is Cycle.PARTIAL
    assert len(publisher.published) == 2
    assert DeadLetter.objects.using(alias).count() == 0


def test_a_failing_listener_never_undoes_a_settlement(alias: str) -> None:
    enqueue(alias, "a")
    seen: list[RelayEvent] = []

    def broken(event: RelayEvent) -> None:
        seen.append(event)
        raise RuntimeError("metrics are down")

    relay = Relay(
        OutboxStore(alias),
        InMemoryPublisher(),
        RelayConfig.from_settings(FAST),
        listeners=[broken],
    )
    assert relay.run_once() is Cycle.PARTIAL
    assert len(seen) == 1
    assert OutboxMessage.objects.using(alias).count() == 0


@pytest.mark.parametrize("alias", ["default"])
def test_stop_ends_an_idle_wait_at_once(alias: str) -> None:
    relay = relay_for(alias, InMemoryPublisher(), poll_interval=30.0)
    result: list[StopReason] = []

    thread = start_in_thread(relay, result)
    time.sleep(0.3)
    started = time.monotonic()
    relay.stop()
    thread.join(5)
    assert result == [StopReason.SIGNAL]
    assert time.monotonic() - started < 1.0


def test_stop_mid_batch_hands_back_unsent_rows_at_once(alias: str) -> None:
    enqueue(alias, *[f"s{i}" for i in range(10)])
    relays: list[Relay] = []

    def stop_after_three(message: StoredMessage) -> PublishResult | None:
        if len(publisher.published) == 2:
            relays[0].stop()  # as SIGTERM would, while the batch is being published
        return None

    publisher = InMemoryPublisher(stop_after_three)
    relays.append(relay_for(alias, publisher, batch_size=10))
    relays[0].run_once()
    assert len(publisher.published) == 3
    # The other seven were never started: no lease left on them, due now.
    rows = OutboxMessage.objects.using(alias)
    assert rows.count() == 7
    assert not rows.filter(lease_token__isnull=False).exists()
    successor = InMemoryPublisher()
    assert relay_for(alias, successor, until_empty=True).run() is StopReason.EMPTY
    assert len(successor.published) == 7


def test_a_slow_batch_keeps_its_lease(alias: str) -> None:
    enqueue(alias, "slow-1", "slow-2")
    store = OutboxStore(alias)
    stolen: list[int] = []

    def slow(message: StoredMessage) -> PublishResult | None:
        time.sleep(0.7)  # longer than the lease below: the relay must renew it
        stolen.extend(m.id for m in store.claim(10, 30).messages)
        return None

    relay = relay_for(
        alias, InMemoryPublisher(slow), lease_seconds=1.0, send_timeout=0.5
    )
    relay.run_once()
    assert stolen == []
    assert OutboxMessage.objects.using(alias).count() == 0


@pytest.mark.parametrize("alias", ["default"])
def test_the_liveness_file_is_touched_while_idle(alias: str, tmp_path: Path) -> None:
    path = tmp_path / "alive"
    relay = relay_for(
        alias,
        InMemoryPublisher(),
        poll_interval=30.0,
        liveness_file=str(path),
        liveness_interval=0.2,
    )

    thread = start_in_thread(relay)
    try:
        deadline = time.monotonic() + 5
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        first = path.stat().st_mtime
        time.sleep(1.6)
        assert path.stat().st_mtime > first, (
            "the idle relay stopped touching its liveness file"
        )
    finally:
        relay.stop()
        thread.join(5)
