"""Behind PgBouncer in transaction mode LISTEN never hears a NOTIFY: the relay notices and polls.

A real PgBouncer (Debian's, installed by ``scripts/tools.sh``) is started on a free
loopback port in front of the test database.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connections, transaction
from django.db.backends.postgresql.base import DatabaseWrapper

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.conf import OutboxSettings
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.listener import PgNotifyListener
from celery_outbox.relay.loop import Relay
from celery_outbox.relay.observations import StopReason
from celery_outbox.store import Stores

from .builders import envelope

pytestmark = pytest.mark.django_db(transaction=True)

ALIAS = "through_pgbouncer"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def pgbouncer() -> Iterator[int]:
    """A PgBouncer in transaction pooling mode in front of the test database."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    assert os.path.exists(binary), "pgbouncer is missing: run `bash scripts/tools.sh`"
    port = free_port()
    # pgbouncer drops root for the postgres user, who must reach its files.
    with tempfile.TemporaryDirectory(prefix="outbox-pgbouncer-") as folder:
        tmp_path = Path(folder)
        tmp_path.chmod(0o777)
        yield from _run_pgbouncer(binary, port, tmp_path)


def _run_pgbouncer(binary: str, port: int, tmp_path: Path) -> Iterator[int]:
    (tmp_path / "users.txt").write_text('"postgres" ""\n')
    config = tmp_path / "pgbouncer.ini"
    config.write_text(
        "[databases]\n"
        "* = host=127.0.0.1 port=5432\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "unix_socket_dir =\n"
        "auth_type = trust\n"
        f"auth_file = {tmp_path / 'users.txt'}\n"
        "pool_mode = transaction\n"
        f"logfile = {tmp_path / 'pgbouncer.log'}\n"
        f"pidfile = {tmp_path / 'pgbouncer.pid'}\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
    )
    for path in tmp_path.iterdir():
        path.chmod(0o666)
    command = [binary, str(config)]
    if os.geteuid() == 0:
        command[1:1] = ["-u", "postgres"]
    output = (tmp_path / "stdout.txt").open("wb")
    process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log = tmp_path / "pgbouncer.log"
                    started = (tmp_path / "stdout.txt").read_text(errors="replace")
                    pytest.fail(
                        f"pgbouncer did not start: {started} "
                        f"{log.read_text() if log.exists() else ''}"
                    )
                time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(10)
        output.close()


@pytest.fixture
def bouncer_alias(pgbouncer: int) -> Iterator[str]:
    """A database alias for the test database, reached through PgBouncer."""
    settings_dict = dict(connections["default"].settings_dict)
    settings_dict.update(PORT=str(pgbouncer), OPTIONS={}, CONN_MAX_AGE=0)
    connections[ALIAS] = DatabaseWrapper(settings_dict, alias=ALIAS)
    yield ALIAS
    connections[ALIAS].close()
    del connections[ALIAS]


def test_the_listener_notices_the_pooler_and_the_relay_polls(
    bouncer_alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_outbox.relay")
    listener = PgNotifyListener(bouncer_alias, probe_timeout=1.0)
    assert listener.fileno() is None
    assert not listener.active
    assert listener.fileno() is None  # decided once: no second probe, no second warning
    warnings = [
        r.getMessage() for r in caplog.records if "LISTEN/NOTIFY" in r.getMessage()
    ]
    assert len(warnings) == 1
    assert "polls instead" in warnings[0]

    # The relay still delivers, through PgBouncer, without the hint.
    with transaction.atomic():
        Stores("default").writer().insert([envelope("pooled")])
    publisher = InMemoryPublisher()
    config = RelayConfig.from_settings(OutboxSettings(), until_empty=True)
    relay = Relay(
        Stores(bouncer_alias).relay(), publisher, config, observers=(), wakeup=listener
    )
    assert relay.run() is StopReason.EMPTY
    assert [e.task_id.split("-")[0] for e in publisher.published] == ["pooled"]


def test_without_the_pooler_the_probe_succeeds() -> None:
    listener = PgNotifyListener("default", probe_timeout=2.0)
    try:
        assert listener.fileno() is not None
        assert listener.active
    finally:
        listener.close()
