"""The relay and the handler processor ride through a restart of their database.

PostgreSQL and MariaDB are stopped for a few seconds while a relay publishes to
RabbitMQ and a handler processor (``manage.py outbox handlers run``) runs receivers, then
started again. Both processes must keep running, lose nothing, charge no attempt for
the outage, make progress again within :data:`RECOVERY_LIMIT` seconds of the
database accepting connections, and empty their tables.

Each run stops the database server itself (``pg_ctlcluster``; ``mariadb-admin
shutdown`` and ``start-stop-daemon``), which every other user of that server sees:
run the fault suite alone. The server is stopped as soon as both processes have
started on their work, so that most of it is left for after the restart on any
machine, fast or loaded.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pymysql
import pytest
from django.db import connections, transaction

from celery_outbox import handlers
from celery_outbox.handlers.models import (
    HandlerDeadLetter,
    HandlerMessage,
    HandlerShard,
)
from celery_outbox.models import DeadLetter, OutboxMessage
from tests.e2e.conftest import Stack, alias_for, wait_until
from tests.project.shop.models import TaskRun
from tests.project.shop.receivers import RECORDED

from .test_faults import count_at_broker, enqueue

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

E2E = Callable[..., Stack]
#: Seconds from the database accepting connections to each loop's first progress.
RECOVERY_LIMIT = 5.0
#: Seconds from the database accepting connections to both tables being empty.
DRAIN_LIMIT = 60.0
#: How long the database stays down.
OUTAGE_SECONDS = 3.0
TASKS = 6000
MESSAGES = 1000
SHARDS = 6
DEFAULTS = ("--poll-interval", "1")
#: How long a clean shutdown may take before the server is stopped by force.
STOP_SECONDS = 10


@dataclass(frozen=True)
class Server:
    """How to stop and start the database server behind one alias."""

    stop: list[str]
    start: list[str]
    #: Stops it when ``stop`` did not (a statement that ignores the shutdown).
    force: list[str] | None = None

    def shut_down(self) -> None:
        """Stop the server: cleanly, or by force after :data:`STOP_SECONDS`."""
        done = subprocess.run(self.stop, capture_output=True, timeout=STOP_SECONDS * 2)
        if done.returncode != 0 and self.force is not None:
            subprocess.run(self.force, check=True, capture_output=True, timeout=60)
        elif done.returncode != 0:
            done.check_returncode()


def server_for(vendor: str, settings: dict[str, Any]) -> Server:
    """The commands that stop and start the server of ``settings`` (skip if absent)."""
    if vendor == "postgresql":
        if shutil.which("pg_ctlcluster") is None:
            pytest.skip("restarting PostgreSQL needs pg_ctlcluster (postgresql-common)")
        version, cluster = _pg_cluster(str(settings["PORT"]))
        control = ["pg_ctlcluster", "--skip-systemctl-redirect", version, cluster]
        # A fast shutdown waits for each backend to notice it; one busy in a long
        # statement of another test run can hold it for minutes.
        return Server(
            [*control, "stop", "-m", "fast", "--", "-t", str(STOP_SECONDS)],
            [*control, "start"],
            force=[*control, "stop", "-m", "immediate"],
        )
    daemon = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
    admin = shutil.which("mariadb-admin")
    if admin is None or shutil.which("start-stop-daemon") is None:
        pytest.skip("restarting MariaDB needs mariadb-admin and start-stop-daemon")
    login = [f"--host={settings['HOST']}", f"--port={settings['PORT']}"]
    login.append(f"--user={settings['USER']}")
    if settings["PASSWORD"]:
        login.append(f"--password={settings['PASSWORD']}")
    start = ["start-stop-daemon", "--start", "--oknodo", "--background"]
    return Server([admin, *login, "shutdown"], [*start, "--exec", daemon])


def _pg_cluster(port: str) -> tuple[str, str]:
    """The (version, name) of the local cluster listening on ``port``."""
    listing = subprocess.run(
        ["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=True
    ).stdout
    for line in listing.splitlines():
        version, name, cluster_port, *_ = line.split()
        if cluster_port == port:
            return version, name
    pytest.skip(f"no local PostgreSQL cluster listens on port {port}")


def accepts_connections(vendor: str, settings: dict[str, Any]) -> bool:
    """Whether a new connection to the server (not through Django) succeeds now."""
    try:
        if vendor == "postgresql":
            psycopg.connect(
                host=settings["HOST"],
                port=settings["PORT"],
                user=settings["USER"],
                dbname=settings["NAME"],
                connect_timeout=1,
            ).close()
        else:
            pymysql.connect(
                host=settings["HOST"],
                port=int(settings["PORT"]),
                user=settings["USER"],
                password=settings["PASSWORD"],
                database=settings["NAME"],
                connect_timeout=1,
            ).close()
    except (psycopg.Error, pymysql.MySQLError):
        return False
    return True


@contextlib.contextmanager
def restarted(vendor: str, alias: str, outage: float) -> Iterator[float]:
    """Stop the server, keep it down ``outage`` s and start it again.

    Yields when the server accepted a new connection (``time.monotonic()``), while
    its start command may still be running; the server is started again whatever
    happens.
    """
    settings = connections[alias].settings_dict
    server = server_for(vendor, settings)
    for connection in connections.all():
        connection.close()
    server.shut_down()
    starting: subprocess.Popen[bytes] | None = None
    try:
        assert not accepts_connections(vendor, settings), "the server did not stop"
        time.sleep(outage)
        starting = subprocess.Popen(server.start, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not accepts_connections(vendor, settings):
            if time.monotonic() > deadline:
                pytest.fail(f"{vendor} did not come back within 60 s")
            time.sleep(0.02)
        yield time.monotonic()
    finally:
        if starting is None:
            starting = subprocess.Popen(server.start, stdout=subprocess.DEVNULL)
        starting.wait(60)


def emit_messages(prefix: str, count: int, alias: str) -> set[str]:
    """Commit ``count`` handler messages of :data:`RECORDED` over :data:`SHARDS` shards."""
    tags = {f"{prefix}-h{i}" for i in range(count)}
    with transaction.atomic(using=alias):
        for i, tag in enumerate(sorted(tags)):
            handlers.emit(
                RECORDED,
                shard=("restart", i % SHARDS),
                object_id=tag,
                payload={"tag": tag},
                using=alias,
            )
    return tags


@dataclass
class Recovery:
    """What was seen between the database coming back and both tables emptying."""

    #: Rows in each table when the database was back.
    held: int = 0
    waiting: int = 0
    outbox_empty: float | None = None
    handlers_empty: float | None = None
    #: When each table first held fewer rows than at the restart (work resumed).
    outbox_resumed: float | None = None
    handlers_resumed: float | None = None
    #: The most attempts seen on an outbox row, and on a handler shard's head.
    outbox_attempts: int = 0
    handler_attempts: int = 0

    def watch(self, alias: str, back: float, timeout: float) -> None:
        """Poll until both tables are empty or ``timeout`` s after ``back``."""
        self.held = held = OutboxMessage.objects.using(alias).count()
        self.waiting = waiting = HandlerMessage.objects.using(alias).count()
        while time.monotonic() - back < timeout:
            now = time.monotonic() - back
            rows = list(OutboxMessage.objects.using(alias).values_list("attempts"))
            self.outbox_attempts = max([self.outbox_attempts, *(a for (a,) in rows)])
            shards = HandlerShard.objects.using(alias).values_list("attempts")
            self.handler_attempts = max(
                [self.handler_attempts, *(a for (a,) in shards)]
            )
            pending = HandlerMessage.objects.using(alias).count()
            if len(rows) < held and self.outbox_resumed is None:
                self.outbox_resumed = now
            if pending < waiting and self.handlers_resumed is None:
                self.handlers_resumed = now
            if not rows and self.outbox_empty is None:
                self.outbox_empty = now
            if not pending and self.handlers_empty is None:
                self.handlers_empty = now
            if self.outbox_empty is not None and self.handlers_empty is not None:
                return
            time.sleep(0.05)


def recorded(prefix: str, alias: str) -> list[str]:
    """The tags the receiver recorded (a tag twice: handled twice)."""
    runs = TaskRun.objects.using(alias).filter(
        task_name=RECORDED, tag__startswith=f"{prefix}-"
    )
    return list(runs.values_list("tag", flat=True))


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.2f} s"


@pytest.mark.parametrize("vendor", ["postgresql", "mysql"])
@pytest.mark.django_db(databases="__all__", transaction=True)
def test_relay_and_handler_processor_ride_through_a_database_restart(
    e2e: E2E, measured: list[str], rabbit_queue: str, vendor: str
) -> None:
    stack = e2e(vendor)
    alias = alias_for(vendor)
    prefix = f"dbrestart-{uuid.uuid4().hex[:6]}"
    enqueue(prefix, TASKS, alias=alias)
    expected = set(OutboxMessage.objects.using(alias).values_list("task_id", flat=True))
    messages = emit_messages(prefix, MESSAGES, alias)
    # The shipped poll intervals (the test settings shorten them). The restart comes
    # as soon as both processes have done some of their work, so that both still
    # have most of it left, however long each takes to start.
    # One row per batch: the relay, far quicker than the processor, still has most
    # of its rows when the slower of the two is under way. A claim the restart cuts
    # off before its commit is acknowledged stays leased until the lease ends: 20 s,
    # so that the table empties well within DRAIN_LIMIT even then.
    stack.start_relay("--batch-size", "1", *DEFAULTS, "--lease-seconds", "20")
    stack.start_handlers("--database", "default", *DEFAULTS, "--lease-seconds", "30")
    wait_until(
        lambda: (
            OutboxMessage.objects.using(alias).count() < TASKS
            and len(recorded(prefix, alias)) > 0
        ),
        60,
        "the relay and the processor to be under way",
    )
    recovery = Recovery()
    with restarted(vendor, alias, OUTAGE_SECONDS) as back:
        recovery.watch(alias, back, timeout=DRAIN_LIMIT)
    held, waiting = recovery.held, recovery.waiting

    seen = count_at_broker(rabbit_queue, len(expected))
    lost = len(expected - set(seen))
    twice = sum(n - 1 for n in seen.values() if n > 1)
    handled = recorded(prefix, alias)
    missed = len(messages - set(handled))
    duplicates = len(handled) - len(set(handled))
    line = (
        f"{vendor} restart ({OUTAGE_SECONDS:.0f} s down): relay tasks={len(expected)} "
        f"left at the restart={held} lost={lost} published twice={twice} "
        f"resumed/empty {_s(recovery.outbox_resumed)}/{_s(recovery.outbox_empty)} "
        f"after the database was back; processor messages={len(messages)} "
        f"left={waiting} missed={missed} duplicates={duplicates} resumed/empty "
        f"{_s(recovery.handlers_resumed)}/{_s(recovery.handlers_empty)}"
    )
    print(line)
    measured.append(line)

    assert held > 0 and waiting > 0, "the restart came after the work: no proof"
    stack.assert_alive()
    assert lost == 0
    assert missed == 0
    assert duplicates == 0  # an atomic receiver's record commits with the deletion
    assert recovery.outbox_attempts == 0, "the restart used up publish attempts"
    assert recovery.handler_attempts == 0, "the restart was charged to a receiver"
    assert DeadLetter.objects.using(alias).count() == 0
    assert HandlerDeadLetter.objects.using(alias).count() == 0
    # Both loops resume within seconds of the database's return, and finish.
    assert recovery.outbox_resumed is not None
    assert recovery.outbox_resumed < RECOVERY_LIMIT
    assert recovery.handlers_resumed is not None
    assert recovery.handlers_resumed < RECOVERY_LIMIT
    assert recovery.outbox_empty is not None
    assert recovery.handlers_empty is not None
