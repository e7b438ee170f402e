"""Scheduled tasks: whether a message waits in the outbox until its ETA.

Celery publishes a task with ``countdown=`` or ``eta=`` at once, and a worker keeps
it, unacknowledged, until it is due: past the broker's redelivery window (Redis's
``visibility_timeout``, RabbitMQ's ``consumer_timeout``) it is delivered again or
its channel is closed. A task whose ETA is more than ``CELERY_OUTBOX_SCHEDULE_AFTER``
seconds away is *scheduled* instead: its row waits in the outbox and the relay
publishes the message Celery built at the call (``eta`` header included) once it
falls due. These functions decide it from the message's headers, as plain values.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime, timezone, tzinfo
from typing import Any

from celery.utils.time import maybe_iso8601, maybe_make_aware

from .envelope import Envelope

#: The dead letters' reason for a scheduled task that expires before it is due.
EXPIRED_BEFORE_DUE = "expired before due"


def moment(value: Any, zone: tzinfo = timezone.utc) -> datetime | None:
    """A header's time (``eta``, ``expires``) as Celery's worker reads it, or None.

    The worker of every Celery 5.4 to 5.7 reads these headers with
    ``maybe_make_aware(maybe_iso8601(value), app.conf.timezone)`` (``Request``): ISO
    8601 text, and a naive time in **UTC**, whatever the app's timezone (``zone``
    only localizes the result). The same two functions read it here, so the outbox
    holds a task until the moment the worker would run it. A value the worker
    would refuse is None: the task is then published as Celery would.
    """
    if not isinstance(value, (str, datetime)):
        return None
    try:
        parsed = maybe_iso8601(value)
        return None if parsed is None else maybe_make_aware(parsed, zone)
    except (AttributeError, OverflowError, TypeError, ValueError):
        return None


def schedule(
    envelope: Envelope,
    headers: dict[str, Any],
    *,
    after: float | None,
    zone: tzinfo = timezone.utc,
    now: datetime | None = None,
) -> Envelope:
    """``envelope``, scheduled when its ETA is more than ``after`` seconds from ``now``.

    A scheduled envelope carries ``due_in`` (seconds until its ETA); one that also
    expires before its ETA, and so could never run, carries the reason for the dead
    letters (``dead_reason``) instead of being published. Any other envelope is
    returned as it is.
    """
    if after is None:
        return envelope
    eta = moment(headers.get("eta"), zone)
    if eta is None:
        return envelope
    now = now or datetime.now(timezone.utc)
    due_in = (eta - now).total_seconds()
    if due_in <= after:
        return envelope
    reason = ""
    expires = moment(headers.get("expires"), zone)
    if expires is not None and expires < eta:
        reason = (
            f"{EXPIRED_BEFORE_DUE}: the task expires at {expires.isoformat()}, before "
            f"its ETA {eta.isoformat()}, so no worker would run it"
        )
    return dataclasses.replace(
        envelope,
        due_in=due_in,
        due_in_measured_at=time.monotonic(),
        dead_reason=reason,
    )


def far_eta(
    options: dict[str, Any],
    after: float | None,
    *,
    zone: tzinfo = timezone.utc,
    now: datetime | None = None,
) -> bool:
    """Whether ``send_task`` options (``countdown=``, ``eta=``) put the ETA beyond ``after``.

    Asked of calls Celery would publish at once (a worker's ``Task.retry``): a far
    ETA makes them scheduled outbox rows instead.
    """
    if after is None:
        return False
    countdown = options.get("countdown")
    if isinstance(countdown, (int, float)) and not isinstance(countdown, bool):
        return countdown > after
    eta = moment(options.get("eta"), zone)
    if eta is None:
        return False
    now = now or datetime.now(timezone.utc)
    return (eta - now).total_seconds() > after
