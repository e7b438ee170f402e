"""Builders shared by the integration tests."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from django.db import connections

from celery_outbox.envelope import Envelope
from celery_outbox.ordering_options import HEADER
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.relay.loop import Relay
from celery_outbox.relay.observations import StopReason
from celery_outbox.store import RelayStore


def envelope(tag: str = "", **overrides: Any) -> Envelope:
    """A message with a recognisable task id and body, as the enqueue path would store it."""
    task_id = (
        overrides.pop("task_id", None) or f"{tag or 'task'}-{uuid.uuid4().hex[:8]}"
    )
    values: dict[str, Any] = {
        "task_id": task_id,
        "task_name": "shop.record",
        "exchange": "",
        "routing_key": "celery",
        "body": b'[["' + tag.encode() + b'"], {}, {}]',
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "headers": {"id": task_id, "task": "shop.record", "argsrepr": repr((tag,))},
        "properties": {"correlation_id": task_id, "delivery_mode": 2},
        "declare": ("celery",),
        "queue": "celery",
        "arguments_preview": f"args=('{tag}',) kwargs={{}}",
    }
    values.update(overrides)
    return Envelope(**values)


def keyed(
    tag: str, key: str | None, flags: str = "", task: str = "shop.record"
) -> Envelope:
    """A message of ``task`` with ``ordering_key`` and the ordering header ``flags``."""
    built = envelope(tag, ordering_key=key, task_name=task)
    headers = dict(built.headers)
    if flags:
        headers[HEADER] = flags
    return envelope(
        tag, task_id=built.task_id, ordering_key=key, task_name=task, headers=headers
    )


def dead_letter_due(
    store: RelayStore, limit: int, reason: str = "PreconditionFailed: too big"
) -> int:
    """Claim up to ``limit`` due rows and dead-letter them as the relay would; how many."""
    claim = store.claim(limit, 30)
    decisions = tuple(
        Decision(m.id, Action.DEAD_LETTER, 0.0, reason) for m in claim.messages
    )
    return store.settle(claim.token, Settlement(dead_letter=decisions)).dead_lettered


def start_in_thread(
    relay: Relay, results: list[StopReason] | None = None
) -> threading.Thread:
    """Run ``relay.run()`` on a thread that closes its own database connections at the end."""

    def run() -> None:
        try:
            reason = relay.run()
            if results is not None:
                results.append(reason)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread
