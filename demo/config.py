"""Where the demo keeps its state, and a small parser for ``DATABASE_URL``.

Everything here is read from the environment so the relay and worker subprocesses,
which inherit it, end up with exactly the same configuration as the demo itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import django
from celery.signals import worker_ready

#: The demo package; its ``var/`` folder is recreated on every run.
PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_VAR_DIR = PACKAGE_DIR / "var"

_ENGINES = {
    "postgres": "django.db.backends.postgresql",
    "postgresql": "django.db.backends.postgresql",
    "pgsql": "django.db.backends.postgresql",
    "mysql": "django.db.backends.mysql",
    "sqlite": "django.db.backends.sqlite3",
}


def var_dir() -> Path:
    """The demo's work directory (``DEMO_VAR_DIR`` or ``demo/var``)."""
    return Path(os.environ.get("DEMO_VAR_DIR") or DEFAULT_VAR_DIR)


def sqlite_database(path: Path) -> dict[str, Any]:
    """A SQLite database the demo, the relay and the worker can share.

    A 30 s busy timeout lets writers queue for the lock instead of failing, and
    ``BEGIN IMMEDIATE`` (Django >= 5.1) takes the write lock up front so a
    read-then-write transaction never fails on a lock upgrade. The file itself is
    switched to WAL once, when the demo creates it.
    """
    options: dict[str, Any] = {"timeout": 30}
    if django.VERSION >= (5, 1):
        options["transaction_mode"] = "IMMEDIATE"
    return {"ENGINE": _ENGINES["sqlite"], "NAME": str(path), "OPTIONS": options}


def database_from_url(url: str) -> dict[str, Any]:
    """A Django ``DATABASES`` entry from ``scheme://user:password@host:port/name?opts``.

    Schemes: ``postgres``/``postgresql``, ``mysql`` and ``sqlite`` (``sqlite:///rel``
    or ``sqlite:////abs``). Query parameters become ``OPTIONS`` (e.g. ``sslmode``).
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower().split("+", 1)[0]
    if scheme not in _ENGINES:
        known = ", ".join(sorted(_ENGINES))
        raise ValueError(
            f"DATABASE_URL scheme {parts.scheme!r} is not supported ({known})."
        )
    if scheme == "sqlite":
        path = unquote(parts.path[1:] if parts.path.startswith("/") else parts.path)
        if not path:
            raise ValueError("DATABASE_URL sqlite:///<path> needs a file path.")
        return sqlite_database(Path(path))
    name = unquote(parts.path.lstrip("/"))
    if not name:
        raise ValueError(f"DATABASE_URL {redact(url)!r} does not name a database.")
    config: dict[str, Any] = {
        "ENGINE": _ENGINES[scheme],
        "NAME": name,
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": unquote(parts.hostname or ""),
        "PORT": str(parts.port or ""),
    }
    options: dict[str, Any] = dict(parse_qsl(parts.query))
    if scheme == "mysql":
        options.setdefault("charset", "utf8mb4")
    if options:
        config["OPTIONS"] = options
    return config


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``, for printing."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return parts._replace(netloc=f"{user}:***@{host}{port}").geturl()


def ready_file(app_name: str) -> Path:
    """Touched by the worker of app ``app_name`` once it consumes."""
    return var_dir() / f"{app_name}.ready"


def announce_when_ready(app: Any) -> None:
    """Touch ``app``'s ready file when its worker starts consuming (the driver waits)."""

    def touch(sender: Any = None, **_: Any) -> None:
        if sender is not None and sender.app is app:
            ready_file(app.main).touch()

    worker_ready.connect(touch, weak=False)
