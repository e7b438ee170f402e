"""Each message's history and ``outbox tasks inspect``, on every database alias."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from celery_outbox.exceptions import OutboxConfigurationError
from celery_outbox.models import DeadLetter, HistoryEvent
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.store import DeadLetterFilter, Stores
from celery_outbox.store.history import process_name
from celery_outbox.tasks import purge_dead_letters

from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

ROOT = Path(__file__).resolve().parents[2]
RELAY = "a" * 32
#: The name the relay's heartbeat row gives it (a relay writes ``host:pid``).
RELAY_NAME = "relay-host:4242"


@pytest.fixture
def store(alias: str) -> Stores:
    """A relay's stores with history on, its heartbeat row written."""
    stores = Stores(alias, holder=RELAY, history=True)
    stores.registry().beat(RELAY, RELAY_NAME)
    return stores


def add(store: Stores, *tags: str) -> list[str]:
    """Commit one row per tag; their task ids."""
    envelopes = [envelope(tag) for tag in tags]
    with transaction.atomic(using=store.alias):
        store.writer().insert(envelopes)
    return [e.task_id for e in envelopes]


def settle_all(
    store: Stores, action: Action, error: str = "", delay: float = 0.0
) -> int:
    """Claim every due row and settle each with ``action``; how many were claimed."""
    claim = store.relay().claim(100, 30)
    decisions = [Decision(m.id, action, delay, error) for m in claim.messages]
    store.relay().settle(claim.token, Settlement.of(decisions))
    return len(decisions)


def events(alias: str, task_id: str) -> list[tuple[str, int, str]]:
    """A task's events as (event, attempt, reason), oldest first."""
    return [
        (e.event, e.attempt, e.error)
        for e in HistoryEvent.objects.using(alias)
        .filter(task_id=task_id)
        .order_by("id")
    ]


# -- what the history records -----------------------------------------------------


def test_retries_then_publish_are_recorded_with_reasons_and_relay(
    alias: str, store: Stores
) -> None:
    (task_id,) = add(store, "a")
    settle_all(store, Action.RETRY, "NotFound: no queue 'emails'")
    settle_all(store, Action.RETRY, "PreconditionFailed: inequivalent arg")
    settle_all(store, Action.DELETE)

    assert events(alias, task_id) == [
        ("retrying", 1, "NotFound: no queue 'emails'"),
        ("retrying", 2, "PreconditionFailed: inequivalent arg"),
        ("published", 3, ""),
    ]
    rows = list(HistoryEvent.objects.using(alias).filter(task_id=task_id))
    assert {(r.relay_id, r.task_name) for r in rows} == {(RELAY, "shop.record")}
    assert all(r.process.endswith(f":{os.getpid()}") for r in rows)
    # The enqueue is the row's creation, carried by every event; nothing is later.
    assert len({r.enqueued_at for r in rows}) == 1
    assert all(r.enqueued_at <= r.at for r in rows)
    assert rows[0].at <= rows[1].at <= rows[2].at


def test_a_dead_letter_and_its_replay_keep_the_broker_reason(
    alias: str, store: Stores
) -> None:
    (task_id,) = add(store, "a")
    settle_all(store, Action.DEAD_LETTER, "PreconditionFailed: message too big")
    dead = DeadLetter.objects.using(alias).get(task_id=task_id)
    report = store.operator().replay_dead_letters(DeadLetterFilter(ids=(dead.id,)))
    assert report.replayed == 1
    settle_all(store, Action.DELETE)

    assert events(alias, task_id) == [
        ("dead", 1, "PreconditionFailed: message too big"),
        ("replayed", 1, "PreconditionFailed: message too big"),
        ("published", 1, ""),
    ]


def test_moving_to_the_dead_letters_by_hand_is_recorded(
    alias: str, store: Stores
) -> None:
    (task_id,) = add(store, "a")
    row = store.history_log().trace(task_id).rows[0]
    assert store.operator().move_to_dead_letters(
        [row.id], "moved by alice from the admin"
    ) == [row.id]
    assert events(alias, task_id) == [("dead", 0, "moved by alice from the admin")]


def test_strict_heads_and_blocked_heads_are_recorded(alias: str, store: Stores) -> None:
    held, blocked = add(store, "held", "blocked")
    claim = store.relay().claim(10, 30)
    by_task = {m.envelope.task_id: m.id for m in claim.messages}
    store.relay().settle(
        claim.token,
        Settlement(
            hold=(Decision(by_task[held], Action.HOLD, 300.0),),
            block=(Decision(by_task[blocked], Action.BLOCK, 0.0, "NotFound: q"),),
        ),
    )
    assert events(alias, held) == [("published", 1, "")]
    assert events(alias, blocked) == [("blocked", 1, "NotFound: q")]


def test_a_batch_is_recorded_in_one_statement(alias: str, store: Stores) -> None:
    add(store, *[f"t{n}" for n in range(40)])
    claim = store.relay().claim(100, 30)
    with CaptureQueriesContext(connections[alias]) as queries:
        store.relay().settle(
            claim.token, Settlement(delete=tuple(m.id for m in claim.messages))
        )
    inserts = [q for q in queries if "INSERT INTO celery_outbox_history" in q["sql"]]
    assert len(inserts) == 1
    assert HistoryEvent.objects.using(alias).filter(event="published").count() == 40


def test_a_lost_lease_records_nothing(alias: str, store: Stores) -> None:
    (task_id,) = add(store, "a")
    claim = store.relay().claim(10, 30)
    report = store.relay().settle(
        "someone-elses-token",
        Settlement(delete=tuple(m.id for m in claim.messages)),
    )
    assert report.deleted == 0
    assert events(alias, task_id) == []


def test_history_off_writes_nothing(alias: str) -> None:
    store = Stores(alias, holder=RELAY, history=False)
    add(store, "a", "b")
    settle_all(store, Action.RETRY, "NotFound: q")
    settle_all(store, Action.DEAD_LETTER, "NotFound: q")
    store.operator().replay_dead_letters(DeadLetterFilter(task="shop.*"))
    settle_all(store, Action.DELETE)
    assert store.operator().stats().pending == 0
    assert HistoryEvent.objects.using(alias).count() == 0


def test_with_history_on_a_relay_refuses_to_start_without_its_table() -> None:
    # Or each settlement would fail after its batch went out, and go out again.
    call_command("migrate", "celery_outbox", "0006", database="default", verbosity=0)
    try:
        with pytest.raises(OutboxConfigurationError, match="migrate celery_outbox"):
            Stores("default", history=True).relay().ping()
        Stores("default", history=False).relay().ping()
    finally:
        call_command("migrate", "celery_outbox", database="default", verbosity=0)
    Stores("default", history=True).relay().ping()


def test_the_setting_turns_history_on(alias: str) -> None:
    with override_settings(CELERY_OUTBOX_HISTORY=True):
        store = Stores(alias)
    (task_id,) = add(store, "a")
    settle_all(store, Action.DELETE)
    assert events(alias, task_id) == [("published", 1, "")]
    assert Stores(alias).history is False  # the default


# -- retention ----------------------------------------------------------------------


def age(alias: str, task_ids: list[str], days: float) -> None:
    HistoryEvent.objects.using(alias).filter(task_id__in=task_ids).update(
        at=datetime.now(timezone.utc) - timedelta(days=days)
    )


def test_purge_deletes_old_events_in_chunks(alias: str, store: Stores) -> None:
    old = add(store, "o1", "o2", "o3", "o4", "o5")
    settle_all(store, Action.DELETE)
    young = add(store, "y1", "y2")
    settle_all(store, Action.DELETE)
    age(alias, old, 8)

    assert store.history_log().purge_history(7 * 86400, chunk_size=2) == 5
    left = HistoryEvent.objects.using(alias).values_list("task_id", flat=True)
    assert sorted(left) == sorted(young)
    assert store.history_log().purge_history(7 * 86400, chunk_size=2) == 0


def test_purge_of_an_all_old_history(alias: str, store: Stores) -> None:
    old = add(store, "o1", "o2", "o3")
    settle_all(store, Action.DELETE)
    age(alias, old, 8)
    assert store.history_log().purge_history(7 * 86400, chunk_size=2) == 3
    assert HistoryEvent.objects.using(alias).count() == 0


def test_the_retention_task_purges_the_history(alias: str, store: Stores) -> None:
    old = add(store, "o1", "o2")
    settle_all(store, Action.DELETE)
    (young,) = add(store, "y")
    settle_all(store, Action.DELETE)
    age(alias, old, 3)
    with override_settings(
        CELERY_OUTBOX_DATABASE=alias,
        CELERY_OUTBOX_HISTORY=True,
        CELERY_OUTBOX_HISTORY_RETENTION="2d",
    ):
        assert purge_dead_letters.apply().get() == {
            "deleted": 0,
            "retention_seconds": None,
            "history_deleted": 2,
        }
    assert list(
        HistoryEvent.objects.using(alias).values_list("task_id", flat=True)
    ) == [young]


# -- outbox tasks inspect -----------------------------------------------------------


@pytest.fixture
def on_alias(alias: str) -> Iterator[str]:
    """The commands on each database in turn, with history on."""
    with override_settings(CELERY_OUTBOX_DATABASE=alias, CELERY_OUTBOX_HISTORY=True):
        yield alias


def inspect(*args: str) -> str:
    out = StringIO()
    call_command("outbox", "tasks", "inspect", *args, stdout=out)
    return out.getvalue()


def lines(text: str) -> dict[str, str]:
    """The report's ``name  value`` lines before the history, by name."""
    found: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        name, _, value = line.partition("  ")
        found[name.strip()] = value.strip()
    return found


def test_inspect_a_waiting_message(on_alias: str, store: Stores) -> None:
    (task_id,) = add(store, "a")
    report = lines(inspect(task_id))
    assert report["task id"] == task_id
    assert report["task"] == "shop.record"
    assert report["state"] == "due"
    assert report["attempts"] == "0"
    assert report["enqueued"].endswith(" UTC")
    assert "history: no event yet" in inspect(task_id)


def test_inspect_a_message_in_flight(on_alias: str, store: Stores) -> None:
    (task_id,) = add(store, "a")
    store.relay().claim(10, 30)
    report = lines(inspect(task_id))
    assert report["state"] == "in_flight"
    assert report["leased to"] == f"relay {RELAY_NAME} ({RELAY})"
    assert report["lease ends"].endswith(" UTC")


def test_inspect_a_retrying_message(on_alias: str, store: Stores) -> None:
    (task_id,) = add(store, "a")
    settle_all(store, Action.RETRY, "NotFound: no queue 'emails'", delay=600)
    text = inspect(task_id)
    report = lines(text)
    assert report["state"] == "retrying"
    assert report["attempts"] == "1"
    assert report["last error"] == "NotFound: no queue 'emails'"
    next_try = datetime.strptime(report["next try"], "%Y-%m-%d %H:%M:%S.%f UTC")
    now = datetime.now(timezone.utc).replace(tzinfo=None)
    assert now + timedelta(seconds=500) < next_try < now + timedelta(seconds=700)
    history = text.split("history:\n")[1].splitlines()
    assert len(history) == 1
    assert "retrying  attempt 1" in history[0]
    # Events name the process that wrote them: a relay's heartbeat name.
    assert f"by relay {process_name()} ({RELAY})" in history[0]
    assert "reason: NotFound: no queue 'emails'" in history[0]


def test_inspect_a_deferred_message(on_alias: str, store: Stores) -> None:
    (task_id,) = add(store, "a")
    settle_all(store, Action.RELEASE, "ConnectionRefusedError: broker down", delay=600)
    report = lines(inspect(task_id))
    assert report["state"] == "deferred"
    assert report["attempts"] == "0"
    assert report["last error"] == "ConnectionRefusedError: broker down"


def test_inspect_a_dead_letter(on_alias: str, store: Stores) -> None:
    (task_id,) = add(store, "a")
    settle_all(store, Action.DEAD_LETTER, "PreconditionFailed: message too big")
    dead = DeadLetter.objects.using(on_alias).get(task_id=task_id)
    report = lines(inspect(task_id))
    assert report["state"] == "dead"
    assert (
        report["dead letter"]
        == f"{dead.id} (replay: manage.py outbox tasks replay {dead.id})"
    )
    assert report["reason"] == "PreconditionFailed: message too big"
    assert report["attempts"] == "1"


def test_inspect_a_published_message(on_alias: str, store: Stores) -> None:
    (task_id,) = add(store, "a")
    settle_all(store, Action.RETRY, "NotFound: q")
    settle_all(store, Action.DELETE)
    text = inspect(task_id)
    report = lines(text)
    assert report["state"] == "published"
    assert report["by"] == f"relay {process_name()} ({RELAY})"
    assert report["attempts"] == "2"
    assert report["published"].endswith(" UTC")
    assert [line.split()[3] for line in text.split("history:\n")[1].splitlines()] == [
        "retrying",
        "published",
    ]


def test_inspect_as_json(on_alias: str, store: Stores) -> None:
    (task_id,) = add(store, "a")
    settle_all(store, Action.DELETE)
    report = json.loads(inspect(task_id, "--format", "json"))
    assert report["state"] == "published"
    assert report["outbox"] == report["dead"] == []
    (event,) = report["history"]
    assert (event["event"], event["attempt"], event["relay_id"]) == (
        "published",
        1,
        RELAY,
    )
    assert datetime.fromisoformat(event["at"]) >= datetime.fromisoformat(
        report["enqueued_at"]
    )


def test_inspect_an_unknown_task_id_fails(on_alias: str) -> None:
    with pytest.raises(CommandError, match="no message with task id 'nope'"):
        inspect("nope")


def test_inspect_says_why_a_published_message_is_unknown_without_history(
    alias: str,
) -> None:
    store = Stores(alias, history=False)
    (task_id,) = add(store, "a")
    settle_all(store, Action.DELETE)
    with (
        override_settings(CELERY_OUTBOX_DATABASE=alias),
        pytest.raises(CommandError, match="CELERY_OUTBOX_HISTORY is off"),
    ):
        inspect(task_id)


def test_inspect_exits_non_zero_for_an_unknown_task_id() -> None:
    database = connections["default"].settings_dict["NAME"]
    assert Path(str(database)).name.startswith("test_")
    environ = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.project.settings",
        OUTBOX_TEST_DB_NAME=str(database),
    )
    for connection in connections.all():
        if connection.vendor == "mysql":
            environ["OUTBOX_MYSQL_NAME"] = str(connection.settings_dict["NAME"])
    done = subprocess.run(
        [sys.executable, "-m", "django", "outbox", "tasks", "inspect", "no-such-task"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "no message with task id 'no-such-task'" in done.stderr
