"""The gate: what a lane may publish now, of the rows it claimed.

A lane asks its gate before it publishes a claimed batch; the gate answers with an
:class:`~celery_outbox.flow.core.Admission`: the rows to publish now, and the rows
to put back (released: no attempt used, not an error), each with when it is due
again. Each policy that limits publishing (a flow's rates, its keys' limits on
running and queued tasks) is a case of this one seam, so the lane's own settlement
never learns of limits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..envelope import StoredMessage
from ..flow.core import Admission


class Gate(Protocol):
    """Decides, for a claimed batch, which rows go to the broker now."""

    def admit(self, messages: Sequence[StoredMessage], token: str = "") -> Admission:
        """The rows to publish now and the rows to release with their delays.

        ``token``: the claim's lease token, which fences the rows the gate puts
        back itself (:attr:`~celery_outbox.flow.core.Admission.settled`); without
        it, nothing is put back by the gate.

        Raises :class:`~celery_outbox.exceptions.OutboxDatabaseError` when its
        state cannot be read; the lane then hands the batch back.
        """
        ...


class OpenGate:
    """No limit: every claimed row goes, and nothing is asked of any database."""

    def admit(self, messages: Sequence[StoredMessage], token: str = "") -> Admission:
        """Every row, now."""
        return Admission(tuple(messages))


#: The gate of a lane with no policy configured.
OPEN = OpenGate()
