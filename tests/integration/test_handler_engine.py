"""The handler processor on the engine: coalescing per shard, takeover, liveness, purge.

Each test runs on every database (PostgreSQL, MariaDB, SQLite).
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connections, transaction
from django.utils import timezone

from celery_outbox.handlers import emit
from celery_outbox.handlers.models import (
    HandlerDeadLetter,
    HandlerMessage,
    HandlerProcessor,
)
from celery_outbox.handlers.processor import Processor, ProcessorConfig
from celery_outbox.handlers.registry import Category, Registry
from celery_outbox.store.handlers.sql import HandlerStore

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture
def name() -> str:
    """A category name no other test uses."""
    return f"test.{uuid.uuid4().hex[:8]}"


def running(processor: Processor) -> threading.Thread:
    """Run ``processor`` on a thread that closes its connections when it ends."""

    def run() -> None:
        try:
            processor.run()
        finally:
            connections.close_all()

    worker = threading.Thread(target=run)
    worker.start()
    return worker


def config(alias: str, **changes: Any) -> ProcessorConfig:
    options: dict[str, Any] = {
        "databases": (alias,),
        "lease_seconds": 10.0,
        "poll_interval": 0.05,
        "until_empty": True,
        "heartbeat_interval": None,
    }
    options.update(changes)
    return ProcessorConfig(**options)


def test_no_receiver_runs_for_an_object_whose_newer_message_waits_further_on(
    alias: str, name: str
) -> None:
    # 40 updates of 3 objects in one shard, read 5 at a time: every object's
    # messages straddle many reads, and only its newest payload may run.
    seen: list[tuple[str, int]] = []
    log = f"{name}.log"
    categories = Registry()
    categories.add(
        Category(
            name, lambda *, object_id, payload, **_: seen.append((object_id, payload))
        )
    )
    categories.add(
        Category(
            log, lambda *, payload, **_: seen.append(("log", payload)), coalesce=False
        )
    )
    with transaction.atomic(using=alias):
        for n in range(40):
            emit(name, shard="org:1", object_id=n % 3, payload=n, using=alias)
        emit(log, shard="org:1", object_id=0, payload=100, using=alias)
        emit(log, shard="org:1", object_id=0, payload=101, using=alias)

    Processor(config(alias, window=5), categories).run()

    # Each newest payload runs where it was written; the log runs every message.
    assert seen == [("1", 37), ("2", 38), ("0", 39), ("log", 100), ("log", 101)]
    assert not HandlerMessage.objects.using(alias).exists()


def test_a_dead_processors_shard_is_taken_within_seconds_not_after_its_lease(
    alias: str, name: str
) -> None:
    ran: list[Any] = []
    categories = Registry()
    categories.add(Category(name, lambda *, payload, **_: ran.append(payload)))
    with transaction.atomic(using=alias):
        emit(name, shard="org:1", object_id=1, payload="once", using=alias)
    # A processor that claimed the shard for five minutes, then died (kill -9):
    # it beat, then stopped beating.
    dead = HandlerStore(alias, holder="d" * 32)
    dead.beat("d" * 32, "dead:1")
    assert dead.claim("t" * 32, 300.0) is not None
    HandlerProcessor.objects.using(alias).update(
        seen_at=timezone.now() - timedelta(seconds=60)
    )

    processor = Processor(
        config(alias, until_empty=False, heartbeat_interval=0.2), categories
    )
    started = time.monotonic()
    worker = running(processor)
    try:
        messages = HandlerMessage.objects.using(alias)
        while messages.exists() and time.monotonic() - started < 10:
            time.sleep(0.05)
    finally:
        processor.stop()
        worker.join(10)
    assert ran == ["once"]
    assert time.monotonic() - started < 5
    # The dead one's heartbeat row is gone, and so is the stopped one's.
    assert not HandlerProcessor.objects.using(alias).exists()


def test_a_silent_processors_late_write_is_fenced_once_the_shard_is_claimed_again(
    alias: str, name: str
) -> None:
    with transaction.atomic(using=alias):
        emit(name, shard="org:1", object_id=1, payload=1, using=alias)
    slow = HandlerStore(alias, holder="s" * 32)
    slow.beat("s" * 32, "slow:1")
    lease = slow.claim("t" * 32, 300.0)
    assert lease is not None
    HandlerProcessor.objects.using(alias).update(
        seen_at=timezone.now() - timedelta(seconds=60)
    )
    other = HandlerStore(alias, holder="o" * 32)
    other.beat("o" * 32, "other:1")
    assert other.take_over(5.0) == 1
    assert other.claim("u" * 32, 30.0) is not None
    assert not slow.renew(lease, 30.0)


def test_the_processor_touches_its_liveness_file(
    alias: str, name: str, tmp_path: Path
) -> None:
    live = tmp_path / "alive"
    processor = Processor(
        config(alias, until_empty=False, liveness_file=str(live)), Registry()
    )
    worker = running(processor)
    try:
        deadline = time.monotonic() + 5
        while not live.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        processor.stop()
        worker.join(10)
    assert live.exists()


def test_handler_dead_letters_older_than_the_retention_are_purged(
    alias: str, name: str
) -> None:
    def poison(**_: Any) -> None:
        raise ValueError("poison")

    categories = Registry()
    categories.add(Category(name, poison, coalesce=False, max_attempts=1))
    with transaction.atomic(using=alias):
        emit(name, shard="a", object_id=1, payload="old", using=alias)
        emit(name, shard="b", object_id=1, payload="new", using=alias)
    Processor(config(alias), categories).run()
    dead = HandlerDeadLetter.objects.using(alias)
    assert dead.count() == 2
    dead.filter(shard="a").update(died_at=timezone.now() - timedelta(days=2))

    assert HandlerStore(alias).purge_dead_letters(86400.0) == 1
    assert list(dead.values_list("shard", flat=True)) == ["b"]
