"""The gate: what a lane may publish now of the rows it claimed, and what becomes of
the rows it published.

A lane asks its gate before it publishes a claimed batch; the gate answers with an
:class:`Admission`: the rows to publish now, and the rows to put back (released: no
attempt used, not an error), each with when it is due again. After the publish, the lane hands the gate the batch's settlement, and the
gate applies what its policies keep of a published row: a strict head stays in the
outbox, running, until its worker reports (strict ordering is a limit of one running
task per key, whose order the claim keeps); a head that failed for good blocks its
key. Each policy that limits publishing (a flow's rates, its keys' limits on running
and queued tasks, ordered keys) is a case of this one seam, so the lane's own
settlement never learns of limits or ordering.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..envelope import StoredMessage
from ..outcomes import Decision, Settlement

#: How long a published strict head stays running without its worker's report,
#: unless the settings say (``CELERY_OUTBOX_STRICT_LEASE_SECONDS``).
RUNNING_SECONDS = 300.0


@dataclass(frozen=True)
class Admission:
    """A gate's answer for a claimed batch: what goes now, what goes back and when."""

    admitted: tuple[StoredMessage, ...]
    #: Released rows (no attempt used), each due again after its delay.
    held: tuple[Decision, ...] = ()
    #: Rows the gate put back itself (waiting for a slot of their key): the lane
    #: settles nothing for them.
    parked: tuple[int, ...] = ()


class Gate(Protocol):
    """Decides, for a claimed batch, which rows go to the broker now, and what
    becomes of the rows that went."""

    def admit(self, messages: Sequence[StoredMessage], token: str = "") -> Admission:
        """The rows to publish now and the rows to release with their delays.

        ``token``: the claim's lease token, which fences the rows the gate puts
        back itself (:attr:`Admission.parked`); without
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
