"""Settings, read once from Django settings into one typed, frozen object.

Every default is written here exactly once. Use :func:`get_settings`; tests that
change settings with ``override_settings`` get a fresh object through the
``setting_changed`` signal.
"""

from __future__ import annotations

import difflib
import enum
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from .durations import is_seconds, parse_duration
from .exceptions import OutboxConfigurationError
from .flow_limits import Flow, parse_flows

PREFIX = "CELERY_OUTBOX_"


class OutsideTransaction(str, enum.Enum):
    """What an enqueue does when the caller is not inside ``transaction.atomic()``."""

    WARN = "warn"  # write the row in autocommit, log a warning once per task name
    RAISE = "raise"  # refuse: raise OutboxTransactionError
    ALLOW = "allow"  # write the row in autocommit, silently


@dataclass(frozen=True)
class OutboxSettings:
    """Every ``CELERY_OUTBOX_*`` setting, validated."""

    app: str | None = None
    database: str | None = None
    outside_transaction: OutsideTransaction = OutsideTransaction.WARN
    exclude_tasks: tuple[str, ...] = ()
    direct_from_worker: bool = True
    batch_size: int = 500
    lease_seconds: float = 60.0
    #: How long a published strict head (``ordering="strict"``) waits for its worker
    #: to report before it is published again (a worker killed mid-task). Longer
    #: than the longest task, plus its time in the queue.
    strict_lease_seconds: float = 300.0
    max_attempts: int = 10
    retry_base_seconds: float = 2.0
    retry_max_seconds: float = 600.0
    poll_interval: float = 1.0
    broker_outage_cooldown: float = 5.0
    send_timeout: float = 10.0
    confirm_publish: bool = True
    notify: bool = True
    publish_on_commit: bool = False
    #: The relay claims its next batch on a second connection while it publishes one.
    prefetch: bool = True
    statsd_address: str | None = None
    #: Seconds a dead letter is kept before ``purge_dead_letters`` deletes it; None keeps it.
    dead_letter_retention: float | None = None
    #: Dotted path of ``(task_name, args, kwargs) -> (args, kwargs)`` applied to shown arguments.
    redactor: str | None = None
    #: Capture structlog context variables at enqueue (no-op unless structlog is in use).
    log_context: bool = True
    #: Which context variables to capture; None captures all of them.
    log_context_keys: tuple[str, ...] | None = None
    #: Run every task through the inbox (``celery_outbox.inbox``) unless it says ``inbox=False``.
    inbox: bool = False
    #: Alias of the inbox table and of the transaction tasks run in; None: the outbox's.
    inbox_database: str | None = None
    #: Seconds an inbox row is kept before ``celery_outbox.inbox.purge`` deletes it (7 days).
    inbox_retention: float = 7 * 86400.0
    #: Keep each message's history (``outbox tasks inspect``, the admin); off by default.
    history: bool = False
    #: Seconds a history event is kept (7 days); ``purge_dead_letters`` deletes older ones.
    history_retention: float = 7 * 86400.0
    #: Aliases the handler processor serves; None: every alias the router lets the
    #: handler tables migrate to (``celery_outbox.handlers``).
    handler_databases: tuple[str, ...] | None = None
    #: How long a handler processor owns a shard without renewing its lease.
    handler_lease_seconds: float = 30.0
    #: Wait after a handler's first failure, doubled after each one, up to the max.
    handler_retry_base_seconds: float = 1.0
    handler_retry_max_seconds: float = 3600.0
    #: Events (``celery_outbox.events``): the topic exchange events are published to.
    events_exchange: str = "events"
    #: Broker-side retry steps of a failed event subscriber: delays of 1, 2, 4 ... 2^(n-1) s.
    events_max_retries: int = 10
    #: Seconds an archived event is kept in a service's archive queue (7 days).
    events_archive_ttl: float = 7 * 86400.0
    #: Events a service's archive queue keeps at most (the oldest are dropped).
    events_archive_max_length: int = 10_000
    #: ``"classic"`` or ``"quorum"``: the type of event, retry and archive queues.
    events_queue_type: str = "classic"
    #: Where a failed event subscriber's retries wait: ``"broker"`` (TTL queues, RabbitMQ),
    #: ``"database"`` (delayed outbox rows) or ``"auto"`` (broker on RabbitMQ, else database).
    events_retries: str = "auto"
    #: A task whose ETA (``countdown``, ``eta``) is more than this many seconds away
    #: stays in the outbox, scheduled, and is published when it falls due; None
    #: publishes every task at once, as Celery does (see docs/scheduling.md).
    schedule_after: float | None = 60.0
    #: Flow control (docs/flow.md): tasks that share rates for the whole deployment,
    #: read from ``{"name": {"tasks": [...], "rate": "10/s" or [...]}}``.
    flows: tuple[Flow, ...] = ()


_FIELDS = {
    "APP": "app",
    "DATABASE": "database",
    "OUTSIDE_TRANSACTION": "outside_transaction",
    "EXCLUDE_TASKS": "exclude_tasks",
    "DIRECT_FROM_WORKER": "direct_from_worker",
    "BATCH_SIZE": "batch_size",
    "LEASE_SECONDS": "lease_seconds",
    "STRICT_LEASE_SECONDS": "strict_lease_seconds",
    "MAX_ATTEMPTS": "max_attempts",
    "RETRY_BASE_SECONDS": "retry_base_seconds",
    "RETRY_MAX_SECONDS": "retry_max_seconds",
    "POLL_INTERVAL": "poll_interval",
    "BROKER_OUTAGE_COOLDOWN": "broker_outage_cooldown",
    "SEND_TIMEOUT": "send_timeout",
    "CONFIRM_PUBLISH": "confirm_publish",
    "NOTIFY": "notify",
    "PUBLISH_ON_COMMIT": "publish_on_commit",
    "PREFETCH": "prefetch",
    "STATSD_ADDRESS": "statsd_address",
    "DEAD_LETTER_RETENTION": "dead_letter_retention",
    "REDACTOR": "redactor",
    "LOG_CONTEXT": "log_context",
    "LOG_CONTEXT_KEYS": "log_context_keys",
    "INBOX": "inbox",
    "INBOX_DATABASE": "inbox_database",
    "INBOX_RETENTION": "inbox_retention",
    "HISTORY": "history",
    "HISTORY_RETENTION": "history_retention",
    "HANDLER_DATABASES": "handler_databases",
    "HANDLER_LEASE_SECONDS": "handler_lease_seconds",
    "HANDLER_RETRY_BASE_SECONDS": "handler_retry_base_seconds",
    "HANDLER_RETRY_MAX_SECONDS": "handler_retry_max_seconds",
    "EVENTS_EXCHANGE": "events_exchange",
    "EVENTS_MAX_RETRIES": "events_max_retries",
    "EVENTS_ARCHIVE_TTL": "events_archive_ttl",
    "EVENTS_ARCHIVE_MAX_LENGTH": "events_archive_max_length",
    "EVENTS_QUEUE_TYPE": "events_queue_type",
    "EVENTS_RETRIES": "events_retries",
    "SCHEDULE_AFTER": "schedule_after",
    "FLOWS": "flows",
}

#: The values of the string settings that take one of a few choices.
_CHOICES = {
    "events_queue_type": ("classic", "quorum"),
    "events_retries": ("auto", "broker", "database"),
}


def _positive(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise OutboxConfigurationError(
            f"{PREFIX}{name} must be a positive {kind.__name__}, got {value!r}."
        )
    if not math.isfinite(value):  # nan passes the test above: it compares false
        raise OutboxConfigurationError(
            f"{PREFIX}{name} must be a positive {kind.__name__}, got {value!r}: "
            f"infinity and NaN are not numbers of seconds."
        )
    return kind(value)


def split_address(address: str) -> tuple[str, int]:
    """``("host", port)`` from ``"host:port"`` (``"[::1]:8125"`` for IPv6).

    Raises :class:`ValueError` when the host is missing or the port is not 1-65535.
    """
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isascii() or not port.isdigit():
        raise ValueError(f"expected 'host:port', got {address!r}")
    number = int(port)
    if not 0 < number < 65536:
        raise ValueError(f"the port must be 1-65535, got {address!r}")
    return host, number


def _address(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            split_address(value)
        except ValueError:
            pass
        else:
            return value
    raise OutboxConfigurationError(
        f"{PREFIX}{name} must be 'host:port' with a port from 1 to 65535 (e.g. "
        f"'statsd.internal:8125', '[::1]:8125') or None, got {value!r}."
    )


def _str_tuple(
    name: str, value: Any, expected: str = "a list of task names or glob patterns"
) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise OutboxConfigurationError(
            f"{PREFIX}{name} must be {expected}, got {value!r}."
        )
    items = tuple(value)
    bad = [item for item in items if not isinstance(item, str) or not item]
    if bad:
        raise OutboxConfigurationError(
            f"{PREFIX}{name} holds entries that are not non-empty strings: {bad!r}."
        )
    return items


def _retention(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise OutboxConfigurationError(
            f"{PREFIX}{name} must be None, a number of seconds or a duration such as "
            f"'30d', got {value!r}."
        )
    if value == math.inf:
        raise OutboxConfigurationError(
            f"{PREFIX}{name} must be a finite duration, got {value!r}; set it to None "
            f"to keep dead letters forever."
        )
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise OutboxConfigurationError(f"{PREFIX}{name}: {exc}.") from None


def _schedule_after(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if not is_seconds(value):
        raise OutboxConfigurationError(
            f"{PREFIX}{name} must be None (publish every task at once) or a number of "
            f"seconds >= 0 (e.g. 60), got {value!r}."
        )
    return float(value)


def _key_names(name: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    return _str_tuple(
        name,
        value,
        "None (capture every variable) or a list of context variable names "
        "(e.g. ['request_id', 'user_id'])",
    )


def _validated(field: str, value: Any) -> Any:
    """One setting's value, checked and converted; raises naming the setting."""
    name = next(n for n, f in _FIELDS.items() if f == field)
    if field == "statsd_address":
        return _address(name, value)
    if field in {"app", "database", "redactor", "inbox_database"}:
        if value is not None and (not isinstance(value, str) or not value):
            raise OutboxConfigurationError(
                f"{PREFIX}{name} must be a non-empty string or None, got {value!r}."
            )
        return value
    if field == "outside_transaction":
        try:
            return OutsideTransaction(value)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in OutsideTransaction)
            raise OutboxConfigurationError(
                f"{PREFIX}{name} must be one of {choices}, got {value!r}."
            ) from None
    if field == "dead_letter_retention":
        return _retention(name, value)
    if field == "schedule_after":
        return _schedule_after(name, value)
    if field == "flows":
        try:
            return parse_flows(value)
        except ValueError as exc:
            raise OutboxConfigurationError(f"{PREFIX}{name}: {exc}.") from None
    if field in _CHOICES:
        if value not in _CHOICES[field]:
            choices = ", ".join(repr(choice) for choice in _CHOICES[field])
            raise OutboxConfigurationError(
                f"{PREFIX}{name} must be one of {choices}, got {value!r}."
            )
        return value
    if field == "events_exchange":
        if not isinstance(value, str) or not value or ":" in value:
            raise OutboxConfigurationError(
                f"{PREFIX}{name} must be a non-empty exchange name without ':', "
                f"got {value!r}."
            )
        return value
    if field == "events_max_retries":
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 0 <= value <= 24
        ):
            raise OutboxConfigurationError(
                f"{PREFIX}{name} must be an int from 0 to 24 (the last step waits "
                f"2^(n-1) seconds), got {value!r}."
            )
        return value
    if field == "events_archive_ttl":
        if value is None or value == math.inf:
            raise OutboxConfigurationError(
                f"{PREFIX}{name} must be a finite duration such as '7d', got {value!r}."
            )
        return _retention(name, value)
    if field in {"inbox_retention", "history_retention"}:
        if value is None or value == math.inf:
            raise OutboxConfigurationError(
                f"{PREFIX}{name} must be a finite duration such as '7d', got {value!r}: "
                f"a table kept forever grows without bound."
            )
        return _retention(name, value)
    if field == "exclude_tasks":
        return _str_tuple(
            name,
            value,
            "a list of task names or glob patterns (e.g. ['myapp.tasks.ping', 'metrics.*'])",
        )
    if field == "log_context_keys":
        return _key_names(name, value)
    if field == "handler_databases":
        if value is None:
            return None
        return _str_tuple(
            name, value, "None (every database) or a list of database aliases"
        )
    if field in {
        "direct_from_worker",
        "confirm_publish",
        "notify",
        "publish_on_commit",
        "prefetch",
        "log_context",
        "inbox",
        "history",
    }:
        if not isinstance(value, bool):
            raise OutboxConfigurationError(
                f"{PREFIX}{name} must be True or False, got {value!r}."
            )
        return value
    if field in {"batch_size", "max_attempts", "events_archive_max_length"}:
        if isinstance(value, float):
            raise OutboxConfigurationError(
                f"{PREFIX}{name} must be a positive int, got {value!r}."
            )
        return _positive(name, value, int)
    return _positive(name, value, float)


def _unknown(key: str) -> str:
    """The message for a ``CELERY_OUTBOX_*`` name this version does not read (a typo,
    or a setting an earlier version read), with a close match."""
    known = [PREFIX + name for name in _FIELDS]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    hint = (
        f" Did you mean {close[0]}?"
        if close
        else f" Known settings: {', '.join(known)}."
    )
    return f"Unknown setting {key}: correct its name, or delete it.{hint}"


def load_settings(source: Any = django_settings) -> OutboxSettings:
    """Build :class:`OutboxSettings` from a Django settings object, validating each value.

    Every problem is reported at once, in one :class:`OutboxConfigurationError`.
    """
    raw = {
        field: getattr(source, PREFIX + name)
        for name, field in _FIELDS.items()
        if hasattr(source, PREFIX + name)
    }
    problems: list[str] = []
    for key in dir(source):
        name = key[len(PREFIX) :]
        if key.startswith(PREFIX) and name not in _FIELDS:
            problems.append(_unknown(key))
    values: dict[str, Any] = {}
    for field, value in raw.items():
        try:
            values[field] = _validated(field, value)
        except OutboxConfigurationError as exc:
            problems.append(str(exc))
    if problems:
        if len(problems) == 1:
            raise OutboxConfigurationError(problems[0])
        raise OutboxConfigurationError(
            f"{len(problems)} celery-outbox settings are wrong:\n"
            + "\n".join(f"- {problem}" for problem in problems)
        )
    result = OutboxSettings(**values)
    if result.lease_seconds <= result.send_timeout:
        raise OutboxConfigurationError(
            f"{PREFIX}LEASE_SECONDS ({result.lease_seconds}) must be longer than "
            f"{PREFIX}SEND_TIMEOUT ({result.send_timeout}), or another relay could claim "
            f"rows still being published."
        )
    if result.retry_max_seconds < result.retry_base_seconds:
        raise OutboxConfigurationError(
            f"{PREFIX}RETRY_MAX_SECONDS ({result.retry_max_seconds}) must not be smaller "
            f"than {PREFIX}RETRY_BASE_SECONDS ({result.retry_base_seconds})."
        )
    if result.handler_retry_max_seconds < result.handler_retry_base_seconds:
        raise OutboxConfigurationError(
            f"{PREFIX}HANDLER_RETRY_MAX_SECONDS ({result.handler_retry_max_seconds}) "
            f"must not be smaller than {PREFIX}HANDLER_RETRY_BASE_SECONDS "
            f"({result.handler_retry_base_seconds})."
        )
    return result


@functools.lru_cache(maxsize=1)
def get_settings() -> OutboxSettings:
    """The process-wide settings, read once."""
    return load_settings()


@receiver(setting_changed)
def _forget_settings(*, setting: str, **_: Any) -> None:
    if setting.startswith(PREFIX) or setting == "DATABASES":
        get_settings.cache_clear()
