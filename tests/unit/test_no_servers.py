"""`make check` runs every test that needs no server, and reaches none.

The tests that need a server are those of ``tests/servers.py``'s folders (and any
marked ``servers``); with ``OUTBOX_TEST_SERVERS=none`` they are left out and every
server address of the test project points at a port nothing listens on. Elsewhere a
missing server skips those tests with its name, except in CI, where it fails the run.
Each check runs pytest or Django in a fresh process, with the environment it is about.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.servers import TESTS_DIR, needs_servers

ROOT = TESTS_DIR.parent
#: A test project whose every server is somewhere nothing listens, without OUTBOX_TEST_SERVERS.
SERVERS_DOWN = {
    "OUTBOX_PG_PORT": "1",
    "OUTBOX_MYSQL_PORT": "1",
    "OUTBOX_TEST_BROKER": "amqp://guest:guest@127.0.0.1:1//",
    "OUTBOX_TEST_RESULT_BACKEND": "redis://127.0.0.1:1/15",
}

#: Connects to every server the test project names and prints what each answered.
REACH_EVERY_SERVER = """
import json, django
django.setup()
from django.conf import settings
from django.db import connections
from kombu import Connection
import redis
from tests import conftest, servers

answers = {}
for alias, database in settings.DATABASES.items():
    if database.get("HOST"):
        try:
            connections[alias].ensure_connection()
            answers[alias] = "connected"
        except Exception as exc:
            answers[alias] = str(exc)
for name, url in [("broker", settings.CELERY_BROKER_URL), ("e2e amqp", conftest.BROKER_AMQP)]:
    try:
        with Connection(url, connect_timeout=2) as connection:
            connection.ensure_connection(max_retries=1)
        answers[name] = "connected"
    except Exception as exc:
        answers[name] = str(exc)
for name, url in [("results", settings.CELERY_RESULT_BACKEND), ("e2e redis", conftest.BROKER_REDIS)]:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
        answers[name] = "connected"
    except Exception as exc:
        answers[name] = str(exc)
found = servers.servers_of(settings, (conftest.BROKER_AMQP, conftest.BROKER_REDIS))
print(json.dumps({"answers": answers, "addresses": [str(s) for s in found]}))
"""


def run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """``argv`` in a fresh process at the repository root, with ``env`` added."""
    environment = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.project.settings"}
    for name in ("OUTBOX_TEST_SERVERS", "CI", "OUTBOX_TEST_DB", *SERVERS_DOWN):
        environment.pop(name, None)
    return subprocess.run(
        argv,
        cwd=ROOT,
        env={**environment, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def pytest_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]


def test_without_servers_every_server_address_is_refused() -> None:
    done = run([sys.executable, "-c", REACH_EVERY_SERVER], OUTBOX_TEST_SERVERS="none")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    answers = found["answers"]
    # PostgreSQL (twice: the plain and the write-on-commit engine), MariaDB, both
    # brokers and both Redis databases: each refused before any server could answer.
    assert set(answers) == {
        "default",
        "mysql",
        "postgresql_commit",
        "broker",
        "e2e amqp",
        "results",
        "e2e redis",
    }
    for name, answer in answers.items():
        assert re.search(r"refused|unreachable", answer, re.I), (name, answer)
    assert {address.rsplit(" at ", 1)[1] for address in found["addresses"]} == {
        "127.0.0.1:1"
    }


@pytest.mark.parametrize(
    ("path", "marks", "fixtures", "needs"),
    [
        ("integration/test_store.py", (), (), True),
        ("e2e/test_delivery.py", (), (), True),
        ("faults/test_faults.py", (), (), True),
        ("plugin/test_fixtures.py", (), (), True),
        ("unit/test_core.py", ("parametrize",), ("clock",), False),
        ("contract/test_roles.py", (), ("store",), False),
        # A new folder needs no server until its tests say so, or use the database.
        ("newfolder/test_new.py", (), (), False),
        ("unit/test_core.py", ("servers",), (), True),
        ("contract/test_roles.py", ("django_db",), (), True),
        ("contract/test_roles.py", (), ("transactional_db",), True),
        ("demo/test_demo.py", (), ("tmp_path",), False),
    ],
)
def test_the_folder_the_mark_or_the_database_says_a_test_needs_servers(
    path: str, marks: tuple[str, ...], fixtures: tuple[str, ...], needs: bool
) -> None:
    assert needs_servers(TESTS_DIR / path, marks, fixtures) is needs


def test_without_servers_the_tests_that_need_them_are_left_out() -> None:
    done = run(
        pytest_argv(
            "--collect-only",
            "-q",
            "tests/unit/test_text.py",
            "tests/integration/test_checks.py",
            "tests/plugin/test_entry_point.py",
        ),
        OUTBOX_TEST_SERVERS="none",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids, done.stdout
    assert all(test.startswith("tests/unit/test_text.py::") for test in ids), ids
    left_out = re.search(r"\((\d+) deselected\)", done.stdout)
    assert left_out is not None, done.stdout
    # Both files of the folders that need servers, left out whole.
    assert int(left_out.group(1)) >= 2


def test_in_ci_a_missing_server_fails_the_run() -> None:
    done = run(
        pytest_argv(
            "-q", "tests/unit/test_text.py", "tests/integration/test_checks.py"
        ),
        CI="true",
        **SERVERS_DOWN,
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert "CI=true: a missing server fails the run" in done.stderr
    assert "PostgreSQL at 127.0.0.1:1 is not answering" in done.stderr
    assert "passed" not in done.stdout and "skipped" not in done.stdout


def test_outside_ci_a_missing_server_skips_its_tests_and_names_it() -> None:
    done = run(
        pytest_argv(
            "-q", "-rs", "tests/unit/test_text.py", "tests/integration/test_checks.py"
        ),
        **SERVERS_DOWN,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.splitlines()[-1]
    assert re.fullmatch(r"\d+ passed, \d+ skipped in .*", summary), summary
    assert "PostgreSQL at 127.0.0.1:1 is not answering" in done.stdout
    assert "make services" in done.stdout
