"""The gate: what a lane may publish now of the rows it claimed, and what becomes of
the rows it published.

A lane asks its gate before it publishes a claimed batch; the gate answers with an
:class:`~celery_outbox.flow.core.Admission`: the rows to publish now, and the rows
to put back (released: no attempt used, not an error), each with when it is due
again. After the publish, the lane hands the gate the batch's settlement, and the
gate applies what its policies keep of a published row: a strict head stays in the
outbox, running, until its worker reports (strict ordering is a limit of one running
task per key, whose order the claim keeps); a head that failed for good blocks its
key. Each policy that limits publishing (a flow's rates, its keys' limits on running
and queued tasks, ordered keys) is a case of this one seam, so the lane's own
settlement never learns of limits or ordering.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..envelope import StoredMessage
from ..flow.core import Admission
from ..ordering.core import ordered_settlement
from ..outcomes import Settlement

#: How long a published strict head stays running without its worker's report,
#: unless the settings say (``CELERY_OUTBOX_STRICT_LEASE_SECONDS``).
RUNNING_SECONDS = 300.0


class Gate(Protocol):
    """Decides, for a claimed batch, which rows go to the broker now, and what
    becomes of the rows that went."""

    def admit(self, messages: Sequence[StoredMessage], token: str = "") -> Admission:
        """The rows to publish now and the rows to release with their delays.

        ``token``: the claim's lease token, which fences the rows the gate puts
        back itself (:attr:`~celery_outbox.flow.core.Admission.parked`); without
        it, nothing is put back by the gate.

        Raises :class:`~celery_outbox.exceptions.OutboxDatabaseError` when its
        state cannot be read; the lane then hands the batch back.
        """
        ...

    def settled(
        self, settlement: Settlement, published: Sequence[StoredMessage]
    ) -> Settlement:
        """``settlement`` of the rows ``published`` was tried for, with what the
        gate's policies keep of them (a strict head held running, a failed head
        of a ``block`` key blocked)."""
        ...


class KeyGate:
    """Ordered keys' policy alone: no limit on publishing; a published strict head
    stays running for ``running_seconds`` (or until its worker reports), and a head
    that used up its attempts blocks a ``block`` key."""

    def __init__(self, running_seconds: float = RUNNING_SECONDS) -> None:
        self.running_seconds = running_seconds

    def admit(self, messages: Sequence[StoredMessage], token: str = "") -> Admission:
        """Every row, now."""
        return Admission(tuple(messages))

    def settled(
        self, settlement: Settlement, published: Sequence[StoredMessage]
    ) -> Settlement:
        """Ordered keys' rows settled as :func:`~celery_outbox.ordering.core.ordered_settlement` says."""
        return ordered_settlement(settlement, published, self.running_seconds)
