"""structlog context variables: captured at enqueue, bound when the relay logs a message.

Capture is a no-op unless ``structlog.contextvars`` has been imported (nothing can
be bound otherwise) and ``CELERY_OUTBOX_LOG_CONTEXT`` is on. An empty context is
stored as the constant ``"{}"``: no JSON work on the enqueue path.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from ..conf import OutboxSettings
from ..envelope import EMPTY_LOG_CONTEXT, StoredMessage
from ..relay.events import BatchSettled, RelayEvent

logger = logging.getLogger("celery_outbox.relay")

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


class LogContextListener:
    """Relay listener: one log line per refused or dead-lettered message, in its context.

    Each line is written with the message's enqueue-time context variables bound, so
    structlog's ``merge_contextvars`` (also in a ``ProcessorFormatter`` for standard
    logging) shows the request that sent the task next to the failure.
    """

    def __call__(self, event: RelayEvent) -> None:
        """Log the failures of a settled batch."""
        if not isinstance(event, BatchSettled):
            return
        settlement = event.settlement
        if not settlement.retry and not settlement.dead_letter:
            return
        by_id = {m.id: m for m in event.messages}
        for decision in settlement.retry:
            message = by_id.get(decision.message_id)
            if message is None:
                continue
            with bound_log_context(message):
                logger.warning(
                    "task %s [%s] refused by the broker (attempt %d), retrying in %.1f s: %s",
                    message.envelope.task_name,
                    message.envelope.task_id,
                    message.attempts + 1,
                    decision.delay,
                    decision.error,
                )
        for decision in settlement.dead_letter:
            message = by_id.get(decision.message_id)
            if message is None:
                continue
            with bound_log_context(message):
                logger.error(
                    "task %s [%s] dead-lettered after %d attempts: %s",
                    message.envelope.task_name,
                    message.envelope.task_id,
                    message.attempts + 1,
                    decision.error,
                )
