"""structlog context variables, bound when the relay logs a message.

The enqueue path captured them (:func:`celery_outbox.propagation.capture_log_context`);
binding is a no-op unless ``structlog.contextvars`` has been imported.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from ..envelope import StoredMessage
from ..propagation import CONTEXTVARS_MODULE


@contextlib.contextmanager
def bound_log_context(message: StoredMessage) -> Iterator[None]:
    """Bind a message's captured context for the log lines written inside the block."""
    context = message.envelope.log_context
    contextvars_module = sys.modules.get(CONTEXTVARS_MODULE)
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
