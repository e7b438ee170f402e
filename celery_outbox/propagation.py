"""What a message carries from its caller's context, taken at enqueue: structlog's
context variables and OpenTelemetry's trace headers.

Neither library is imported here unless the application has imported it first
(each is looked up in ``sys.modules``), so an application that uses neither pays
nothing. An empty log context is the constant ``EMPTY_LOG_CONTEXT``: no JSON work on
the enqueue path. The relay's halves (binding the context around its log lines, a
span per batch) are observers, in :mod:`celery_outbox.contrib`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

from .conf import OutboxSettings
from .envelope import EMPTY_LOG_CONTEXT

#: Present in ``sys.modules`` once the application uses structlog's context variables.
CONTEXTVARS_MODULE = "structlog.contextvars"

#: Present in ``sys.modules`` once the application uses OpenTelemetry.
OTEL_TRACE_MODULE = "opentelemetry.trace"


def capture_log_context(settings: OutboxSettings) -> Mapping[str, Any]:
    """The caller's structlog context variables to store with a message (allowlisted).

    A no-op unless ``structlog.contextvars`` has been imported (nothing can be bound
    otherwise) and ``CELERY_OUTBOX_LOG_CONTEXT`` is on.
    """
    if not settings.log_context:
        return EMPTY_LOG_CONTEXT
    contextvars_module = sys.modules.get(CONTEXTVARS_MODULE)
    if contextvars_module is None:
        return EMPTY_LOG_CONTEXT
    values: dict[str, Any] = contextvars_module.get_contextvars()
    if not values:
        return EMPTY_LOG_CONTEXT
    keys = settings.log_context_keys
    if keys is not None:
        values = {key: values[key] for key in keys if key in values}
        if not values:
            return EMPTY_LOG_CONTEXT
    return values


def add_trace_headers(headers: MutableMapping[str, Any]) -> None:
    """Inject the active span's context into message headers; never alters a header.

    With ``opentelemetry-instrumentation-celery`` active, Celery's
    ``before_task_publish`` injected ``traceparent`` in the caller already: only the
    headers nothing else set are added, and only when a valid span is active. Call
    it once :data:`OTEL_TRACE_MODULE` is in ``sys.modules``.
    """
    from opentelemetry import propagate, trace

    if not trace.get_current_span().get_span_context().is_valid:
        return
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    for key, value in carrier.items():
        if key not in headers:
            headers[key] = value
