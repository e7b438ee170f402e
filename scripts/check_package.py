"""Build the sdist and the wheel, check them, and run the installed wheel (``make check``).

``build --no-isolation`` uses the development venv's setuptools instead of downloading
one. The wheel goes into a fresh venv with exactly the dependencies it declares,
resolved by pip (the development venv's pip, ``--python``) from pip's own configured
sources and cache, as a user's ``pip install celery-outbox`` would: nothing of the
development venv leaks in. Then, in a directory outside the source tree, a Django
project with the package's three apps runs ``check`` and ``migrate`` on SQLite, and
the package, its migrations and its admin template must all come from the fresh venv.

Then each extra (``pip install 'celery-outbox[redis]'``...) goes into a venv of its
own on top of that one (a path file; pip installs only what the extra adds) and must
do what it promises (:data:`PROMISES`): the ``redis`` extra loads kombu's Redis
transport and makes a Connection, ``postgres`` loads Django's PostgreSQL backend,
and so on, each from the extra's own venv. An extra of ``pyproject.toml`` without a
promise here fails the check.

Offline: pip resolves from ``.venv/wheelhouse`` alone (``--no-index``), which ``make``
fills when it builds the venv (``--wheelhouse``: every release the package and its
extras declare, at the versions of ``requirements/check.txt``), so the check needs no
network once the venv exists.

A build that prints a deprecation fails the check, so a warning like setuptools'
"``project.license`` as a TOML table is deprecated" is seen the day it appears.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import venv
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = """
SECRET_KEY = "check-package"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "celery_outbox",
    "celery_outbox.inbox",
    "celery_outbox.handlers",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "check.sqlite3"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
ROOT_URLCONF = "urls"
CELERY_OUTBOX_APP = "celeryapp.app"
# One relay on SQLite is what this project is: the multi-relay warning does not apply.
SILENCED_SYSTEM_CHECKS = ["celery_outbox.W001"]
"""

URLS = """
from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
"""

CELERY_APP = """
from celery_outbox import OutboxCelery

app = OutboxCelery("check-package")
"""

#: Run by the fresh venv's Python in the project: migrate, check, and say where the
#: package, its admin template and its migrations came from.
INSPECT = """
import os
import sys
from pathlib import Path

os.environ["DJANGO_SETTINGS_MODULE"] = "settings"
sys.path.insert(0, os.getcwd())

import django
from django.apps import apps
from django.core.management import call_command

django.setup()
call_command("migrate", verbosity=0)
call_command("check", fail_level="WARNING")

import celery_outbox
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.template.loader import get_template

venv = Path(sys.prefix).resolve()
template = get_template("admin/celery_outbox/outboxmessage/change_list.html")
where = {
    "package": Path(celery_outbox.__file__),
    "admin template": Path(template.origin.name),
}
for what, path in where.items():
    if venv not in path.resolve().parents:
        sys.exit(f"the {what} comes from {path}, not from the installed wheel")
applied = MigrationLoader(connection).applied_migrations
counts = {}
for label in ("celery_outbox", "celery_outbox_inbox", "celery_outbox_handlers"):
    folder = Path(apps.get_app_config(label).path, "migrations")
    shipped = {p.stem for p in folder.glob("[0-9][0-9][0-9][0-9]_*.py")}
    done = {name for app, name in applied if app == label}
    if not shipped or shipped != done:
        sys.exit(f"{label}: migrations shipped {sorted(shipped)}, applied {sorted(done)}")
    counts[label] = len(shipped)
print(
    f"celery-outbox {celery_outbox.__version__} from the wheel: migrate and check passed ("
    + ", ".join(f"{label} {n} migration(s)" for label, n in counts.items())
    + ", the admin template found)"
)
"""


def run(argv: list[str], cwd: Path = ROOT) -> str:
    """Run ``argv``; on failure print its output and stop with its exit code."""
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stdout + done.stderr, file=sys.stderr)
        print(f"check_package: {' '.join(argv)} failed", file=sys.stderr)
        sys.exit(done.returncode)
    return done.stdout + done.stderr


def source_copy(where: Path) -> Path:
    """The files git would commit (tracked, or new and not ignored), copied to ``where``.

    A build in the working tree would also read what earlier builds left there
    (``*.egg-info/SOURCES.txt`` lists every file they packed), and so could ship a
    file the configuration no longer includes.
    """
    listed = run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    )
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = where / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return where


def warns_deprecation(line: str) -> bool:
    """Whether a line of the build's output speaks of a deprecation.

    The build names every file it copies, and the package has modules called
    ``deprecated.py``: paths are taken out of the line before it is read.
    """
    words = re.sub(r"\S*[/\\]\S*", "", line)
    return re.search(r"deprecat", words, re.I) is not None


def build(source: Path, dist: Path) -> list[Path]:
    """The sdist and the wheel (built from the sdist), with no deprecation printed."""
    output = run(
        [sys.executable, "-m", "build", "--no-isolation", "-o", str(dist)], cwd=source
    )
    deprecations = [line for line in output.splitlines() if warns_deprecation(line)]
    if deprecations:
        print(output, file=sys.stderr)
        sys.exit(
            "check_package: the build printed deprecations:\n" + "\n".join(deprecations)
        )
    files = sorted(dist.iterdir())
    run([sys.executable, "-m", "twine", "check", "--strict", *map(str, files)])
    return files


#: Where ``--wheelhouse`` puts the wheels the package check installs from.
WHEELHOUSE = ROOT / ".venv" / "wheelhouse"
#: The pins the wheelhouse is filled at (the development venv's lock).
LOCK = ROOT / "requirements" / "check.txt"


def declared_requirements() -> list[str]:
    """What ``pip install 'celery-outbox[every extra]'`` asks for, as requirements."""
    project = _project()
    found = list(project["dependencies"])
    for extra in declared_extras():
        found += project["optional-dependencies"][extra]
    return found


def fill_wheelhouse(where: Path = WHEELHOUSE) -> None:
    """Download (with network) the wheels the package check will install offline."""
    where.mkdir(parents=True, exist_ok=True)
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--only-binary=:all:",
            "--constraint",
            str(LOCK),
            "--dest",
            str(where),
            *declared_requirements(),
        ]
    )


def fresh_venv(where: Path, requirement: str, base: Path | None = None) -> Path:
    """A new venv with ``requirement`` installed by pip, with what it declares.

    With ``base`` (a venv's purelib) the new venv also sees what ``base`` holds, and
    pip installs only what is missing. Returns the venv's Python.
    """
    venv.create(where, with_pip=False)
    python = where / "bin" / "python"
    if base is not None:
        Path(purelib(python), "base.pth").write_text(f"{base}\n")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
            "--find-links",
            str(WHEELHOUSE),
            requirement,
        ]
    )
    return python


def purelib(python: Path) -> str:
    """The site-packages directory of the venv of ``python``."""
    return run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    ).strip()


#: What each extra promises, as Python run in a venv with only the package and that
#: extra (Django set up with the check project's settings). ``FROM_EXTRA`` lists the
#: modules that must come from the extra's own venv, not from the package's.
PROMISES: dict[str, tuple[str, tuple[str, ...]]] = {
    "postgres": (
        "import psycopg\nfrom django.db.backends.postgresql import base",
        ("psycopg",),
    ),
    "mysql": (
        "import pymysql\npymysql.install_as_MySQLdb()\n"
        "from django.db.backends.mysql import base",
        ("pymysql",),
    ),
    # kombu's Redis transport imports what kombu's own redis extra lists (packaging
    # from kombu 5.7 on); the relay's Redis publisher builds on it.
    "redis": (
        "from kombu import Connection\n"
        "connection = Connection('redis://127.0.0.1:1/0')\n"
        "assert connection.transport.driver_type == 'redis'\n"
        "connection.transport.driver_version()\n"
        "from celery_outbox.broker.redis import RedisPublisher",
        ("redis",),
    ),
    "prometheus": (
        "import prometheus_client\nfrom celery_outbox.sinks import PrometheusSink\n"
        "PrometheusSink(prometheus_client.CollectorRegistry())",
        ("prometheus_client",),
    ),
    "sentry": (
        "import sentry_sdk\nfrom celery_outbox.contrib.sentry import SentryRelayTracing",
        ("sentry_sdk",),
    ),
    "opentelemetry": (
        "from celery_outbox.contrib.otel import OtelRelayTracing",
        ("opentelemetry.trace",),
    ),
    "structlog": (
        "from celery_outbox.contrib.logcontext import structlog_available\n"
        "assert structlog_available()",
        ("structlog",),
    ),
    "progress": (
        "from celery_outbox.progress import _tqdm_class\nassert _tqdm_class()",
        ("tqdm",),
    ),
}
#: Extras for working on the package, not for its users.
DEVELOPMENT_EXTRAS = ("test", "lint", "dev")

#: Run by an extra's venv in the check project: Django set up, then the promise.
PROMISE = """
import importlib, os, sys
from pathlib import Path

os.environ["DJANGO_SETTINGS_MODULE"] = "settings"
sys.path.insert(0, os.getcwd())
import django

django.setup()
exec(sys.argv[1])
venv = Path(sys.prefix).resolve()
for name in sys.argv[2:]:
    origin = Path(importlib.import_module(name).__file__).resolve()
    if venv not in origin.parents:
        sys.exit(f"{name} comes from {origin}, not from the extra's venv")
"""


def declared_extras() -> list[str]:
    """The extras ``pyproject.toml`` offers to users."""
    extras = _project().get("optional-dependencies", {})
    return [name for name in extras if name not in DEVELOPMENT_EXTRAS]


def _project() -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "project"
    ]
    return project


def check_extras(top: Path, wheel: Path, base: Path, project: Path) -> list[str]:
    """Install each extra in a venv of its own on ``base``; run its promise there."""
    extras = declared_extras()
    unpromised = sorted(set(extras) - set(PROMISES))
    if unpromised:
        sys.exit(
            f"check_package: no promise for the extra(s) {', '.join(unpromised)}: "
            f"add what each makes work to PROMISES in scripts/check_package.py"
        )
    (project / "promise.py").write_text(textwrap.dedent(PROMISE))
    said = []
    for extra in extras:
        python = fresh_venv(top / f"extra-{extra}", f"{wheel}[{extra}]", base)
        code, modules = PROMISES[extra]
        done = subprocess.run(
            [str(python), "-I", "promise.py", code, *modules],
            cwd=project,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            print(done.stdout + done.stderr, file=sys.stderr)
            sys.exit(
                f"check_package: 'pip install celery-outbox[{extra}]' does not make "
                f"its promise work (above)"
            )
        said.append(extra)
    return said


def main() -> int:
    if sys.argv[1:] == ["--wheelhouse"]:
        fill_wheelhouse()
        return 0
    if not WHEELHOUSE.is_dir():
        sys.exit(
            f"check_package: no {WHEELHOUSE.relative_to(ROOT)}: build the venv with "
            f"`make .venv/.installed` (or run `python scripts/check_package.py "
            f"--wheelhouse` once, with network)"
        )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="check-package-") as temp:
        top = Path(temp)
        files = build(source_copy(top / "source"), top / "dist")
        [wheel] = [f for f in files if f.suffix == ".whl"]
        python = fresh_venv(top / "venv", str(wheel))
        project = top / "project"
        project.mkdir()
        (project / "settings.py").write_text(textwrap.dedent(SETTINGS))
        (project / "urls.py").write_text(textwrap.dedent(URLS))
        (project / "celeryapp.py").write_text(textwrap.dedent(CELERY_APP))
        (project / "inspect_wheel.py").write_text(textwrap.dedent(INSPECT))
        # -I: neither PYTHON* variables nor the user's site lead back to the source
        # tree; the script puts the project (its working directory) on the path.
        said = run([str(python), "-I", "inspect_wheel.py"], cwd=project)
        extras = check_extras(top, wheel, Path(purelib(python)), project)
    names = ", ".join(f.name for f in files)
    print(f"check_package: built {names}; twine check --strict passed")
    for line in said.strip().splitlines():
        print(f"check_package: {line}")
    print(
        f"check_package: each extra in a venv of its own does what it promises: "
        f"{', '.join(extras)}"
    )
    print(f"check_package: done in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
