"""Run Celery's own integration tests stock and through OutboxCelery; print the table.

``python -m tests.celery_suite.run`` (or ``nox -s celery_suite``) takes the sdist of
the installed Celery (``pip download --no-binary :all:``), copies its ``t/`` twice and
runs ``t/integration/test_tasks.py`` and ``test_canvas.py`` in each copy, one after
the other, against RabbitMQ and a Redis result backend:

* **stock**: Celery's suite as it is;
* **outbox**: the same, with ``from tests.celery_suite.outbox_fixtures import *``
  appended to the copy's ``t/integration/conftest.py``: the apps are OutboxCelery
  and a relay runs on a thread (a PostgreSQL database of its own).

It prints passed / failed / skipped per file and mode, and every test that passed
stock but not through the outbox; it exits 1 when there is such a test beyond
:data:`EXPECTED`, whose reasons docs/testing.md gives.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

#: This repository's root: the outbox run imports ``tests.celery_suite`` from it.
ROOT = Path(__file__).resolve().parents[2]
FILES = ("test_tasks.py", "test_canvas.py")
FIXTURES = "from tests.celery_suite.outbox_fixtures import *  # noqa: F401,F403\n"
#: Tests that cannot pass through the outbox, by design (docs/testing.md says why).
EXPECTED = frozenset(
    {
        # Asserts on the calling process's private buffer of a task-sent event that
        # failed to publish at the call; through the outbox the call publishes
        # nothing, and the relay sends the event once the task is published.
        "t.integration.test_tasks.test_tasks::"
        "test_task_sent_event_respects_publish_retry_limit",
    }
)


def download(version: str, into: Path) -> Path:
    """Celery's sdist of ``version``, unpacked; returns its directory."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            "--quiet",
            "-d",
            str(into),
            f"celery=={version}",
        ],
        check=True,
    )
    (archive,) = into.glob(f"celery-{version}.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / f"celery-{version}"


def prepare(sdist: Path, where: Path, outbox: bool) -> None:
    """A copy of the suite (``t/`` and the pytest configuration) in ``where``."""
    where.mkdir(parents=True)
    shutil.copytree(sdist / "t", where / "t")
    shutil.copy(sdist / "pyproject.toml", where / "pyproject.toml")
    if outbox:
        conftest = where / "t" / "integration" / "conftest.py"
        conftest.write_text(conftest.read_text() + "\n" + FIXTURES)


def postgres(command: str, database: str) -> None:
    """CREATE or DROP the outbox run's database."""
    import psycopg

    with psycopg.connect(
        host=os.environ.get("OUTBOX_PG_HOST", "127.0.0.1"),
        port=os.environ.get("OUTBOX_PG_PORT", "5432"),
        user=os.environ.get("OUTBOX_PG_USER", "postgres"),
        dbname="postgres",
        autocommit=True,
    ) as conn:
        if command == "drop":
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        else:
            conn.execute(f'CREATE DATABASE "{database}"')


def run_suite(
    where: Path, outbox: bool, files: list[str], extra: list[str], database: str
) -> Path:
    """Run ``files`` in ``where`` (the outbox on ``database``); returns the JUnit report."""
    report = where / "report.xml"
    environ = dict(os.environ)
    environ.setdefault("TEST_BROKER", "pyamqp://guest:guest@127.0.0.1:5672//")
    environ.setdefault("TEST_BACKEND", "redis://127.0.0.1:6379/0")
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(where), str(ROOT), environ.get("PYTHONPATH", "")]
    )
    if outbox:
        environ["OUTBOX_SUITE_DB"] = database
        environ["DJANGO_SETTINGS_MODULE"] = "tests.celery_suite.settings"
        postgres("create", database)
    else:
        environ.pop("DJANGO_SETTINGS_MODULE", None)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *(f"t/integration/{name}" for name in files),
            # The project's pytest-django would take the database away from the
            # relay's thread; Celery's suite does not use it.
            "-p",
            "no:django",
            "-p",
            "no:cacheprovider",
            # Celery's fixtures (pytest-celery registers them in Celery's CI).
            "-p",
            "celery.contrib.pytest",
            f"--junitxml={report}",
            "-q",
            *extra,
        ],
        cwd=where,
        env=environ,
        check=False,
    )
    return report


def outcomes(report: Path) -> dict[str, str]:
    """``{test id: passed | failed | skipped}`` from a JUnit report."""
    found: dict[str, str] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            found[test_id] = "failed"
        elif "skipped" in tags:
            found[test_id] = "skipped"
        else:
            found[test_id] = "passed"
    return found


def table(version: str, files: list[str], runs: dict[str, dict[str, str]]) -> str:
    lines = [
        f"Celery {version}: passed / failed / skipped",
        f"  {'file':<16} {'stock':>16} {'outbox':>16}",
    ]
    for name in files:
        module = f"t.integration.{name.removesuffix('.py')}"
        cells = []
        for mode in ("stock", "outbox"):
            counts = Counter(
                outcome
                for test_id, outcome in runs[mode].items()
                if test_id.startswith(module)
            )
            cells.append(
                f"{counts['passed']} / {counts['failed']} / {counts['skipped']}"
            )
        lines.append(f"  {name:<16} {cells[0]:>16} {cells[1]:>16}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import celery

    parser = argparse.ArgumentParser(prog="python -m tests.celery_suite.run")
    parser.add_argument(
        "--keep", metavar="DIR", help="work in DIR and keep it (default: a temp dir)"
    )
    parser.add_argument(
        "--files",
        nargs="+",
        default=list(FILES),
        choices=FILES,
        help="which of the suite's files to run (default: both)",
    )
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest")
    args = parser.parse_args(argv)
    version = celery.__version__
    work = Path(args.keep or tempfile.mkdtemp(prefix="celery-suite-"))
    database = f"outbox_celery_suite_{uuid.uuid4().hex[:8]}"
    try:
        sdist = download(version, work / "sdist")
        runs: dict[str, dict[str, str]] = {}
        for mode in ("stock", "outbox"):
            where = work / mode
            prepare(sdist, where, mode == "outbox")
            report = run_suite(
                where, mode == "outbox", args.files, args.pytest_args, database
            )
            runs[mode] = outcomes(report)
        print(table(version, args.files, runs), flush=True)
        lost = sorted(
            test_id
            for test_id, outcome in runs["stock"].items()
            if outcome == "passed" and runs["outbox"].get(test_id) != "passed"
        )
        for test_id in lost:
            known = " (expected: docs/testing.md)" if test_id in EXPECTED else ""
            print(f"  passed stock, not through the outbox: {test_id}{known}")
    finally:
        postgres("drop", database)  # IF EXISTS: also after a failed start
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if set(lost) - EXPECTED else 0


if __name__ == "__main__":
    sys.exit(main())
