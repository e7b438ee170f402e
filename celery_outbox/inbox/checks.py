"""System checks of the inbox (``celery_outbox_inbox.E001`` / ``W001``), for an app.

:mod:`celery_outbox.checks` registers them when ``celery_outbox.inbox`` is installed,
with the app it resolves.

E001 a task says ``inbox=True`` but its class has no inbox part (``InboxMixin``, in
``celery_outbox.task.OutboxTask``): the option would do nothing.
W001 ``CELERY_OUTBOX_INBOX_RETENTION`` is shorter than the time within which a second
delivery of a message can still arrive.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.core.checks import CheckMessage, Error, Warning

from ..conf import OutboxSettings, get_settings

#: Celery's default ``visibility_timeout`` of the Redis and SQS transports (seconds).
DEFAULT_VISIBILITY_TIMEOUT = 3600.0


def relay_horizon(settings: OutboxSettings) -> float:
    """Longest time between a publish and its re-publish by the relay.

    A publish whose confirm was lost is retried after the lease, then with backoff, up
    to ``MAX_ATTEMPTS`` times.
    """
    backoff = sum(
        min(settings.retry_base_seconds * 2**n, settings.retry_max_seconds)
        for n in range(settings.max_attempts)
    )
    return float(settings.lease_seconds + backoff)


def retry_horizon(task: Any) -> float:
    """Longest time a task's own retries may take (same message id, later delivery)."""
    retries = task.max_retries or 0
    delay = float(task.default_retry_delay or 0)
    if getattr(task, "retry_backoff", False):
        delay = max(delay, float(getattr(task, "retry_backoff_max", 600) or 0))
    return float(retries) * delay


def redelivery_horizon(
    settings: OutboxSettings, app: Any, inbox_tasks: Iterable[Any]
) -> tuple[float, str]:
    """The longest time after which a duplicate can still arrive, and what sets it."""
    candidates = [(relay_horizon(settings), "the relay's lease and retry backoff")]
    if str(app.conf.broker_url or "").startswith(("redis", "rediss", "sqs")):
        timeout = (app.conf.broker_transport_options or {}).get(
            "visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT
        )
        candidates.append((float(timeout), "the broker's visibility_timeout"))
    for task in inbox_tasks:
        candidates.append((retry_horizon(task), f"the retries of {task.name}"))
    return max(candidates)


def check_inbox(app: Any) -> list[CheckMessage]:
    """Inbox options reach a task class with the inbox part; retention outlives redeliveries.

    Registered by :mod:`celery_outbox.checks`, which resolves the app.
    """
    from .task import InboxMixin

    tasks = list(app.tasks.values())
    messages: list[CheckMessage] = [
        Error(
            f"Task {task.name} says inbox=True but its class {type(task).__name__} "
            f"has no inbox part, so its deliveries are not deduplicated.",
            hint="Derive your task class (base= or the app's task_cls) from "
            "celery_outbox.task.OutboxTask.",
            id="celery_outbox_inbox.E001",
        )
        for task in tasks
        if getattr(task, "inbox", None) and not isinstance(task, InboxMixin)
    ]
    inbox_tasks = [t for t in tasks if isinstance(t, InboxMixin) and t.uses_inbox()]
    if not inbox_tasks:
        return messages
    settings = get_settings()
    horizon, reason = redelivery_horizon(settings, app, inbox_tasks)
    if settings.inbox_retention < horizon:
        messages.append(
            Warning(
                f"CELERY_OUTBOX_INBOX_RETENTION ({settings.inbox_retention:.0f} s) is "
                f"shorter than {reason} ({horizon:.0f} s): a duplicate arriving after "
                f"its inbox row was purged would run again.",
                hint=f"Keep inbox rows for at least {horizon:.0f} s.",
                id="celery_outbox_inbox.W001",
            )
        )
    return messages
