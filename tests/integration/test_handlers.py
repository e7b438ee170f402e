"""Handler outboxes on every database: emit, order, coalescing, retries, pauses, flush."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connections, transaction
from django.utils import timezone

from celery_outbox.exceptions import (
    OutboxSerializationError,
    OutboxTransactionError,
    OutboxValueError,
)
from celery_outbox.handlers import emit, outbox_context, registry
from celery_outbox.handlers.models import (
    HandlerDeadLetter,
    HandlerMessage,
    HandlerPause,
    HandlerShard,
)
from celery_outbox.handlers.processor import Processor, ProcessorConfig
from celery_outbox.handlers.registry import Category, Registry
from celery_outbox.store.handlers.sql import HandlerStore
from tests.project.shop.models import TaskRun

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


class Calls:
    """What receivers saw, safe to append from several threads."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, **kwargs: Any) -> None:
        with self._lock:
            self.items.append(kwargs)

    def payloads(self, shard: str | None = None) -> list[Any]:
        return [c["payload"] for c in self.items if shard in (None, c["shard"])]


@pytest.fixture
def name() -> str:
    """A category name no other test uses."""
    return f"test.{uuid.uuid4().hex[:8]}"


@pytest.fixture
def categories() -> Registry:
    return Registry()


def processor(
    alias: str,
    categories: Registry,
    random_source: Callable[[], float] = random.random,
    **config: Any,
) -> Processor:
    options: dict[str, Any] = {
        "databases": (alias,),
        "lease_seconds": 10.0,
        "retry_base_seconds": 0.2,
        "poll_interval": 0.05,
        "until_empty": True,
    }
    options.update(config)
    return Processor(
        ProcessorConfig(**options), categories, random_source=random_source
    )


def recorder(calls: Calls, sleep: float = 0.0) -> Callable[..., None]:
    def receive(**kwargs: Any) -> None:
        if sleep:
            time.sleep(sleep)
        calls.add(**kwargs)

    return receive


def test_emit_writes_a_message_and_its_shard_with_the_transaction(
    alias: str, name: str
) -> None:
    with transaction.atomic(using=alias):
        emit(name, shard=("org", 7), object_id=1, payload={"a": 1}, using=alias)
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        emit(name, shard=("org", 8), object_id=1, payload={"a": 2}, using=alias)
        raise RuntimeError("roll back")
    rows = HandlerMessage.objects.using(alias).values_list("shard", "payload")
    assert list(rows) == [("org:7", '{"a":1}')]
    assert list(HandlerShard.objects.using(alias).values_list("shard", flat=True)) == [
        "org:7"
    ]


def test_a_payload_json_cannot_hold_is_refused_and_nothing_written(
    alias: str, name: str
) -> None:
    with transaction.atomic(using=alias):
        with pytest.raises(OutboxSerializationError, match="cannot be stored as JSON"):
            emit(name, shard="s", object_id=1, payload={"when": object()}, using=alias)
        with pytest.raises(OutboxSerializationError):
            emit(name, shard="s", object_id=1, payload=float("nan"), using=alias)
        with pytest.raises(OutboxValueError, match="object_id"):
            emit(name, shard="s", object_id="x" * 256, using=alias)
    assert not HandlerMessage.objects.using(alias).exists()


def test_outside_a_transaction_follows_the_task_policy(
    alias: str, name: str, settings: Any
) -> None:
    settings.CELERY_OUTBOX_OUTSIDE_TRANSACTION = "raise"
    with pytest.raises(OutboxTransactionError, match="outside"):
        emit(name, shard="s", object_id=1, using=alias)
    vendor = connections[alias].vendor
    other = next(a for a in connections if connections[a].vendor != vendor)
    with transaction.atomic(using=other), pytest.raises(OutboxTransactionError):
        emit(name, shard="s", object_id=1, using=alias)
    settings.CELERY_OUTBOX_OUTSIDE_TRANSACTION = "allow"
    emit(name, shard="s", object_id=1, using=alias)
    assert HandlerMessage.objects.using(alias).count() == 1


def test_messages_run_in_order_per_shard_and_empty_shards_go_away(
    alias: str, name: str, categories: Registry
) -> None:
    calls = Calls()
    categories.add(Category(name, recorder(calls), coalesce=False))
    with transaction.atomic(using=alias):
        for i in range(30):
            emit(name, shard=("org", i % 3), object_id=i, payload=i, using=alias)
    processor(alias, categories, window=4).run()
    for shard in range(3):
        assert calls.payloads(f"org:{shard}") == list(range(shard, 30, 3))
    assert not HandlerMessage.objects.using(alias).exists()
    assert not HandlerShard.objects.using(alias).exists()


def test_coalescing_runs_the_newest_message_of_each_object(
    alias: str, name: str, categories: Registry
) -> None:
    calls = Calls()
    categories.add(Category(name, recorder(calls)))
    with transaction.atomic(using=alias):
        for i in range(1000):
            emit(name, shard=("org", 1), object_id=i % 10, payload=i, using=alias)
    processor(alias, categories, window=1000).run()
    assert sorted(calls.payloads()) == list(range(990, 1000))
    stats = HandlerStore(alias).stats()
    assert stats.coalesced == {name: 990}
    assert stats.messages == 0


def test_a_category_that_opts_out_runs_every_message(
    alias: str, name: str, categories: Registry
) -> None:
    calls = Calls()
    categories.add(Category(name, recorder(calls), coalesce=False))
    with transaction.atomic(using=alias):
        for i in range(20):
            emit(name, shard="one", object_id=1, payload=i, using=alias)
    processor(alias, categories).run()
    assert calls.payloads() == list(range(20))


def test_a_failing_head_backs_off_forever_and_blocks_its_shard_only(
    alias: str, name: str, categories: Registry
) -> None:
    calls, attempts = Calls(), []

    def flaky(**kwargs: Any) -> None:
        if kwargs["object_id"] == "bad":
            attempts.append(kwargs["attempt"])
            raise ValueError("boom")
        calls.add(**kwargs)

    categories.add(Category(name, flaky, coalesce=False))
    with transaction.atomic(using=alias):
        emit(name, shard="a", object_id="bad", using=alias)
        emit(name, shard="a", object_id="after", payload="a2", using=alias)
        emit(name, shard="b", object_id="ok", payload="b1", using=alias)
    # Jitter in the middle of its range: the wait checked below is then well inside
    # its bounds, whatever time passes before it is read.
    run = processor(alias, categories, lambda: 0.5, retry_base_seconds=0.2)
    deadline = time.monotonic() + 20
    while len(attempts) < 4 and time.monotonic() < deadline:
        run.run()
        time.sleep(0.05)
    assert attempts[:4] == [1, 2, 3, 4]
    assert calls.payloads() == ["b1"]  # shard b ran; a is blocked behind its head
    shard = HandlerShard.objects.using(alias).get(shard="a")
    assert shard.attempts >= 4 and "ValueError: boom" in shard.last_error
    wait = (shard.next_attempt_at - timezone.now()).total_seconds()
    assert 0.2 * 2 ** (shard.attempts - 2) < wait <= 0.2 * 2 ** (shard.attempts - 1)
    stats = HandlerStore(alias).stats()
    assert (stats.blocked, stats.messages) == (1, 2)
    assert not HandlerDeadLetter.objects.using(alias).exists()


def test_max_attempts_dead_letters_the_head_and_the_shard_goes_on(
    alias: str, name: str, categories: Registry
) -> None:
    calls, attempts = Calls(), []

    def poison(**kwargs: Any) -> None:
        if kwargs["payload"] == "poison":
            attempts.append(kwargs["attempt"])
            raise KeyError("missing")
        calls.add(**kwargs)

    categories.add(Category(name, poison, coalesce=False, max_attempts=3))
    with transaction.atomic(using=alias):
        emit(name, shard="a", object_id=1, payload="poison", using=alias)
        emit(name, shard="a", object_id=2, payload="next", using=alias)
    run = processor(alias, categories, retry_base_seconds=0.05)
    deadline = time.monotonic() + 20
    while not calls.items and time.monotonic() < deadline:
        run.run()
        time.sleep(0.05)
    assert attempts == [1, 2, 3]
    assert calls.payloads() == ["next"]
    dead = HandlerDeadLetter.objects.using(alias).get()
    assert (dead.payload, dead.attempts) == ('"poison"', 3)
    assert "KeyError: 'missing'" in dead.last_error
    assert HandlerStore(alias).stats().dead_lettered == {name: 1}


def test_an_atomic_receiver_commits_with_its_message_or_not_at_all(
    alias: str, name: str, categories: Registry
) -> None:
    tag = uuid.uuid4().hex[:8]
    runs = []

    def write_then_fail(**kwargs: Any) -> None:
        runs.append(kwargs["attempt"])
        TaskRun.objects.using(alias).create(task_id="t", task_name=name, tag=tag)
        if kwargs["attempt"] == 1:
            raise RuntimeError("first run fails")

    categories.add(Category(name, write_then_fail))
    with transaction.atomic(using=alias):
        emit(name, shard="a", object_id=1, using=alias)
    # The retry waits 0.25 to 0.5 s (jittered): not within the first run.
    run = processor(alias, categories, retry_base_seconds=0.5)
    run.run()
    assert TaskRun.objects.using(alias).filter(tag=tag).count() == 0
    time.sleep(0.6)
    run.run()
    assert runs == [1, 2]
    assert TaskRun.objects.using(alias).filter(tag=tag).count() == 1
    assert not HandlerMessage.objects.using(alias).exists()


def test_an_atomic_receiver_that_swallows_a_database_error_is_charged(
    alias: str, name: str, categories: Registry
) -> None:
    """PostgreSQL aborts the transaction at the error: the message's deletion then
    failed as if the database were down, and the receiver ran again at every pass
    (120 times in 5 s), no attempt charged."""
    runs: list[int] = []

    def swallow(*, attempt: int, **_: Any) -> None:
        runs.append(attempt)
        try:
            with connections[alias].cursor() as cursor:
                cursor.execute("SELECT no_such_column FROM celery_outbox_handler_shard")
        except DatabaseError:
            pass  # the receiver's own mistake, hidden

    categories.add(Category(name, swallow, max_attempts=2))
    with transaction.atomic(using=alias):
        emit(name, shard="a", object_id=1, using=alias)
    run = processor(alias, categories, retry_base_seconds=0.01, until_empty=False)

    def serve() -> None:
        try:
            run.run()
        finally:
            connections.close_all()  # this thread's

    thread = threading.Thread(target=serve)
    thread.start()
    deadline = time.monotonic() + 10
    while HandlerMessage.objects.using(alias).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    run.stop()
    thread.join(10)
    assert not HandlerMessage.objects.using(alias).exists()
    if connections[alias].vendor == "postgresql":
        assert runs == [1, 2]
        dead = HandlerDeadLetter.objects.using(alias).get()
        assert "current transaction is aborted" in dead.last_error
    else:  # the transaction survives the error: the message is done
        assert runs == [1]


def test_pause_and_resume_a_category_and_a_shard(
    alias: str, name: str, categories: Registry
) -> None:
    calls = Calls()
    categories.add(Category(name, recorder(calls), coalesce=False))
    store = HandlerStore(alias)
    assert store.pause(HandlerPause.Kind.CATEGORY, name, "incident 12")
    assert not store.pause(HandlerPause.Kind.CATEGORY, name)
    store.pause(HandlerPause.Kind.SHARD, "b")
    with transaction.atomic(using=alias):
        emit(name, shard="a", object_id=1, payload="a", using=alias)
        emit(name, shard="b", object_id=1, payload="b", using=alias)
    processor(alias, categories).run()
    assert calls.items == []
    stats = store.stats()
    assert stats.paused_categories == (name,)
    assert stats.paused_shard_keys == ("b",)
    assert (stats.paused_shards, stats.messages, stats.lag) == (2, 2, None)
    assert store.resume(HandlerPause.Kind.CATEGORY, name)
    processor(alias, categories).run()
    assert calls.payloads() == ["a"]
    assert store.resume(HandlerPause.Kind.SHARD, "b")
    processor(alias, categories).run()
    assert calls.payloads() == ["a", "b"]
    assert not store.resume(HandlerPause.Kind.SHARD, "b")


@pytest.mark.parametrize("switch", ["--name", "--key"])
def test_a_pause_stops_a_running_shard_at_the_next_message(
    alias: str, name: str, switch: str
) -> None:
    calls = Calls()
    target = name if switch == "--name" else "org:1"

    def pause_while_running(**kwargs: Any) -> None:
        calls.add(**kwargs)
        if len(calls.items) == 1:  # an operator pauses while the shard runs
            call_command(
                "outbox", "handlers", "pause", switch, target, "--database", alias
            )

    registry.add(Category(name, pause_while_running, coalesce=False, atomic=False))
    try:
        with transaction.atomic(using=alias):
            for n in range(20):
                emit(name, shard="org:1", object_id=n, payload=n, using=alias)
        processor(alias, registry).run()
        assert calls.payloads() == [0]  # the message in hand, and no other
        assert HandlerMessage.objects.using(alias).count() == 19
        call_command(
            "outbox", "handlers", "resume", switch, target, "--database", alias
        )
        processor(alias, registry).run()
        assert calls.payloads() == list(range(20))
    finally:
        registry.remove(name)


def test_flush_on_commit_runs_in_the_writing_process(alias: str, name: str) -> None:
    calls = Calls()
    registry.add(Category(name, recorder(calls)))
    try:
        with outbox_context(flush=True), transaction.atomic(using=alias):
            emit(name, shard="a", object_id=1, payload="now", using=alias)
            with outbox_context(flush=False):
                emit(name, shard="b", object_id=1, payload="later", using=alias)
            assert calls.items == []  # nothing before the commit
        assert calls.payloads() == ["now"]
        with transaction.atomic(using=alias):
            emit(
                name,
                shard="c",
                object_id=1,
                payload="per call",
                using=alias,
                flush=True,
            )
        assert calls.payloads() == ["now", "per call"]
        with pytest.raises(RuntimeError), transaction.atomic(using=alias):
            with outbox_context(flush=True):
                emit(name, shard="d", object_id=1, payload="rolled back", using=alias)
            raise RuntimeError
        assert calls.payloads() == ["now", "per call"]
        shards = HandlerShard.objects.using(alias).values_list("shard", flat=True)
        assert list(shards) == ["b"]
    finally:
        registry.remove(name)


def test_a_failing_flush_leaves_the_message_to_the_processor(
    alias: str, name: str
) -> None:
    def fail(**kwargs: Any) -> None:
        raise RuntimeError("downstream is down")

    registry.add(Category(name, fail))
    try:
        with outbox_context(), transaction.atomic(using=alias):
            emit(name, shard="a", object_id=1, using=alias)
    finally:
        registry.remove(name)
    shard = HandlerShard.objects.using(alias).get()
    assert (shard.attempts, shard.lease_token) == (1, None)
    assert HandlerMessage.objects.using(alias).count() == 1


def test_a_shard_row_lost_to_a_race_is_recovered(
    alias: str, name: str, categories: Registry
) -> None:
    calls = Calls()
    categories.add(Category(name, recorder(calls)))
    with transaction.atomic(using=alias):
        emit(name, shard="a", object_id=1, payload=1, using=alias)
    HandlerShard.objects.using(alias).all().delete()  # as if a processor emptied it
    processor(alias, categories).run()
    assert calls.payloads() == [1]


def test_stats_list_the_deepest_shards_and_the_oldest_head(
    alias: str, name: str
) -> None:
    with transaction.atomic(using=alias):
        for i in range(6):
            emit(name, shard=f"s{i % 3}", object_id=i, payload=i, using=alias)
        emit(name, shard="s0", object_id=9, using=alias)
    HandlerMessage.objects.using(alias).update(
        created_at=timezone.now() - timedelta(seconds=60)
    )
    stats = HandlerStore(alias).stats(top=2)
    assert [(d.shard, d.messages) for d in stats.deepest] == [("s0", 3), ("s1", 2)]
    assert stats.oldest_age is not None and 59 < stats.oldest_age < 120
    assert (stats.messages, stats.shards, stats.blocked) == (7, 3, 0)


@pytest.mark.parametrize("vendor", ["postgresql", "mysql"])
def test_two_processors_keep_every_shard_in_order(
    vendor: str, name: str, categories: Registry
) -> None:
    alias = next(a for a in connections if connections[a].vendor == vendor)
    calls = Calls()
    running: set[str] = set()
    overlaps = []

    def slow(**kwargs: Any) -> None:
        shard = kwargs["shard"]
        if shard in running:
            overlaps.append(shard)
        running.add(shard)
        time.sleep(0.01)
        running.discard(shard)
        calls.add(thread=threading.current_thread().name, **kwargs)

    categories.add(Category(name, slow, coalesce=False))
    with transaction.atomic(using=alias):
        for i in range(120):
            emit(name, shard=f"s{i % 6}", object_id=i, payload=i, using=alias)
    run_in_threads(
        [processor(alias, categories, window=5, windows_per_claim=1) for _ in range(2)]
    )
    assert overlaps == []
    assert len(calls.items) == 120
    for shard in range(6):
        assert calls.payloads(f"s{shard}") == list(range(shard, 120, 6))
    threads = {c["thread"] for c in calls.items}
    assert len(threads) == 2  # both processors took part


@pytest.mark.parametrize("vendor", ["postgresql", "mysql", "sqlite"])
def test_a_receiver_longer_than_the_lease_renews_it_and_runs_once(
    vendor: str, name: str, categories: Registry
) -> None:
    alias = next(a for a in connections if connections[a].vendor == vendor)
    calls = Calls()
    categories.add(Category(name, recorder(calls, sleep=2.5), atomic=False))
    with transaction.atomic(using=alias):
        emit(name, shard="a", object_id=1, payload="long", using=alias)
    run_in_threads(
        [processor(alias, categories, lease_seconds=0.6) for _ in range(2)],
        stagger=0.8,
    )
    assert calls.payloads() == ["long"]


def run_in_threads(processors: list[Processor], stagger: float = 0.0) -> None:
    errors: list[BaseException] = []

    def work(p: Processor) -> None:
        try:
            p.run()
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work, args=(p,)) for p in processors]
    for thread in threads:
        thread.start()
        time.sleep(stagger)
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_the_commands_run_pause_resume_and_report(
    alias: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = Calls()
    registry.add(Category(name, recorder(calls)))
    try:
        call_command("outbox", "handlers", "pause", "--name", name, "--database", alias)
        with transaction.atomic(using=alias):
            emit(name, shard="a", object_id=1, payload="x", using=alias)
        with pytest.raises(CommandError) as held:  # only a pause holds it (#45)
            call_command(
                "outbox", "handlers", "run", "--until-empty", "--database", alias
            )
        assert held.value.returncode == 3
        assert calls.items == []
        call_command("outbox", "handlers", "stats", "--database", alias, "--top", "3")
        out = capsys.readouterr().out
        assert f"paused categories: {name}" in out and "a: 1" in out
        call_command(
            "outbox", "handlers", "resume", "--name", name, "--database", alias
        )
        call_command("outbox", "handlers", "run", "--until-empty", "--database", alias)
        assert calls.payloads() == ["x"]
    finally:
        registry.remove(name)


def test_the_migrations_match_the_models() -> None:
    call_command(
        "makemigrations",
        "celery_outbox_handlers",
        check=True,
        dry_run=True,
        verbosity=0,
    )


def test_the_admin_pauses_and_resumes(admin_client: Any, name: str) -> None:
    with transaction.atomic():
        emit(name, shard="a", object_id=1, payload=1)
    store = HandlerStore("default")
    store.hold(
        store.claim("t" * 32, 10.0) or pytest.fail("no shard to claim"), name, 60.0
    )
    url = "/admin/celery_outbox_handlers/handlerpause/"
    response = admin_client.post(
        url + "add/", {"kind": "category", "value": name, "reason": "incident"}
    )
    assert response.status_code == 302
    assert store.pauses().categories == {name}
    pause = HandlerPause.objects.get()
    response = admin_client.post(url + f"{pause.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert store.pauses().categories == frozenset()
    shard = HandlerShard.objects.get()
    assert shard.held_by == "" and shard.next_attempt_at <= timezone.now()
    for model in ("handlermessage", "handlershard", "handlerdeadletter"):
        page = admin_client.get(f"/admin/celery_outbox_handlers/{model}/")
        assert page.status_code == 200


def test_the_admin_shows_handler_rows_read_only(admin_client: Any, name: str) -> None:
    with transaction.atomic():
        emit(name, shard="a", object_id=1, payload=1)
    message = HandlerMessage.objects.get()
    base = "/admin/celery_outbox_handlers/handlermessage/"
    assert admin_client.get(base + "add/").status_code == 403
    response = admin_client.post(
        base + f"{message.pk}/change/", {"category": "other", "shard": "b"}
    )
    assert response.status_code == 403
    message.refresh_from_db()
    assert (message.category, message.shard) == (name, "a")
