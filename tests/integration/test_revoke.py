"""Revoke before publish: revoke() of a task still in the outbox deletes its row.

On every database, through the real OutboxCelery app: ``AsyncResult.revoke()``,
``GroupResult.revoke()`` and ``app.control.revoke()`` delete the rows no relay holds,
inside the caller's transaction when there is one; the history records it and
``outbox tasks inspect`` says so; Celery's broadcast to the workers still goes out.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from celery import chord, group
from celery.exceptions import TaskRevokedError
from django.conf import settings
from django.core.management import call_command
from django.db import connections, transaction
from django.test import override_settings
from kombu import Connection, Queue

from celery_outbox.outcomes import Settlement
from celery_outbox.store import Stores
from celery_outbox.testing import OutboxFixture
from tests.project.celery_app import app
from tests.project.shop.tasks import collect, errback, record

from ..conftest import BROKER_AMQP

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def on_alias(alias: str) -> Iterator[str]:
    """The outbox on each database in turn, with the history on."""
    with override_settings(CELERY_OUTBOX_DATABASE=alias, CELERY_OUTBOX_HISTORY=True):
        yield alias


def waiting(alias: str) -> list[str]:
    return [message.task_id for message in OutboxFixture(alias=alias).messages]


#: A revoke broadcast addressed to no worker. A worker of an OutboxCelery app that
#: gets the broadcast and sees the row deletes it itself, whatever becomes of the
#: caller's transaction (docs/scheduling.md), and the result backend says REVOKED at
#: once. The tests of the caller's transaction address nobody, so they see that
#: transaction alone, whatever workers the other tests of the run have started.
NO_WORKER = ["nobody@celery-outbox-tests"]


def committed(alias: str, *tags: str, **options: object) -> list[str]:
    with transaction.atomic(using=alias):
        return [record.apply_async((tag,), **options).id for tag in tags]


def test_revoke_deletes_the_row_so_it_is_never_published(on_alias: str) -> None:
    revoked, kept = committed(on_alias, "revoked", "kept")
    app.AsyncResult(revoked).revoke()
    assert waiting(on_alias) == [kept]
    claimed = Stores(on_alias).relay().claim(10, 30).messages
    assert [m.envelope.task_id for m in claimed] == [kept]


def test_inside_atomic_the_deletion_commits_or_rolls_back_with_the_caller(
    on_alias: str,
) -> None:
    first, second = committed(on_alias, "first", "second")
    with pytest.raises(RuntimeError), transaction.atomic(using=on_alias):
        app.control.revoke(first, destination=NO_WORKER)
        assert waiting(on_alias) == [second]
        raise RuntimeError("rollback")
    assert waiting(on_alias) == [first, second]
    with transaction.atomic(using=on_alias):
        app.control.revoke(first)
    assert waiting(on_alias) == [second]


def test_a_task_sent_and_revoked_in_one_transaction_never_reaches_the_table(
    on_alias: str,
) -> None:
    with transaction.atomic(using=on_alias):
        result = record.delay("gone")
        result.revoke()
    assert waiting(on_alias) == []


def test_control_revoke_takes_a_list_and_group_results_revoke_their_members(
    on_alias: str,
) -> None:
    a, b, c = committed(on_alias, "a", "b", "c")
    app.control.revoke([a, b])
    assert waiting(on_alias) == [c]
    with transaction.atomic(using=on_alias):
        members = group(record.s(f"g{i}") for i in range(3)).apply_async()
    members.revoke()
    assert waiting(on_alias) == [c]


def test_scheduled_tasks_are_revoked_the_same_way(on_alias: str) -> None:
    (later,) = committed(on_alias, "later", countdown=3600)
    app.AsyncResult(later).revoke()
    assert waiting(on_alias) == []


def test_a_row_a_relay_holds_is_left_to_it(on_alias: str) -> None:
    (leased,) = committed(on_alias, "leased")
    store = Stores(on_alias).relay()
    claim = store.claim(10, 30)
    app.control.revoke(leased)
    assert waiting(on_alias) == [leased]
    report = store.settle(
        claim.token, Settlement(delete=tuple(m.id for m in claim.messages))
    )
    assert report.deleted == 1


def test_the_history_records_the_revoke_and_inspect_says_so(on_alias: str) -> None:
    (task_id,) = committed(on_alias, "revoked")
    app.AsyncResult(task_id).revoke()
    out = StringIO()
    call_command("outbox", "tasks", "inspect", task_id, stdout=out)
    text = out.getvalue()
    assert "state        revoked" in text
    assert "before it was published" in text
    out = StringIO()
    call_command("outbox", "tasks", "inspect", task_id, "--format", "json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["state"] == "revoked"
    assert [e["event"] for e in data["history"]] == ["revoked"]


def test_an_unknown_task_id_changes_nothing(on_alias: str) -> None:
    (kept,) = committed(on_alias, "kept")
    app.control.revoke(str(uuid.uuid4()))
    assert waiting(on_alias) == [kept]


@pytest.mark.parametrize("bad", ["\ud800", "\x00"], ids=["surrogate", "nul"])
def test_an_id_no_row_can_hold_is_revoked_as_with_celery(
    on_alias: str, bad: str
) -> None:
    # No row holds such an id (the enqueue refuses it): nothing to delete, and the
    # database, which is up, must not be blamed.
    revoked, kept = committed(on_alias, "revoked", "kept")
    app.control.revoke(bad, destination=NO_WORKER)
    app.control.revoke([bad, revoked], destination=NO_WORKER)
    assert waiting(on_alias) == [kept]


@contextlib.contextmanager
def mailbox_probe() -> Iterator[Callable[[str], dict[str, Any]]]:
    """A queue on the workers' mailbox exchange; yields ``received(task_id)``, the
    revoke broadcast naming that task (other runs share the exchange)."""
    exchange = app.control.mailbox.exchange  # the workers' fanout "celery.pidbox"
    with Connection(BROKER_AMQP, connect_timeout=5) as conn:
        queue = Queue(
            f"revoke-probe-{uuid.uuid4().hex[:8]}", exchange, auto_delete=True
        )
        bound = queue(conn.default_channel)
        bound.declare()

        def received(task_id: str) -> dict[str, Any]:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                message = bound.get(no_ack=True)
                if message is None:
                    time.sleep(0.05)
                    continue
                body: dict[str, Any] = message.decode()
                if body.get("arguments", {}).get("task_id") == task_id:
                    return body
            pytest.fail(f"no revoke of {task_id} reached the mailbox exchange")

        try:
            yield received
        finally:
            bound.delete()


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_the_broadcast_to_the_workers_still_goes_out() -> None:
    """What a worker's mailbox receives: Celery's own revoke command."""
    (task_id,) = committed("default", "revoked")
    with mailbox_probe() as received:
        app.control.revoke(task_id, terminate=True, signal="SIGKILL")
        body = received(task_id)
    assert body["method"] == "revoke"
    assert body["arguments"]["terminate"] is True
    assert body["arguments"]["signal"] == "SIGKILL"
    assert waiting("default") == []


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_the_broadcast_of_an_id_no_row_can_hold_still_goes_out() -> None:
    with mailbox_probe() as received:
        app.control.revoke("\x00", terminate=True)
        body = received("\x00")
    assert body["arguments"]["terminate"] is True


REVOKE_IN_A_PROCESS = """
import sys
import django

if sys.argv[2] == "setup":
    django.setup()
from tests.project.celery_app import app

try:
    app.control.revoke(sys.argv[1], terminate=True, signal="SIGKILL")
except Exception as exc:
    print(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
    sys.exit(3)
print("no error")
"""


def revoke_in_a_process(
    task_id: str, *, django_setup: bool, down: str = "database"
) -> subprocess.CompletedProcess[str]:
    """``app.control.revoke(task_id, terminate=True)`` in a process of its own whose
    outbox database (``down="database"``: PostgreSQL) or broker (``"broker"``) is
    at a port nothing listens on; the other one is this run's."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.project.settings",
        "PYTHONPATH": str(ROOT),
        "OUTBOX_TEST_BROKER": BROKER_AMQP,
    }
    if down == "database":
        env.update(OUTBOX_TEST_DB="postgresql", OUTBOX_PG_PORT="1")
        env.pop("OUTBOX_TEST_DB_NAME", None)
    else:
        env.update(
            OUTBOX_TEST_DB=settings.DEFAULT_VENDOR,
            OUTBOX_TEST_DB_NAME=str(connections["default"].settings_dict["NAME"]),
            OUTBOX_TEST_BROKER="amqp://guest:guest@127.0.0.1:1//",
        )
    return subprocess.run(
        [
            sys.executable,
            "-c",
            REVOKE_IN_A_PROCESS,
            task_id,
            "setup" if django_setup else "-",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_with_the_database_down_the_broadcast_goes_out_and_the_error_says_so() -> None:
    """Stopping a running task needs only the broker, as with Celery."""
    task_id = str(uuid.uuid4())
    with mailbox_probe() as received:
        done = revoke_in_a_process(task_id, django_setup=True)
        body = received(task_id)
    assert body["arguments"]["terminate"] is True
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.startswith("celery_outbox.exceptions.OutboxRevokeError: "), (
        done.stdout
    )
    assert "broadcast went out to the workers" in done.stdout
    assert "outbox rows were not deleted" in done.stdout
    assert "OutboxDatabaseError" in done.stdout  # the cause, named
    assert "revoke them again" in done.stdout


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_without_django_set_up_the_revoke_is_the_broadcast_alone() -> None:
    """Flower or a ``celery`` command: no transaction to join, and the workers that get
    the broadcast delete the rows (tests/e2e/test_revoke.py)."""
    task_id = str(uuid.uuid4())
    with mailbox_probe() as received:
        done = revoke_in_a_process(task_id, django_setup=False)
        received(task_id)
    assert (done.returncode, done.stdout.strip()) == (0, "no error"), done.stderr


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_with_the_broker_down_the_rows_still_go_and_celerys_error_is_raised() -> None:
    """No relay can publish meanwhile either: deleting the rows is the revoke that
    works; the caller gets Celery's error, as with Celery."""
    revoked, kept = committed("default", "revoked", "kept")
    done = revoke_in_a_process(revoked, django_setup=True, down="broker")
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.startswith("kombu.exceptions.OperationalError: "), done.stdout
    assert waiting("default") == [kept]


def state(task_id: str) -> str:
    """The task's state in the result backend (Redis)."""
    return str(app.AsyncResult(task_id).state)


def test_the_result_backend_says_revoked_once_the_deletion_commits(
    on_alias: str,
) -> None:
    """As a worker that drops the revoked message would store it."""
    first, second = committed(on_alias, "first", "second")
    with pytest.raises(RuntimeError), transaction.atomic(using=on_alias):
        app.control.revoke(first, destination=NO_WORKER)
        raise RuntimeError("rollback")
    # The row came back: the worker that receives the message stores its state.
    assert state(first) == "PENDING"
    with transaction.atomic(using=on_alias):
        app.control.revoke(first, destination=NO_WORKER)
        assert state(first) == "PENDING"
    assert state(first) == "REVOKED"
    app.control.revoke(second)  # outside a transaction: at once
    assert state(second) == "REVOKED"
    assert isinstance(app.AsyncResult(second).result, TaskRevokedError)


def test_a_chord_whose_header_is_revoked_before_publish_fails_and_runs_its_errback(
    on_alias: str,
) -> None:
    """Celery's worker returns a revoked member's part of its chord; so does a revoke
    before publish: the chord fails, and its errback is sent, to the outbox."""
    tag = f"chord-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using=on_alias):
        body = chord(
            [record.s(f"{tag}-a"), record.s(f"{tag}-b")],
            collect.s(tag).on_error(errback.s()),
        ).apply_async()
    first, second = (member.id for member in body.parent.results)
    app.control.revoke(first)
    assert state(first) == "REVOKED"
    assert state(body.id) == "PENDING"  # its other member has not returned
    app.control.revoke(second)
    assert state(body.id) == "FAILURE"
    assert f"Dependency {first} raised" in str(app.AsyncResult(body.id).result)
    sent = OutboxFixture(alias=on_alias).filter(errback)
    assert [message.args for message in sent] == [(body.id,)]
