"""The exceptions celery-outbox raises.

Driver and broker exceptions are translated into this small tree once, at the edge
(the store and the publishers), so callers and the relay loop catch by type.
"""

from __future__ import annotations

from collections.abc import Sequence


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


class OutboxRevokeError(OutboxError):
    """A revoke went out to the workers, but the tasks' outbox rows were not deleted."""

    def __init__(self, task_ids: Sequence[str], cause: BaseException) -> None:
        """``task_ids``: the tasks revoked; ``cause``: why their rows stayed."""
        self.task_ids = list(task_ids)
        shown = ", ".join(self.task_ids[:5]) + (" ..." if len(task_ids) > 5 else "")
        super().__init__(
            f"Revoke of {shown}: Celery's broadcast went out to the workers, but the "
            f"outbox rows were not deleted ({type(cause).__name__}: {cause}). Workers "
            f"that got the broadcast drop these tasks; a worker started since (without "
            f"--statedb) would run one the relay publishes. Once the outbox database "
            f"answers, revoke them again (app.control.revoke(ids)): that deletes the "
            f"rows still there."
        )
