"""structlog context variables: captured at enqueue, bound when the relay logs a message.

Capture is a no-op unless ``structlog.contextvars`` has been imported (nothing can
be bound otherwise) and ``CELERY_OUTBOX_LOG_CONTEXT`` is on. An empty context is
stored as the constant ``"{}"``: no JSON work on the enqueue path.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from ..conf import OutboxSettings
from ..envelope import EMPTY_LOG_CONTEXT, StoredMessage

_CONTEXTVARS_MODULE = "structlog.contextvars"


def capture_log_context(settings: OutboxSettings) -> Mapping[str, Any]:
    """The caller's structlog context variables to store with a message (allowlisted)."""
    if not settings.log_context:
        return EMPTY_LOG_CONTEXT
    contextvars_module = sys.modules.get(_CONTEXTVARS_MODULE)
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


@contextlib.contextmanager
def bound_log_context(message: StoredMessage) -> Iterator[None]:
    """Bind a message's captured context for the log lines written inside the block."""
    context = message.envelope.log_context
    contextvars_module = sys.modules.get(_CONTEXTVARS_MODULE)
    if not context or contextvars_module is None:
        yield
        return
    with contextvars_module.bound_contextvars(**context):
        yield


def structlog_available() -> bool:
    """Whether structlog can be imported (checked once, when the relay is built)."""
    try:
        import structlog.contextvars  # noqa: F401
    except ImportError:
        return False
    return True
