"""Sentry: a transaction (sentry-sdk 2) or a root span (sentry-sdk 3) per relay batch,
and relay errors as Sentry events.

Enqueue needs nothing from us: Sentry's ``CeleryIntegration`` wraps
``Celery.send_task``, which ``OutboxCelery.send_task`` calls, so the ``sentry-trace``
and ``baggage`` headers are added in the caller and stored with the row; the worker
continues the caller's trace when the relay has published it.

:class:`SentryRelayTracing` is enabled by ``build_relay`` when ``sentry_sdk`` has been
initialised in the relay process. Imported only once ``sentry_sdk`` has been imported.

Both lines of the SDK the ``sentry`` extra admits are spoken through their public API,
told apart by what the module offers (never by a version number):

* **sentry-sdk 2**: ``start_transaction``; figures are tags (text), the status is
  ``set_status("ok" | "internal_error")``.
* **sentry-sdk 3**: ``start_span`` with no parent starts a segment (what 2 called a
  transaction), in a trace of its own; figures are attributes (numbers), the status
  is the span's ``status`` (``"ok"`` or ``"error"``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

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

#: The SDK, typed loosely: each line's names are looked up only on that line.
_SDK: Any = sentry_sdk
#: Whether this SDK is the one of spans and attributes (sentry-sdk 3): it has no
#: ``start_transaction``.
SPANS_ONLY = not hasattr(sentry_sdk, "start_transaction")


def sentry_initialised() -> bool:
    """Whether ``sentry_sdk.init`` was called with a DSN in this process."""
    return bool(sentry_sdk.get_client().is_active())


def _figures(span: Any, figures: Mapping[str, int | str]) -> None:
    """Record ``figures`` on ``span``: attributes on sentry-sdk 3, tags on 2."""
    for key, value in figures.items():
        if SPANS_ONLY:
            span.set_attribute(key, value)
        else:
            span.set_tag(key, str(value))


def _status(span: Any, ok: bool) -> None:
    if SPANS_ONLY:
        span.status = "ok" if ok else "error"
    else:
        span.set_status("ok" if ok else "internal_error")


@contextlib.contextmanager
def _root_span(figures: Mapping[str, int | str], count: int) -> Iterator[None]:
    """A span with no parent, in a trace of its own, for a batch of ``count``."""
    if SPANS_ONLY:
        attributes = {
            "sentry.op": OP,
            "sentry.origin": ORIGIN,
            "messaging.batch.message_count": count,
            **figures,
        }
        with sentry_sdk.isolation_scope():
            _SDK.new_trace()
            with _SDK.start_span(
                name=TRANSACTION_NAME, attributes=attributes, parent_span=None
            ):
                yield
        return
    with _SDK.start_transaction(op=OP, name=TRANSACTION_NAME, origin=ORIGIN) as root:
        _figures(root, figures)
        root.set_data("messaging.batch.message_count", count)
        yield


class SentryRelayTracing:
    """Relay batch hook and listener for Sentry."""

    def __init__(self, broker: str = "") -> None:
        self.broker = broker

    @contextlib.contextmanager
    def batch(self, messages: Sequence[StoredMessage]) -> Iterator[None]:
        """A ``queue.publish`` root span around publishing and settling one batch."""
        figures: dict[str, int | str] = {"celery_outbox.batch_size": len(messages)}
        if self.broker:
            figures["celery_outbox.broker"] = self.broker
        with _root_span(figures, len(messages)):
            yield

    def __call__(self, event: RelayObservation) -> None:
        """Outcome figures on the batch's span; loop errors as events."""
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
            span: Any = sentry_sdk.get_current_span()
            if span is None:
                return
            outcomes = [r.outcome for r in event.results]
            settlement = event.settlement
            _figures(
                span,
                {
                    "celery_outbox.published": outcomes.count(Outcome.PUBLISHED),
                    "celery_outbox.retried": len(settlement.retry),
                    "celery_outbox.dead_lettered": len(settlement.dead_letter),
                },
            )
            _status(span, not (settlement.retry or settlement.dead_letter))
