"""End to end: a revoke before publish, as a worker that revoked the task would leave it.

With a real relay, a real worker and the Redis result backend:

* a chord whose header member was revoked before publish fails and runs its errback,
  as with Celery (member published, then revoked in the worker); a group with a
  member revoked before publish completes;
* Celery's own ``celery control revoke ID`` (a broadcast, no ``Control.revoke()``)
  takes a scheduled task out of the outbox: the worker that receives it deletes the
  row, so the task does not run after the worker restarts;
* a revoke deletes rows only in the outbox database it names: a worker of another
  project on the same broker keeps its row of the same task id, unless the
  broadcast names no database (a plain Celery app);
* a burst of revokes sent one by one deletes every row with at most a couple of
  database connections per worker process.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery, chord, group
from django.db import connections, transaction
from django.test import override_settings

from celery_outbox.models import OutboxMessage
from tests.e2e.conftest import BROKER_AMQP, Proc, Stack, alias_for, wait_until
from tests.project.celery_app import app
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import collect, errback, record

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(240),
    pytest.mark.django_db(transaction=True, databases=[alias_for("postgresql")]),
]

E2EFactory = Callable[..., Stack]

#: ETAs further away than this are scheduled in the outbox; the countdown used.
SCHEDULE_AFTER = 3.0
COUNTDOWN = 7.0
#: After the moment a task would have run: time for it to show.
GRACE = 3.0


def runs(prefix: str) -> Counter[str]:
    tags = TaskRun.objects.filter(tag__startswith=prefix)
    return Counter(tags.values_list("tag", flat=True))


def state(task_id: str) -> str:
    return str(app.AsyncResult(task_id).state)


def node_name(worker: Proc) -> str:
    """The worker's node name, as ``--destination`` takes it."""
    pattern = worker.args[worker.args.index("--hostname") + 1]
    return pattern.replace("%h", socket.gethostname())


def wait_for_node(worker: Proc) -> None:
    name = node_name(worker)
    wait_until(
        lambda: bool(app.control.ping(destination=[name], timeout=1.0)),
        60,
        f"worker {name} to answer a ping",
        worker.output,
    )


def test_a_chord_with_a_member_revoked_before_publish_fails_and_runs_its_errback(
    e2e: E2EFactory,
) -> None:
    stack = e2e("postgresql", BROKER_AMQP)
    tag = f"chord-{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        body = chord(
            [record.s(f"{tag}-revoked"), record.s(f"{tag}-kept")],
            collect.s(tag).on_error(errback.s()),
        ).apply_async()
        members = group(record.s(f"{tag}-g{n}") for n in range(3)).apply_async()
    revoked = body.parent.results[0].id
    app.control.revoke([revoked, members.results[0].id])

    stack.start_relay()
    stack.start_worker()
    wait_until(
        lambda: state(body.id) == "FAILURE" and f"errback:{body.id}" in runs("errback"),
        60,
        "the chord to fail and run its errback",
        lambda: f"chord {state(body.id)}, ran: {sorted(runs(tag))}",
    )
    wait_until(members.ready, 30, "the group to complete")
    stack.assert_alive()
    assert state(revoked) == "REVOKED"
    assert f"Dependency {revoked} raised" in str(app.AsyncResult(body.id).result)
    assert runs(tag) == Counter(
        dict.fromkeys([f"{tag}-kept", f"{tag}-g1", f"{tag}-g2"], 1)
    )
    assert [result.state for result in members.results] == [
        "REVOKED",
        "SUCCESS",
        "SUCCESS",
    ]


def test_celerys_own_revoke_command_takes_a_scheduled_task_out_of_the_outbox(
    e2e: E2EFactory, settings: Any
) -> None:
    settings.CELERY_OUTBOX_SCHEDULE_AFTER = SCHEDULE_AFTER
    stack = e2e("postgresql", BROKER_AMQP)
    stack.env.update(OUTBOX_TEST_SCHEDULE_AFTER=str(SCHEDULE_AFTER))
    worker = stack.start_worker()
    wait_for_node(worker)
    prefix = f"cli-{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        revoked = record.apply_async((f"{prefix}-revoked",), countdown=COUNTDOWN).id
        kept = record.apply_async((f"{prefix}-kept",), countdown=COUNTDOWN).id
    sent_at = time.monotonic()

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.project.celery_app",
            "control",
            "revoke",
            revoked,
            "--destination",
            node_name(worker),
        ],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "flagged as revoked" in done.stdout
    wait_until(
        lambda: not OutboxMessage.objects.filter(task_id=revoked).exists(),
        10,
        "the worker to delete the revoked task's row",
        worker.output,
    )

    # A worker that restarts forgets the revoke (no --statedb): nothing is left to run.
    assert worker.terminate() == 0, worker.output()
    worker.long_running = False  # stopped on purpose
    stack.start_relay()
    stack.start_worker()
    wait_until(
        lambda: f"{prefix}-kept" in runs(prefix), COUNTDOWN + 30, "the kept task"
    )
    time.sleep(max(0.0, sent_at + COUNTDOWN + GRACE - time.monotonic()))
    stack.assert_alive()
    assert runs(prefix) == Counter({f"{prefix}-kept": 1})
    assert not OutboxMessage.objects.filter(task_id__in=[revoked, kept]).exists()


#: A countdown that keeps a row in the outbox for the whole test (no relay runs).
FAR = 3600


def revoke_arguments(task_id: str) -> dict[str, Any]:
    """What ``celery control revoke ID`` broadcasts."""
    return {"task_id": task_id, "terminate": False, "signal": "SIGTERM"}


def in_outbox(alias: str, task_id: str) -> bool:
    return OutboxMessage.objects.using(alias).filter(task_id=task_id).exists()


@pytest.mark.django_db(
    transaction=True, databases=[alias_for("postgresql"), alias_for("mysql")]
)
def test_a_revoke_deletes_rows_only_in_the_outbox_database_it_names(
    e2e: E2EFactory,
) -> None:
    """Project P (PostgreSQL) and project Q (MySQL) share a vhost and a task id."""
    stack = e2e("postgresql", BROKER_AMQP)
    p_worker = stack.start_worker(concurrency=1)
    q_alias = alias_for("mysql")
    stack.env.update(
        OUTBOX_TEST_DB="mysql",
        OUTBOX_TEST_DB_NAME=str(connections[q_alias].settings_dict["NAME"]),
    )
    q_worker = stack.start_worker(concurrency=1)
    for worker in (p_worker, q_worker):
        wait_for_node(worker)
    shared, marker = str(uuid.uuid4()), str(uuid.uuid4())
    with transaction.atomic():
        record.apply_async(("p",), countdown=FAR, task_id=shared)
    with (
        override_settings(CELERY_OUTBOX_DATABASE=q_alias),
        transaction.atomic(using=q_alias),
    ):
        record.apply_async(("q",), countdown=FAR, task_id=shared)
        record.apply_async(("q-marker",), countdown=FAR, task_id=marker)
    # A plain Celery app on the same broker: its broadcasts name no database. Not
    # the current app: the tests after this one send through the project's app.
    plain = Celery("plain", broker=BROKER_AMQP, set_as_current=False)

    # P's revoke (a broadcast without P deleting, as `celery control revoke` sends it).
    app.control.broadcast("revoke", arguments=revoke_arguments(shared))
    wait_until(lambda: not in_outbox("default", shared), 20, "P's row", p_worker.output)
    # Fanned out before P's worker got it: Q's worker handles it before the marker.
    plain.control.broadcast("revoke", arguments=revoke_arguments(marker))
    wait_until(
        lambda: not in_outbox(q_alias, marker), 20, "Q's marker", q_worker.output
    )
    assert in_outbox(q_alias, shared), "P's revoke deleted project Q's row"

    # A broadcast that names no database is everyone's, as before.
    plain.control.broadcast("revoke", arguments=revoke_arguments(shared))
    wait_until(lambda: not in_outbox(q_alias, shared), 20, "Q's row", q_worker.output)
    stack.assert_alive()


#: The burst: revokes sent one by one to this many worker processes.
BURST = 1000
BURST_WORKERS = 3
#: Outbox connections a worker process may hold at any moment during the burst.
CEILING = 2
#: The workers' role may hold this many connections in all: a worker that opens
#: one per revoke takes them from its role, not from the server other runs share.
ROLE_LIMIT = 24


@pytest.fixture
def burst_role(transactional_db: None) -> Iterator[str]:
    """A PostgreSQL role of this test for the workers, limited to ROLE_LIMIT."""
    name = f"outbox_burst_{uuid.uuid4().hex[:8]}"
    with connections["default"].cursor() as cursor:
        cursor.execute(f"CREATE ROLE {name} LOGIN CONNECTION LIMIT {ROLE_LIMIT}")
        for kind in ("TABLES", "SEQUENCES"):
            cursor.execute(f"GRANT ALL ON ALL {kind} IN SCHEMA public TO {name}")
    yield name
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
            [name],
        )
        cursor.execute(f"DROP OWNED BY {name}")
        cursor.execute(f"DROP ROLE {name}")


@contextlib.contextmanager
def peak_connections(role: str) -> Iterator[Counter[str]]:
    """The most connections of ``role`` seen at once, by application name."""
    peaks: Counter[str] = Counter()
    done = threading.Event()
    params = connections["default"].settings_dict

    def sample() -> None:
        with psycopg.connect(
            host=params["HOST"],
            port=params["PORT"],
            user=params["USER"],
            dbname=params["NAME"],
            autocommit=True,
        ) as conn:
            while not done.wait(0.01):
                rows = conn.execute(
                    "SELECT application_name, count(*) FROM pg_stat_activity "
                    "WHERE usename = %s GROUP BY 1",
                    [role],
                ).fetchall()
                for name, count in rows:
                    peaks[name] = max(peaks[name], count)

    sampler = threading.Thread(target=sample, name="peak-connections")
    sampler.start()
    try:
        yield peaks
    finally:
        done.set()
        sampler.join(10)


def test_a_burst_of_revokes_deletes_every_row_on_a_few_connections(
    burst_role: str, e2e: E2EFactory
) -> None:
    stack = e2e("postgresql", BROKER_AMQP)
    stack.env["OUTBOX_PG_USER"] = burst_role
    workers = []
    for n in range(BURST_WORKERS):
        stack.env["OUTBOX_TEST_APP_NAME"] = f"burst-{n}"
        workers.append(stack.start_worker(concurrency=1))
    for worker in workers:
        wait_for_node(worker)
    with transaction.atomic():
        ids = [record.apply_async((n,), countdown=FAR).id for n in range(BURST)]

    def left() -> int:
        return OutboxMessage.objects.filter(task_id__in=ids).count()

    with peak_connections(burst_role) as peaks, app.connection_for_write() as conn:
        for task_id in ids:  # one by one, as a loop over revoke() sends them
            app.control.broadcast(
                "revoke", arguments=revoke_arguments(task_id), connection=conn
            )
        deadline = time.monotonic() + 30
        while left() and time.monotonic() < deadline:
            time.sleep(0.2)
    stack.assert_alive()
    print(f"peak connections per worker: {dict(peaks)}")
    too_many = {name: n for name, n in peaks.items() if n > CEILING}
    assert (left(), too_many) == (0, {}), "\n".join(w.output()[-3000:] for w in workers)
