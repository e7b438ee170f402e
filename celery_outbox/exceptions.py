"""The exceptions celery-outbox raises.

Driver and broker exceptions are translated into this small tree once, at the edge
(the store and the publishers), so callers and the relay loop catch by type.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every error celery-outbox raises on purpose."""


class OutboxConfigurationError(OutboxError):
    """A setting or the environment is wrong; raised at start-up, says what to set."""


class OutboxTransactionError(OutboxError):
    """The call cannot be written atomically with the caller's transaction."""


class OutboxSerializationError(OutboxError, TypeError):
    """The task's arguments cannot be encoded by the app's serializer; nothing was written."""


class OutboxValueError(OutboxError, ValueError):
    """A value of the call does not fit the outbox table; nothing was written."""


class UnsupportedPayloadVersion(OutboxError):
    """A row was written by a newer celery-outbox than the relay that read it."""


class OutboxDatabaseError(OutboxError):
    """The outbox database could not be reached or refused a statement."""
