"""Django system checks, with stable ids (``celery_outbox.E00x`` / ``W00x``).

E001 settings invalid · E002 outbox alias not in DATABASES · E003 unsupported vendor ·
E004 Celery app missing or not an OutboxCelery · E005 redactor not importable/callable ·
W001 SQLite (one relay) · W002 publisher confirms off · W003 outbox tables missing ·
W004 migrations not applied · W005 business models routed to another alias. The
inbox's (``celery_outbox_inbox.E001`` / ``W001``, :mod:`celery_outbox.inbox.checks`)
run on the app resolved here, when ``celery_outbox.inbox`` is installed.
"""

from __future__ import annotations

import sys
from typing import Any

from django.apps import apps as django_apps
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import connections, router

from .conf import get_settings
from .exceptions import OutboxConfigurationError


@register("celery_outbox")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Settings parse, and the outbox database can run a relay."""
    try:
        settings = get_settings()
    except OutboxConfigurationError as exc:
        return [Error(str(exc), id="celery_outbox.E001")]
    from .store import outbox_alias

    alias = outbox_alias(settings)
    if alias not in connections:
        return [
            Error(
                f"CELERY_OUTBOX_DATABASE = {alias!r} is not in DATABASES.",
                hint="Name an alias from DATABASES.",
                id="celery_outbox.E002",
            )
        ]
    connection = connections[alias]
    messages: list[CheckMessage] = []
    if connection.vendor == "sqlite":
        messages.append(
            Warning(
                f"The outbox database {alias!r} is SQLite: run exactly one relay.",
                hint="Use PostgreSQL or MySQL/MariaDB to run several relays.",
                id="celery_outbox.W001",
            )
        )
    elif connection.vendor not in {"postgresql", "mysql"}:
        messages.append(
            Error(
                f"The outbox database {alias!r} uses {connection.vendor!r}, which celery-outbox "
                "does not support.",
                hint="Use PostgreSQL, MySQL 8 / MariaDB >= 10.6 or SQLite.",
                id="celery_outbox.E003",
            )
        )
    if not settings.confirm_publish:
        messages.append(
            Warning(
                "CELERY_OUTBOX_CONFIRM_PUBLISH is False: rows are deleted without the "
                "broker confirming the publish, so a broker crash can lose tasks.",
                hint="Leave publisher confirms on unless you measured you cannot afford them.",
                id="celery_outbox.W002",
            )
        )
    return messages


def _outbox_alias_or_none() -> str | None:
    """The outbox alias, or None when E001/E002 already report a problem."""
    try:
        settings = get_settings()
    except OutboxConfigurationError:
        return None
    from .store import outbox_alias

    alias = outbox_alias(settings)
    return alias if alias in connections else None


@register("celery_outbox")
def check_app(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The relay can find the Celery app, and it is an ``OutboxCelery`` (E004)."""
    try:
        settings = get_settings()
    except OutboxConfigurationError:
        return []
    from .app import resolve_app

    try:
        resolve_app(settings)
    except OutboxConfigurationError as exc:
        return [
            Error(
                str(exc),
                hint="Create the app with celery_outbox.OutboxCelery(...) and import it "
                "when Django starts (proj/__init__.py), or set CELERY_OUTBOX_APP.",
                id="celery_outbox.E004",
            )
        ]
    return []


@register("celery_outbox")
def check_redactor(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``CELERY_OUTBOX_REDACTOR`` imports and is callable (E005)."""
    try:
        settings = get_settings()
    except OutboxConfigurationError:
        return []
    from .redaction import load_redactor

    try:
        load_redactor(settings)
    except OutboxConfigurationError as exc:
        return [Error(str(exc), id="celery_outbox.E005")]
    return []


@register("celery_outbox", Tags.database)
def check_skip_locked(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """The outbox database can claim with ``SELECT ... FOR UPDATE SKIP LOCKED`` (E006).

    Tagged ``database``: the answer needs the server version.
    """
    alias = _outbox_alias_or_none()
    if alias is None or not databases or alias not in databases:
        return []
    connection = connections[alias]
    if connection.vendor not in {"postgresql", "mysql"}:
        return []
    try:
        supported = connection.features.has_select_for_update_skip_locked
    except Exception:  # an unreachable database is reported by check_migrations
        return []
    if supported:
        return []
    return [
        Error(
            f"The outbox database {alias!r} does not support SELECT ... FOR UPDATE SKIP "
            "LOCKED, which relays need to share work without blocking each other.",
            hint="Use PostgreSQL, MySQL >= 8.0.1 or MariaDB >= 10.6.",
            id="celery_outbox.E006",
        )
    ]


def running_command() -> str | None:
    """The management command this process was started as (``manage.py NAME``,
    ``django-admin NAME``, ``python -m django NAME``), or None.

    Django tells a check nothing about the command that runs it: ``migrate`` runs
    the checks with ``databases=[its alias]`` and no tags, exactly as ``check
    --database`` does. What names the command is the command line, read as
    Django's ``ManagementUtility`` reads it: the first argument. (``call_command``
    runs no checks unless asked to.)
    """
    return sys.argv[1] if len(sys.argv) > 1 else None


@register("celery_outbox")
def check_migrations(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """The outbox tables exist (W003) and celery_outbox's migrations are applied (W004).

    Runs on a plain ``manage.py check`` too (a forgotten ``migrate celery_outbox``
    is the commonest setup mistake); with ``--database``, only when the outbox
    alias is among those asked for; never under ``migrate``, which is about to
    create the tables and apply the migrations these warnings ask for.
    """
    if running_command() == "migrate":
        return []
    alias = _outbox_alias_or_none()
    if alias is None or (databases is not None and alias not in databases):
        return []
    from django.db.migrations.executor import MigrationExecutor

    from .models import DeadLetter, OutboxMessage

    connection = connections[alias]
    try:
        tables = set(connection.introspection.table_names())
        executor = MigrationExecutor(connection)
        targets = [
            key
            for key in executor.loader.graph.leaf_nodes()
            if key[0] == "celery_outbox"
        ]
        plan = executor.migration_plan(targets)
    except Exception as exc:  # an unreachable database is reported elsewhere
        return [
            Warning(
                f"Cannot inspect the outbox database {alias!r}: {type(exc).__name__}: {exc}",
                id="celery_outbox.W003",
            )
        ]
    missing = [
        model._meta.db_table
        for model in (OutboxMessage, DeadLetter)
        if model._meta.db_table not in tables
    ]
    if missing:
        return [
            Warning(
                f"The outbox tables {', '.join(missing)} do not exist on database "
                f"{alias!r}: sending a task will fail.",
                hint=f"Run: python manage.py migrate celery_outbox --database {alias}",
                id="celery_outbox.W003",
            )
        ]
    pending = [migration.name for migration, _ in plan]
    if pending:
        return [
            Warning(
                f"celery_outbox migrations not applied on database {alias!r}: "
                f"{', '.join(pending)}.",
                hint=f"Run: python manage.py migrate celery_outbox --database {alias}",
                id="celery_outbox.W004",
            )
        ]
    return []


@register("celery_outbox")
def check_routing(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Business models are written to the outbox's alias (W005).

    A task sent in a transaction on another database commits independently of its
    row; the enqueue path refuses that case at run time, this check says it early.
    """
    alias = _outbox_alias_or_none()
    if alias is None:
        return []
    elsewhere: dict[str, list[str]] = {}
    for model in django_apps.get_models():
        app_name = model._meta.app_config.name
        if app_name.startswith("django.contrib.") or app_name == "celery_outbox":
            continue
        target = router.db_for_write(model)
        if target is not None and target != alias:
            elsewhere.setdefault(target, []).append(model._meta.label)
    messages: list[CheckMessage] = []
    for target, labels in sorted(elsewhere.items()):
        shown = ", ".join(labels[:10]) + (" ..." if len(labels) > 10 else "")
        messages.append(
            Warning(
                f"Models {shown} are written to database {target!r}, but the outbox "
                f"lives on {alias!r}: tasks sent in their transactions cannot commit "
                f"with them.",
                hint="Set CELERY_OUTBOX_DATABASE to the alias your business data uses, "
                "or send those tasks inside transaction.atomic() on the outbox alias.",
                id="celery_outbox.W005",
            )
        )
    return messages


@register("celery_outbox")
def check_inbox(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The inbox's checks (``celery_outbox_inbox.*``) on the app, when the inbox is installed."""
    if not django_apps.is_installed("celery_outbox.inbox"):
        return []
    from .app import resolve_app
    from .inbox.checks import check_inbox as inbox_messages

    try:
        app = resolve_app(get_settings())
    except OutboxConfigurationError:
        return []  # celery_outbox.E001/E004 report it
    return inbox_messages(app)
