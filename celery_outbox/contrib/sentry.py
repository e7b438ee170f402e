"""Sentry: a transaction per relay batch, and relay errors as Sentry events.

Enqueue needs nothing from us: Sentry's ``CeleryIntegration`` wraps
``Celery.send_task``, which ``OutboxCelery.send_task`` calls, so the ``sentry-trace``
and ``baggage`` headers are added in the caller and stored with the row; the worker
continues the caller's trace when the relay has published it.

:class:`SentryRelayTracing` is enabled by ``build_relay`` when ``sentry_sdk`` has been
initialised in the relay process. Imported only once ``sentry_sdk`` has been imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import sentry_sdk

from ..envelope import StoredMessage
from ..outcomes import Outcome
from ..relay.observations import (
    BatchSettled,
    BreakerOpened,
    LoopError,
    RelayObservation,
)

OP = "queue.publish"
TRANSACTION_NAME = "celery_outbox relay batch"
ORIGIN = "auto.queue.celery_outbox"


def sentry_initialised() -> bool:
    """Whether ``sentry_sdk.init`` was called with a DSN in this process."""
    return bool(sentry_sdk.get_client().is_active())


class SentryRelayTracing:
    """Relay batch hook and listener for Sentry."""

    def __init__(self, broker: str = "") -> None:
        self.broker = broker

    @contextlib.contextmanager
    def batch(self, messages: Sequence[StoredMessage]) -> Iterator[None]:
        """A ``queue.publish`` transaction around publishing and settling one batch."""
        with sentry_sdk.start_transaction(
            op=OP, name=TRANSACTION_NAME, origin=ORIGIN
        ) as transaction:
            transaction.set_tag("celery_outbox.batch_size", str(len(messages)))
            if self.broker:
                transaction.set_tag("celery_outbox.broker", self.broker)
            transaction.set_data("messaging.batch.message_count", len(messages))
            yield

    def __call__(self, event: RelayObservation) -> None:
        """Outcome tags on the batch transaction; loop errors as events."""
        if isinstance(event, LoopError):
            with sentry_sdk.new_scope() as scope:
                scope.set_tag("celery_outbox.stage", event.stage)
                if self.broker:
                    scope.set_tag("celery_outbox.broker", self.broker)
                scope.fingerprint = ["celery_outbox", "loop_error", event.stage]
                sentry_sdk.capture_message(
                    f"celery-outbox relay {event.stage} failed: {event.error}",
                    level="error",
                )
        elif isinstance(event, BreakerOpened):
            sentry_sdk.add_breadcrumb(
                category="celery_outbox",
                message=f"broker unreachable: relay pauses for {event.seconds:.1f} s",
                level="warning",
            )
        elif isinstance(event, BatchSettled):
            span = sentry_sdk.get_current_span()
            if span is None:
                return
            outcomes = [r.outcome for r in event.results]
            span.set_tag(
                "celery_outbox.published", str(outcomes.count(Outcome.PUBLISHED))
            )
            span.set_tag("celery_outbox.retried", str(len(event.settlement.retry)))
            span.set_tag(
                "celery_outbox.dead_lettered", str(len(event.settlement.dead_letter))
            )
            if event.settlement.retry or event.settlement.dead_letter:
                span.set_status("internal_error")
            else:
                span.set_status("ok")
