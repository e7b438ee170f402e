"""Operating handler outboxes on every database: metrics, stats, replaying dead letters."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import prometheus_client
import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.core.management import CommandError, call_command
from django.db import transaction
from django.test import Client, override_settings
from django.utils import timezone

from celery_outbox.handlers import emit, registry
from celery_outbox.handlers.metrics import HandlerMetrics
from celery_outbox.handlers.models import (
    HandlerDeadLetter,
    HandlerMessage,
    HandlerShard,
)
from celery_outbox.handlers.observations import HandlerObservation, MessageHandled
from celery_outbox.handlers.processor import Processor, ProcessorConfig
from celery_outbox.handlers.registry import Category, Registry
from celery_outbox.outcomes import Action
from celery_outbox.sinks import PrometheusSink
from celery_outbox.store.handlers.sql import HandlerStore

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture
def name() -> str:
    """A category name no other test uses."""
    return f"test.{uuid.uuid4().hex[:8]}"


def processor(
    alias: str, categories: Registry, observers: Any = (), **config: Any
) -> Processor:
    options: dict[str, Any] = {
        "databases": (alias,),
        "lease_seconds": 10.0,
        "retry_base_seconds": 0.05,
        "poll_interval": 0.05,
        "until_empty": True,
    }
    options.update(config)
    return Processor(ProcessorConfig(**options), categories, observers=observers)


def run_until(run: Processor, done: Any, seconds: float = 20.0) -> None:
    """Run passes (a failing head backs off between them) until ``done()``."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        run.run()
        time.sleep(0.05)
    assert done()


def test_the_processor_reports_metrics_like_the_relay(alias: str, name: str) -> None:
    prometheus = prometheus_client.CollectorRegistry()
    metrics = HandlerMetrics(PrometheusSink(prometheus), (alias,))
    categories = Registry()
    ran: list[Any] = []

    def receive(**kwargs: Any) -> None:
        if kwargs["payload"] == "poison":
            raise ValueError("boom")
        ran.append(kwargs["payload"])

    categories.add(Category(name, receive, max_attempts=2))
    with transaction.atomic(using=alias):
        for version in range(3):  # three versions of one object: two coalesce
            emit(name, shard="a", object_id=1, payload=f"v{version}", using=alias)
        emit(name, shard="b", object_id=2, payload="poison", using=alias)
        emit(name, shard="c", object_id=3, payload="c", using=alias)
    HandlerMessage.objects.using(alias).update(
        created_at=timezone.now() - timedelta(seconds=30)
    )

    run_until(
        processor(alias, categories, [metrics]),
        lambda: HandlerDeadLetter.objects.using(alias).exists(),
    )

    value = prometheus.get_sample_value
    assert sorted(ran) == ["c", "v2"]
    assert value("celery_outbox_handler_processed_total") == 2
    assert value("celery_outbox_handler_coalesced_total") == 2
    assert value("celery_outbox_handler_retried_total") == 1
    assert value("celery_outbox_handler_dead_lettered_total") == 1
    assert value("celery_outbox_handler_run_seconds_count") == 4
    # written 30 s before the run: the lag histogram saw it (database clock)
    assert value("celery_outbox_handler_commit_to_done_seconds_count") == 2
    total = value("celery_outbox_handler_commit_to_done_seconds_sum") or 0.0
    assert 60 <= total < 120
    metrics.sample()
    assert value("celery_outbox_handler_messages") == 0
    assert value("celery_outbox_handler_dead") == 1


def test_the_command_sends_statsd_metrics(
    name: str, registered: list[Any], settings: Any
) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.settimeout(2.0)
    settings.CELERY_OUTBOX_STATSD_ADDRESS = f"127.0.0.1:{server.getsockname()[1]}"
    with transaction.atomic():
        emit(name, shard="a", object_id=1, payload="x")
    lines: set[str] = set()
    try:
        call_command(
            "outbox", "handlers", "run", "--until-empty", "--database", "default"
        )
        while "celery_outbox_handler_messages:0|g" not in lines:
            lines.add(server.recv(1024).decode())
    except TimeoutError:
        pass
    finally:
        server.close()
    assert registered == ["x"]
    assert "celery_outbox_handler_processed_total:1|c" in lines
    assert any(line.startswith("celery_outbox_handler_run_seconds:") for line in lines)
    assert "celery_outbox_handler_messages:0|g" in lines


def test_a_listener_that_raises_stops_nothing(alias: str, name: str) -> None:
    seen: list[HandlerObservation] = []

    def broken(event: HandlerObservation) -> None:
        raise RuntimeError("listener bug")

    categories = Registry()
    categories.add(Category(name, lambda **kw: None))
    with transaction.atomic(using=alias):
        emit(name, shard="a", object_id=1, payload=1, using=alias)
    processor(alias, categories, [broken, seen.append]).run()
    handled = [e for e in seen if isinstance(e, MessageHandled)]
    assert [(e.shard, e.category, e.action) for e in handled] == [
        ("a", name, Action.DELETE)
    ]
    assert not HandlerMessage.objects.using(alias).exists()


def test_stats_show_waiting_held_and_blocked_shards(alias: str, name: str) -> None:
    categories = Registry()

    def fail_on_bad(**kwargs: Any) -> None:
        if kwargs["object_id"] == "bad":
            raise KeyError("no such org")

    categories.add(Category(name, fail_on_bad, coalesce=False))
    with transaction.atomic(using=alias):
        emit(name, shard="blocked", object_id="bad", using=alias)
        emit(name, shard="blocked", object_id="after", using=alias)
    processor(alias, categories, retry_base_seconds=600.0).run()
    with transaction.atomic(using=alias):
        emit(name, shard="w1", object_id=1, using=alias)
        emit(name, shard="w2", object_id=1, using=alias)
        emit(name, shard="held", object_id=1, using=alias)
    store = HandlerStore(alias)
    lease = store.claim("t" * 32, 60.0, ["held"])
    assert lease is not None

    stats = store.stats(top=5)

    assert (stats.shards, stats.waiting, stats.leased, stats.blocked) == (4, 2, 1, 1)
    (blocked,) = stats.blocked_shards
    assert (blocked.shard, blocked.category, blocked.attempts) == ("blocked", name, 1)
    assert "KeyError: 'no such org'" in blocked.last_error
    assert blocked.failing_seconds is not None and blocked.failing_seconds < 60
    # Jittered: between half the wait and the whole of it.
    assert 290 < blocked.next_attempt_seconds <= 600
    out = run_stats(alias)
    assert "shards waiting for a processor: 2" in out
    assert "shards held by a processor: 1" in out
    assert f"blocked: {name} message {blocked.head_id}, 1 attempt(s)" in out
    assert "KeyError: 'no such org'" in out


def run_stats(alias: str) -> str:
    from io import StringIO

    out = StringIO()
    call_command("outbox", "handlers", "stats", "--database", alias, stdout=out)
    return out.getvalue()


def dead_letter(alias: str, name: str, categories: Registry, *payloads: str) -> None:
    """Run ``payloads`` (one shard) through a receiver that always fails, once each."""
    categories.add(Category(name, _always_fails, coalesce=False, max_attempts=1))
    with transaction.atomic(using=alias):
        for n, payload in enumerate(payloads):
            emit(name, shard="org:1", object_id=n, payload=payload, using=alias)
    processor(alias, categories).run()
    assert HandlerDeadLetter.objects.using(alias).count() == len(payloads)
    categories.remove(name)


def _always_fails(**kwargs: Any) -> None:
    raise ValueError("down")


@pytest.fixture
def registered(name: str) -> Iterator[list[Any]]:
    """``name`` in the process registry (the command's) with a recording receiver."""
    ran: list[Any] = []
    registry.add(Category(name, lambda **kw: ran.append(kw["payload"])))
    yield ran
    registry.remove(name)


def test_the_command_replays_dead_letters_in_order_at_the_end_of_the_shard(
    alias: str, name: str
) -> None:
    dead_letter(alias, name, Registry(), "first", "second")
    with transaction.atomic(using=alias):
        emit(name, shard="org:1", object_id=9, payload="newer", using=alias)
    ran: list[Any] = []
    categories = Registry()
    categories.add(Category(name, lambda **kw: ran.append(kw["payload"])))

    with pytest.raises(CommandError, match="--all"):
        call_command("outbox", "handlers", "replay", "--database", alias)
    call_command("outbox", "handlers", "replay", "--name", name, "--database", alias)

    assert not HandlerDeadLetter.objects.using(alias).exists()
    processor(alias, categories).run()
    assert ran == ["newer", "first", "second"]  # behind what the shard held


def test_replay_leaves_a_dead_letter_a_newer_message_of_its_object_supersedes(
    alias: str, name: str, registered: list[Any]
) -> None:
    dead_letter(alias, name, Registry(), "old state")  # then it coalesced, too
    with transaction.atomic(using=alias):
        emit(name, shard="org:1", object_id=0, payload="new state", using=alias)

    report = HandlerStore(alias).replay(coalesces=registry.coalesces)

    assert (report.replayed, report.superseded) == (0, 1)
    assert HandlerDeadLetter.objects.using(alias).get().payload == '"old state"'
    processor(alias, registry).run()
    assert registered == ["new state"]


class HandlersOn:
    """A router that puts the handler tables on one alias (the admin reads through it)."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return self.alias if model._meta.app_label == "celery_outbox_handlers" else None

    db_for_write = db_for_read


def test_the_admin_replays_the_selected_dead_letters(
    alias: str, name: str, admin_client: Client
) -> None:
    dead_letter(alias, name, Registry(), "keep", "again")
    again = HandlerDeadLetter.objects.using(alias).get(payload='"again"')
    url = "/admin/celery_outbox_handlers/handlerdeadletter/"

    with override_settings(DATABASE_ROUTERS=[HandlersOn(alias)]):
        listed = admin_client.get(url).content.decode()
        page = admin_client.post(
            url, {"action": "replay", "_selected_action": [again.pk]}, follow=True
        )

    assert "Replay (run again, at the end of their shards)" in listed
    assert "1 dead letter(s) replayed." in page.content.decode()
    assert list(
        HandlerDeadLetter.objects.using(alias).values_list("payload", flat=True)
    ) == ['"keep"']
    message = HandlerMessage.objects.using(alias).get()
    assert (message.shard, message.payload) == ("org:1", '"again"')
    assert HandlerShard.objects.using(alias).filter(shard="org:1").exists()
    assert list(
        LogEntry.objects.filter(action_flag=CHANGE).values_list(
            "change_message", flat=True
        )
    ) == ["Replayed at the end of its shard."]
