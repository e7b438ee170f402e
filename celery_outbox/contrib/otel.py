"""OpenTelemetry: the enqueuing context travels in the message; each relay batch is a span.

Enqueue: with ``opentelemetry-instrumentation-celery`` active, Celery's
``before_task_publish`` injects ``traceparent`` in the caller and it is stored with
the row, untouched. Without it,
:func:`celery_outbox.propagation.add_trace_headers` injects the current context
itself, only when a valid span is active and only the headers nothing else set. Relay: :class:`OtelRelayTracing` opens one ``celery_outbox publish`` span per
batch, linked to each message's enqueuing context.

Imported only once the application has imported ``opentelemetry.trace``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from opentelemetry import propagate, trace

from ..envelope import StoredMessage
from ..outcomes import Outcome
from ..relay.observations import BatchSettled, RelayObservation

INSTRUMENTATION_NAME = "celery_outbox"
SPAN_NAME = "celery_outbox publish"


def span_active() -> bool:
    """Whether the caller runs inside a recording span (its trace goes into messages)."""
    return bool(trace.get_current_span().get_span_context().is_valid)


def tracer_provider_configured() -> bool:
    """Whether a real TracerProvider is installed (not the API's no-op default)."""
    provider = trace.get_tracer_provider()
    return not isinstance(
        provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
    )


def _link(message: StoredMessage, fields: frozenset[str]) -> trace.Link | None:
    headers = message.envelope.headers
    carrier = {
        name: headers[name] for name in fields if isinstance(headers.get(name), str)
    }
    if not carrier:
        return None
    span_context = trace.get_current_span(propagate.extract(carrier)).get_span_context()
    if not span_context.is_valid:
        return None
    return trace.Link(
        span_context,
        attributes={
            "messaging.message.id": message.envelope.task_id,
            "celery.task_name": message.envelope.task_name,
        },
    )


class OtelRelayTracing:
    """Relay batch hook and listener: a producer span per batch, linked to each message."""

    def __init__(
        self, broker: str = "", tracer_provider: trace.TracerProvider | None = None
    ) -> None:
        self.broker = broker
        self._tracer = trace.get_tracer(
            INSTRUMENTATION_NAME, tracer_provider=tracer_provider
        )

    @contextlib.contextmanager
    def batch(self, messages: Sequence[StoredMessage]) -> Iterator[None]:
        """The span around publishing and settling one batch."""
        fields = frozenset(propagate.get_global_textmap().fields)
        links = [
            link for link in (_link(m, fields) for m in messages) if link is not None
        ]
        attributes: dict[str, Any] = {
            "messaging.system": "celery",
            "messaging.operation.type": "send",
            "messaging.batch.message_count": len(messages),
        }
        if self.broker:
            attributes["celery_outbox.broker"] = self.broker
        with self._tracer.start_as_current_span(
            SPAN_NAME,
            kind=trace.SpanKind.PRODUCER,
            links=links,
            attributes=attributes,
        ):
            yield

    def __call__(self, event: RelayObservation) -> None:
        """Record the batch's outcome on its span (events are emitted inside it)."""
        if not isinstance(event, BatchSettled):
            return
        span = trace.get_current_span()
        if not span.is_recording():
            return
        outcomes = [r.outcome for r in event.results]
        span.set_attribute("celery_outbox.published", outcomes.count(Outcome.PUBLISHED))
        span.set_attribute("celery_outbox.retried", len(event.settlement.retry))
        span.set_attribute(
            "celery_outbox.dead_lettered", len(event.settlement.dead_letter)
        )
        span.set_attribute("celery_outbox.released", len(event.settlement.release))
        if event.settlement.retry or event.settlement.dead_letter:
            span.set_status(
                trace.Status(trace.StatusCode.ERROR, "broker refused messages")
            )
