"""Which tests need a server (a database, a broker), and whether those servers answer.

The rule is the folder: every test under one of :data:`SERVER_FOLDERS` needs the
servers, and so does a test anywhere else marked ``@pytest.mark.servers`` or using
Django's test database. Every other test (``tests/unit``, the in-memory runs of
``tests/contract``, any new folder) needs none: ``make check`` runs them with ``OUTBOX_TEST_SERVERS=none``, where the
test project's every server address points at a port nothing listens on
(``tests/project/settings.py``), so a test there that reaches for a server fails
instead of quietly using one that happens to run.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

TESTS_DIR = Path(__file__).resolve().parent
#: The folders whose tests need PostgreSQL, MariaDB, RabbitMQ and Redis.
SERVER_FOLDERS = ("integration", "e2e", "faults", "plugin")
#: pytest-django's fixtures that open the test database (on PostgreSQL by default).
DATABASE_FIXTURES = frozenset(
    {
        "db",
        "transactional_db",
        "django_db_reset_sequences",
        "django_db_serialized_rollback",
        "django_db_setup",
        "live_server",
    }
)
#: The folders whose tests run alone (the ``serial`` mark): they stop servers that
#: every other test uses, or measure recovery times a loaded machine would blur.
SERIAL_FOLDERS = ("faults",)
#: The folder that must hold no test that needs a server.
NO_SERVER_FOLDER = "unit"
#: How long a server may take to accept a connection before it counts as missing.
PROBE_TIMEOUT = 2.0
#: What a contributor does about a missing server.
HOW_TO_START = (
    "start what is missing with `make services`, or run `make check` for the tests"
    " that need no server"
)

_SCHEMES = {"amqp": "RabbitMQ", "pyamqp": "RabbitMQ", "redis": "Redis"}
_ENGINES = {"postgresql": "PostgreSQL", "mysql": "MariaDB/MySQL"}


def without_servers() -> bool:
    """True in ``make check``: the run must reach no server at all."""
    return os.environ.get("OUTBOX_TEST_SERVERS") == "none"


def in_ci() -> bool:
    """True in CI, where a missing server fails the run instead of skipping tests."""
    return os.environ.get("CI") == "true"


def folder_of(path: Path) -> str:
    """The folder of ``tests`` that holds ``path`` ("" outside ``tests``)."""
    try:
        return path.resolve().relative_to(TESTS_DIR).parts[0]
    except (ValueError, IndexError):
        return ""


def needs_servers(path: Path, marks: Iterable[str], fixtures: Iterable[str]) -> bool:
    """Whether the test in ``path`` needs the servers.

    By its folder, by the ``servers`` mark, or because it uses Django's test database
    (the ``django_db`` mark or one of :data:`DATABASE_FIXTURES`): a contract run on
    the in-memory fakes and on the databases is split that way by itself.
    """
    marks = set(marks)
    return (
        folder_of(path) in SERVER_FOLDERS
        or bool(marks & {"servers", "django_db"})
        or bool(DATABASE_FIXTURES & set(fixtures))
    )


@dataclass(frozen=True)
class Server:
    """One server the tests talk to."""

    name: str
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.name} at {self.host}:{self.port}"


def _from_url(url: str) -> Server | None:
    parts = urlsplit(url)
    name = _SCHEMES.get(parts.scheme)
    if name is None or not parts.hostname:
        return None
    default = 6379 if name == "Redis" else 5672
    return Server(name, parts.hostname, parts.port or default)


def servers_of(settings: Any, urls: Iterable[str]) -> list[Server]:
    """Every server the test project's settings and ``urls`` name, each once."""
    found: dict[tuple[str, int], Server] = {}
    for database in settings.DATABASES.values():
        engine = database["ENGINE"]
        name = next((n for key, n in _ENGINES.items() if key in engine), None)
        if name and database.get("HOST"):
            server = Server(name, database["HOST"], int(database["PORT"]))
            found.setdefault((server.host, server.port), server)
    for url in (settings.CELERY_BROKER_URL, settings.CELERY_RESULT_BACKEND, *urls):
        server = _from_url(url or "")
        if server is not None:
            found.setdefault((server.host, server.port), server)
    return list(found.values())


def missing(servers: Iterable[Server]) -> list[str]:
    """One line per server that does not accept a TCP connection, with the reason."""
    lines = []
    for server in servers:
        try:
            socket.create_connection(
                (server.host, server.port), timeout=PROBE_TIMEOUT
            ).close()
        except OSError as exc:
            lines.append(f"{server} is not answering ({exc.strerror or exc})")
    return lines
