"""The support matrix: every Django line with every Celery line, each on one Python.

The newest combination runs the whole suite; every other pair runs the contract tests,
and what depends on one line alone (Celery's, Django's) runs once per line; the
oldest installs the lowest version of every dependency ``pyproject.toml`` declares.
``make matrix`` (the second half of ``make test``, after ``make check``) runs them
on a pool of slots, the newest first, then the ``serial`` session alone
(scripts/matrix.py);
``.venv/bin/nox`` runs them all one after the other, ``nox -l`` lists them and
``nox -s 'tests(python=3.13, django=6.1, celery=5.7)'`` runs one.
``tests/unit/test_packaging.py`` checks that the ranges ``pyproject.toml`` declares
(and the README's table) are the ones tested here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nox
from packaging.requirements import Requirement

# The lines below are read by tests/unit/test_packaging.py (literals only).

#: (Python, Django, Celery) of the newest combination: the whole suite.
NEWEST = ("3.13", "6.1", "5.7")
#: (Python, Django, Celery) on the lowest version of every declared dependency.
OLDEST = ("3.10", "4.2", "5.4")
#: Every other pair, on the newest patch release of each line: the contract tests.
CONTRACT = (
    ("3.11", "4.2", "5.5"),
    ("3.12", "4.2", "5.6"),
    ("3.11", "4.2", "5.7"),
    ("3.11", "5.2", "5.4"),
    ("3.12", "5.2", "5.5"),
    ("3.13", "5.2", "5.6"),
    ("3.10", "5.2", "5.7"),
    ("3.12", "6.0", "5.4"),
    ("3.13", "6.0", "5.5"),
    ("3.12", "6.0", "5.6"),
    ("3.13", "6.0", "5.7"),
    ("3.12", "6.1", "5.4"),
    ("3.13", "6.1", "5.5"),
    ("3.12", "6.1", "5.6"),
)
#: What a user relies on whatever the versions, and what depends on the Django and
#: the Celery line together: delivery through a real relay and worker, the pytest
#: plugin, the app's task class (Celery 5.4's Django fix-up replaced it unless it was
#: passed as an argument), and (in a second) that the metadata declares what this
#: file tests. Every session runs these.
CONTRACT_TESTS = (
    "tests/e2e/test_delivery.py",
    "tests/plugin",
    "tests/unit/test_packaging.py",
    "tests/unit/test_task_class.py",
)
#: What depends on the Celery line (Celery, kombu and py-amqp, which each Celery
#: line pins) and not on Django: the message Celery would have sent; the relay's own
#: AMQP frames and the Redis direct path, which replace py-amqp's and kombu's work;
#: what Celery's worker reads from a message the outbox holds (its ETA, the request
#: a revoke before publish stores); a revoke before publish (the worker's mailbox
#: node from app.control, celery/worker/pidbox.py, and the backend's chord part
#: return); an event delivery's hard time limit and lost process (each Celery line
#: acks, rejects or requeues them its own way, worker/request.py). One session per
#: Celery line runs these (:data:`CELERY_LINE_SESSIONS`), besides the newest.
CELERY_LINE_TESTS = (
    "tests/integration/test_fidelity.py",
    "tests/unit/test_amqpframes.py",
    "tests/unit/test_redis_check.py",
    "tests/integration/test_redis_publisher.py",
    "tests/unit/test_worker_reading.py",
    "tests/e2e/test_revoke.py",
    "tests/integration/test_event_endings.py",
)
#: What depends on the Django line and not on Celery: the migrations, both ways, on
#: every database. One session per Django line (:data:`DJANGO_LINE_SESSIONS`).
DJANGO_LINE_TESTS = ("tests/integration/test_migrations.py",)
#: For each Celery line, the session besides the newest that runs its tests.
CELERY_LINE_SESSIONS = (
    ("3.10", "4.2", "5.4"),
    ("3.11", "4.2", "5.5"),
    ("3.12", "4.2", "5.6"),
    ("3.11", "4.2", "5.7"),
)
#: For each Django line, the session besides the newest that runs its tests.
DJANGO_LINE_SESSIONS = (
    ("3.10", "4.2", "5.4"),
    ("3.11", "5.2", "5.4"),
    ("3.12", "6.0", "5.4"),
    ("3.12", "6.1", "5.4"),
)
#: What the extras plug into (Sentry, OpenTelemetry, structlog, Prometheus, tqdm):
#: the oldest session (each extra at its lowest version) and :data:`OLDER_MAJORS`'
#: sessions run these besides the contract tests; the newest runs them in the suite.
EXTRA_TESTS = (
    "tests/integration/test_tracing.py",
    "tests/integration/test_signals_metrics.py",
    "tests/unit/test_metrics.py",
    "tests/unit/test_progress.py",
    "tests/unit/test_relay_logs.py",
)
#: A dependency whose declared range spans two majors: the newest session has the
#: newest release of the upper one; this contract session installs the newest of the
#: lower one (``requirement``) and runs :data:`EXTRA_TESTS` too.
OLDER_MAJORS = (("sentry-sdk<3", ("3.12", "6.0", "5.6")),)
#: Test companions of a lowest extra, pinned beside it in the oldest session.
OLDEST_COMPANIONS = (
    "opentelemetry-sdk==1.30.0",
    "opentelemetry-instrumentation-celery==0.51b0",
)
#: The test tools every session installs at the lock's versions
#: (requirements/check.txt, ``make lock``), whatever Django and Celery it tests.
TOOLS = (
    "pytest",
    "pytest-django",
    "pytest-timeout",
    "pytest-xdist",
    "pluggy",
    "execnet",
    "hypothesis",
    "selenium",
    "kubernetes-validate",
    "msgpack",
    "pyyaml",
)
#: Celery lines whose own integration suite ``nox -s celery_suite`` runs, stock and
#: through OutboxCelery (tests/celery_suite; not part of ``make test``).
CELERY_SUITE = ("5.7", "5.6")
#: The extras whose lower bounds the oldest session installs, besides the core:
#: every extra a user can ask for (tests/unit/test_packaging.py holds it to that).
EXTRAS = (
    "postgres",
    "mysql",
    "redis",
    "prometheus",
    "sentry",
    "opentelemetry",
    "structlog",
    "progress",
)

ROOT = Path(__file__).parent
#: Times every stage of ``make test`` (scripts/stages.py; standard library only).
STAGES = "scripts/stages.py"
sys.path.insert(0, str(ROOT / "scripts"))
import stages  # noqa: E402

#: pytest-xdist workers of the newest session's parallel part. The machine has two
#: cores, but most of a test's time is spent waiting (on a database, a broker, a
#: relay or worker process it started), so more workers than cores pay.
WORKERS = os.environ.get("OUTBOX_TEST_WORKERS", "4")
#: Printed by every session: the versions it really installed.
SHOWN = (
    "Django",
    "celery",
    "kombu",
    "amqp",
    "redis",
    "psycopg",
    "PyMySQL",
    "sentry-sdk",
    "pytest",
)
SHOW = "import sys, importlib.metadata as m; print(*(f'{n} {m.version(n)}' for n in sys.argv[1:]))"
PYTHONS = sorted({row[0] for row in (NEWEST, OLDEST, *CONTRACT)})

nox.needs_version = ">=2025.5.1"
nox.options.default_venv_backend = "uv"
# A session whose Python is missing fails the run; nothing is downloaded instead.
nox.options.error_on_missing_interpreters = True
nox.options.download_python = "never"


def _let_pyenv_answer() -> None:
    """Make pyenv's shims (when pyenv is there) answer for every Python of the matrix.

    Nox finds ``python3.12`` through pyenv only for the versions ``PYENV_VERSION``
    names; each ``X.Y`` is added as the newest installed ``X.Y.Z``.
    """
    pyenv = shutil.which("pyenv")
    if pyenv is None:
        return
    active = [v for v in os.environ.get("PYENV_VERSION", "").split(":") if v]
    for python in PYTHONS:
        found = subprocess.run(
            [pyenv, "latest", python],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        if found and found not in active:
            active.append(found)
    os.environ["PYENV_VERSION"] = ":".join(active)


_let_pyenv_answer()


def _lowest_pins() -> list[str]:
    """``name==lower bound`` of the core dependencies and of every extra."""
    project = nox.project.load_toml(ROOT / "pyproject.toml")["project"]
    declared = list(project["dependencies"])
    for extra in EXTRAS:
        declared += project["optional-dependencies"][extra]
    pins = []
    for line in declared:
        requirement = Requirement(line)
        [lower] = [s.version for s in requirement.specifier if s.operator == ">="]
        extras = (
            f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        )
        pins.append(f"{requirement.name}{extras}=={lower}")
    return pins + list(OLDEST_COMPANIONS)


def _tool_constraints(session: nox.Session) -> str:
    """A constraints file of :data:`TOOLS` at the lock's versions, for ``session``."""
    wanted = {name.lower() for name in TOOLS}
    lines = []
    for line in (ROOT / "requirements" / "check.txt").read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            name = Requirement(line).name.lower()
            if name in wanted:
                lines.append(line)
    # Beside the session's venv: session.create_tmp() would point TMPDIR into the
    # checkout, where pytester's inner runs would find this project's pyproject.toml.
    path = Path(session.virtualenv.location) / "tools.txt"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _session_id(python: str, django: str, celery: str) -> str:
    return f"python={python}, django={django}, celery={celery}"


def _params() -> list[Any]:
    """The newest session, then the oldest and the contract pairs, each tagged."""
    newest = nox.param(*NEWEST, id=_session_id(*NEWEST), tags=["newest"])
    others = [(OLDEST, "oldest"), *((row, "contract") for row in CONTRACT)]
    return [newest] + [
        nox.param(*row, id=_session_id(*row), tags=[tag]) for row, tag in others
    ]


@nox.session(name="tests")
@nox.parametrize(("python", "django", "celery"), _params())
def tests(session: nox.Session, django: str, celery: str) -> None:
    """One (Python, Django, Celery) combination of the matrix."""
    row = (session.python, django, celery)
    label = "/".join(str(v) for v in row)
    older = [req for req, where in OLDER_MAJORS if where == row]
    if row == OLDEST:
        pins, kind = _lowest_pins(), "oldest"
    else:
        pins = [f"Django=={django}.*", f"celery=={celery}.*", *older]
        kind = "newest" if row == NEWEST else "contract"
    tools = _tool_constraints(session)
    _install(session, f"{label}: install", "-c", tools, "-e", ".[test]", *pins)
    session.run("python", "-c", SHOW, *SHOWN)
    env = {"OUTBOX_MATRIX_SESSION": kind}
    # pytest reads pyproject.toml: filterwarnings = error holds in every session.
    if row != NEWEST:
        selected = [
            *CONTRACT_TESTS,
            *(CELERY_LINE_TESTS if row in CELERY_LINE_SESSIONS else ()),
            *(DJANGO_LINE_TESTS if row in DJANGO_LINE_SESSIONS else ()),
            *(EXTRA_TESTS if row == OLDEST or older else ()),
        ]
        _pytest(session, f"{label}: contract tests", *selected, env=env)
        return
    # The whole suite but the tests that stop a server every session uses or need
    # the machine to themselves (the `serial` mark): the `serial` session has those.
    _pytest(session, f"{label}: tests", "-n", WORKERS, "-m", "not serial", env=env)


@nox.session(python=NEWEST[0], tags=["serial"])
def serial(session: nox.Session) -> None:
    """The newest combination's `serial` tests (tests/faults: they stop RabbitMQ and
    the databases), run once every other session is done (scripts/matrix.py)."""
    label = "/".join(NEWEST)
    _, django, celery = NEWEST
    _install(
        session,
        f"{label}: serial install",
        "-c",
        _tool_constraints(session),
        "-e",
        ".[test]",
        f"Django=={django}.*",
        f"celery=={celery}.*",
    )
    # pytest exits 5 when it selects nothing (posargs that name no serial test).
    _pytest(session, f"{label}: serial tests", "-m", "serial", success_codes=[0, 5])


def _install(session: nox.Session, stage: str, *args: str) -> None:
    """``session.install(*args)``, timed as ``stage``."""
    started, clock, status = time.time(), time.monotonic(), 1
    try:
        session.install(*args)
        status = 0
    finally:
        stages.write(stage, time.monotonic() - clock, status, started)


def _pytest(session: nox.Session, stage: str, *args: str, **run: Any) -> None:
    """pytest with ``args`` (and the session's posargs), run and timed as ``stage``."""
    command = ["python", "-m", "pytest", *args, *session.posargs]
    session.run("python", STAGES, "run", stage, "--", *command, **run)


@nox.session(name="celery_suite", python=NEWEST[0], default=False)
@nox.parametrize("celery", CELERY_SUITE)
def celery_suite(session: nox.Session, celery: str) -> None:
    """Celery's t/integration/test_tasks.py and test_canvas.py from its sdist, run
    stock and through OutboxCelery with a relay (RabbitMQ, Redis, PostgreSQL)."""
    session.install(
        "-e",
        ".[postgres,redis]",
        f"celery=={celery}.*",
        # What Celery's integration suite needs, and pip to fetch its sdist.
        "pytest",
        "pytest-timeout",
        "pytest-rerunfailures",
        "pydantic",
        "pip",
    )
    session.run("python", "-c", SHOW, *SHOWN)
    session.run("python", "-m", "tests.celery_suite.run", *session.posargs)
