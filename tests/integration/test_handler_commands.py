"""The handler commands tell the truth: exit 1 with the fix, never "done" for nothing.

Missing tables name the migration (not the connection), ids that match no dead
letter exit 1 as ``outbox tasks replay`` does, a ``--name`` that names no category is
refused instead of "paused", ``replay --dry-run`` only says what it would do, and
``run --until-empty`` exits 0 only when no message it could run is left (#45).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction

from celery_outbox.handlers import emit
from celery_outbox.handlers.models import (
    HandlerDeadLetter,
    HandlerMessage,
    HandlerPause,
)
from celery_outbox.handlers.registry import Category, Registry, registry

from .test_command_errors import manage
from .test_handler_operations import dead_letter


@pytest.fixture
def no_tables(tmp_path: Path, django_db_setup: None) -> dict[str, str]:
    """The environment of a project whose default database has no tables yet."""
    empty = tmp_path / "empty.sqlite3"
    empty.touch()
    return {"OUTBOX_TEST_DB": "sqlite", "OUTBOX_TEST_DB_NAME": str(empty)}


@pytest.mark.parametrize(
    "command",
    [
        ["outbox", "handlers", "run", "--until-empty", "--database", "default"],
        ["outbox", "handlers", "stats"],
        ["outbox", "handlers", "replay", "--all", "--database", "default"],
        ["outbox", "handlers", "pause", "--key", "org:1", "--database", "default"],
        ["outbox", "handlers", "resume", "--name", "x.y", "--database", "default"],
    ],
    ids=" ".join,
)
def test_without_handler_tables_a_command_exits_1_naming_the_migration(
    no_tables: dict[str, str], command: list[str]
) -> None:
    done = manage(*command, **no_tables)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "CommandError: table missing on handler database 'default'" in done.stderr
    assert (
        "Run: python manage.py migrate celery_outbox_handlers --database default"
        in done.stderr
    )
    assert "Check that" not in done.stderr  # the connection is not to blame


def test_an_unreachable_handler_database_is_named_with_its_alias(
    django_db_setup: None,
) -> None:
    done = manage(
        "outbox", "handlers", "stats", "--database", "default", OUTBOX_PG_PORT="1"
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "Check that database 'default' runs" in done.stderr
    assert "CELERY_OUTBOX_HANDLER_DATABASES" in done.stderr


in_databases = pytest.mark.django_db(transaction=True, databases="__all__")


@pytest.fixture
def name() -> str:
    """A category name no other test uses."""
    return f"test.{uuid.uuid4().hex[:8]}"


@in_databases
def test_replaying_ids_that_match_no_dead_letter_exits_1(
    alias: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dead_letter(alias, name, Registry(), "kept")
    (known,) = HandlerDeadLetter.objects.using(alias).values_list("id", flat=True)

    with pytest.raises(CommandError) as raised:
        call_command(
            "outbox", "handlers", "replay", str(known), "999999", "--database", alias
        )

    assert raised.value.returncode == 1
    assert str(raised.value) == (
        f"handlers replay: 1 of the 2 id(s) given match no handler dead letter on "
        f"{alias} (999999): already replayed or purged? Check the ids in the admin."
    )
    # The id that matched was replayed all the same, and said so.
    assert f"{alias}: 1 dead letter(s) replayed" in capsys.readouterr().out
    assert not HandlerDeadLetter.objects.using(alias).exists()
    assert HandlerMessage.objects.using(alias).get().payload == '"kept"'


@in_databases
def test_replay_dry_run_says_what_it_would_do_and_writes_nothing(
    alias: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    dead_letter(alias, name, Registry(), "first", "second")

    call_command(
        "outbox", "handlers", "replay", "--all", "--dry-run", "--database", alias
    )

    out = capsys.readouterr().out
    assert f"{alias}: would replay 2 dead letter(s) (dry run)" in out
    assert HandlerDeadLetter.objects.using(alias).count() == 2
    assert not HandlerMessage.objects.using(alias).exists()


@in_databases
@pytest.mark.parametrize("verb", ["pause", "resume"])
def test_a_name_that_is_no_category_is_refused_naming_the_known_ones(
    alias: str, verb: str
) -> None:
    with pytest.raises(CommandError) as raised:
        call_command(
            "outbox", "handlers", verb, "--name", "shop.recordd", "--database", alias
        )

    assert raised.value.returncode == 1
    message = str(raised.value)
    assert message.startswith(
        f"handlers {verb}: --name 'shop.recordd' is no handler category"
    )
    assert "Did you mean 'shop.recorded'?" in message
    assert "Registered categories: " in message and "shop.stalled" in message
    assert not HandlerPause.objects.using(alias).exists()


@in_databases
def test_a_category_with_messages_but_no_receiver_here_can_be_paused(
    alias: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with transaction.atomic(using=alias):
        emit(name, shard="org:1", object_id=1, using=alias)  # its receiver is gone

    call_command("outbox", "handlers", "pause", "--name", name, "--database", alias)

    assert f"category {name!r} on {alias}: paused" in capsys.readouterr().out
    assert HandlerPause.objects.using(alias).filter(value=name).exists()


@in_databases
@pytest.mark.parametrize(
    ("command", "flag"),
    [
        (["pause", "--key", "org:\x001"], "--key"),
        (["resume", "--name", "shop.rec\udc80rded"], "--name"),
        (["replay", "--key", "org:\x001"], "--key"),
    ],
    ids=["pause", "resume", "replay"],
)
def test_a_key_no_table_holds_is_refused_at_the_command(
    alias: str, command: list[str], flag: str
) -> None:
    with pytest.raises(CommandError) as raised:
        call_command("outbox", "handlers", *command, "--database", alias)

    message = str(raised.value)
    assert message.startswith(f"handlers {command[0]}: {flag} ")
    assert ("NUL" in message) or ("lone surrogate" in message)
    assert "Check that" not in message


# -- run --until-empty: the exit status from what is left (#45) ------------------


@pytest.fixture
def receiver(name: str) -> Iterator[list[Any]]:
    """A receiver of ``name`` in this process that raises on a payload "fail";
    yields the payloads it ran."""
    ran: list[Any] = []

    def run(*, payload: Any, **_: Any) -> None:
        if payload == "fail":
            raise RuntimeError("search cluster down")
        ran.append(payload)

    registry.add(Category(name, run))
    try:
        yield ran
    finally:
        registry.remove(name)


def run_until_empty(alias: str) -> CommandError | None:
    """``outbox handlers run --until-empty`` on ``alias``; the error it ended with."""
    try:
        call_command("outbox", "handlers", "run", "--until-empty", "--database", alias)
    except CommandError as exc:
        return exc
    return None


@in_databases
def test_run_until_empty_exits_0_once_every_message_ran(
    alias: str, name: str, receiver: list[Any]
) -> None:
    with transaction.atomic(using=alias):
        emit(name, shard="org:1", object_id=1, payload="x", using=alias)

    assert run_until_empty(alias) is None
    assert receiver == ["x"]


@in_databases
def test_run_until_empty_exits_1_naming_a_failing_shard_backing_off(
    alias: str, name: str, receiver: list[Any], settings: Any
) -> None:
    settings.CELERY_OUTBOX_HANDLER_RETRY_BASE_SECONDS = 600
    with transaction.atomic(using=alias):
        emit(name, shard="org:1", object_id=1, payload="fail", using=alias)
        emit(name, shard="org:1", object_id=2, payload="behind", using=alias)

    # The run that failed, and a later one that finds the shard backing off.
    for _ in range(2):
        failed = run_until_empty(alias)
        assert failed is not None and failed.returncode == 1
        assert str(failed) == (
            f"handler processor stopped: unfinished: 2 message(s) on {alias} not "
            f"run: 2 in 1 shard(s) backing off after their receiver failed (failing "
            f"longest: shard 'org:1': RuntimeError: search cluster down)"
        )
    assert receiver == []


@in_databases
def test_run_until_empty_exits_3_naming_the_pause_that_holds_messages(
    alias: str, name: str, receiver: list[Any]
) -> None:
    with transaction.atomic(using=alias):
        emit(name, shard="org:1", object_id=1, payload="x", using=alias)
    call_command("outbox", "handlers", "pause", "--key", "org:1", "--database", alias)

    held = run_until_empty(alias)

    assert held is not None and held.returncode == 3
    assert str(held) == (
        f"handler processor stopped: held: 1 message(s) on {alias} held by a pause "
        f"(shard 'org:1'; 'outbox handlers resume' lifts it)"
    )
    assert receiver == []
