"""The task-side commands tell the truth: no traceback, no success when nothing happened.

A command that cannot read its tables, its database or its archive exits 1 with the
fix; a selector naming something that does not exist exits 1 like ``outbox tasks replay``.
The first tests run ``manage.py`` in a process of its own, as an operator does, to
see the exit status and what is printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.test import override_settings

from .test_events import delete_topology

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.project.celery_app.app"


@pytest.fixture(autouse=True)
def _test_databases(django_db_setup: None) -> None:
    """This run's test databases exist: :func:`manage` points MySQL's alias at one."""


def manage(
    *args: str, timeout: float = 120, **environ: str
) -> subprocess.CompletedProcess[str]:
    """``django-admin <args>`` on the test project, with ``environ`` added."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.project.settings", **environ}
    env["PYTHONPATH"] = str(ROOT)
    # Django 6.1 runs a command's model checks on every database, and MySQL's
    # connect to theirs: the process's MySQL alias names this run's test one.
    for connection in connections.all():
        if connection.vendor == "mysql":
            env.setdefault("OUTBOX_MYSQL_NAME", str(connection.settings_dict["NAME"]))
    return subprocess.run(
        [sys.executable, "-m", "django", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def no_tables(tmp_path: Path) -> dict[str, str]:
    """The environment of a project whose outbox database has no tables yet."""
    empty = tmp_path / "empty.sqlite3"
    empty.touch()
    return {"OUTBOX_TEST_DB": "sqlite", "OUTBOX_TEST_DB_NAME": str(empty)}


@pytest.mark.parametrize(
    "command",
    [
        ["outbox", "ordering", "stats"],
        ["outbox", "ordering", "retry", "--key", "org:1"],
        ["outbox", "tasks", "stats"],
        ["outbox", "tasks", "replay", "--all"],
    ],
    ids=" ".join,
)
def test_without_tables_a_command_exits_1_with_the_migrate_hint(
    no_tables: dict[str, str], command: list[str]
) -> None:
    done = manage(*command, **no_tables)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "CommandError: table missing" in done.stderr
    assert "Run: python manage.py migrate celery_outbox" in done.stderr


def test_an_unreachable_database_is_named_with_its_alias() -> None:
    done = manage("outbox", "ordering", "stats", OUTBOX_PG_PORT="1")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "Check that the outbox database runs and that DATABASES['default']" in (
        done.stderr
    )


@pytest.mark.parametrize(
    "command",
    [["outbox", "relay"], ["outbox", "handlers", "run", "--database", "default"]],
    ids=" ".join,
)
def test_until_empty_with_its_database_down_fails_within_seconds(
    command: list[str],
) -> None:
    # Waiting for the database to come back is not "until empty": a deploy step
    # that drains must fail, now, saying which database did not answer.
    started = time.monotonic()
    try:
        done = manage(*command, "--until-empty", timeout=30, OUTBOX_PG_PORT="1")
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(command)} --until-empty still ran after 30 s")
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 20
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "'default'" in done.stderr and "Connection refused" in done.stderr, last


@pytest.fixture
def events_exchange() -> Iterator[str]:
    name = f"test-commands-{uuid.uuid4().hex[:8]}"
    with override_settings(
        CELERY_OUTBOX_EVENTS_EXCHANGE=name, CELERY_OUTBOX_EVENTS_MAX_RETRIES=1
    ):
        yield name
    delete_topology(name, ["billing"], 1, ())


def billing_events(*args: str) -> None:
    """``manage.py outbox events`` on the archive of service ``billing``."""
    call_command("outbox", "events", "--app", APP, "--service", "billing", *args)


@pytest.mark.django_db(transaction=True)
def test_an_archive_never_declared_is_not_reported_empty(events_exchange: str) -> None:
    with pytest.raises(CommandError, match="outbox events declare"):
        billing_events("inspect")


@pytest.mark.django_db(transaction=True)
def test_replaying_unknown_archived_ids_exits_1(events_exchange: str) -> None:
    billing_events("declare")
    with pytest.raises(
        CommandError, match=r"1 of the 1 id\(s\) given match no archived"
    ):
        billing_events("replay", "no-such-event")


@pytest.mark.django_db(transaction=True)
def test_replaying_unknown_ids_of_an_archive_in_the_database_exits_1(
    events_exchange: str,
) -> None:
    with (
        override_settings(CELERY_OUTBOX_EVENTS_RETRIES="database"),
        pytest.raises(CommandError, match="match no archived event"),
    ):
        billing_events("replay", "no-such-event")


@pytest.mark.django_db(transaction=True)
def test_an_unknown_ordering_key_has_no_blocked_head() -> None:
    for action in ("retry", "skip"):
        with pytest.raises(CommandError, match="has no blocked head"):
            call_command("outbox", "ordering", action, "--key", "no-such-key")


@pytest.fixture
def without_history_table() -> Iterator[str]:
    """The SQLite alias without its history table (moved away, then back)."""
    with connections["sqlite"].cursor() as cursor:
        cursor.execute("ALTER TABLE celery_outbox_history RENAME TO hidden_history")
    try:
        with override_settings(CELERY_OUTBOX_DATABASE="sqlite"):
            yield "sqlite"
    finally:
        with connections["sqlite"].cursor() as cursor:
            cursor.execute("ALTER TABLE hidden_history RENAME TO celery_outbox_history")


@pytest.mark.django_db(databases="__all__", transaction=True)
def test_a_missing_history_table_says_to_migrate(without_history_table: str) -> None:
    with pytest.raises(CommandError) as raised:
        call_command("outbox", "tasks", "inspect", "some-task-id")
    message = str(raised.value)
    assert "table missing on outbox database 'sqlite': celery_outbox_history" in message
    assert "python manage.py migrate celery_outbox --database sqlite" in message
