"""Ordered keys' gate: the gate a relay uses when no flow limits what it publishes.

It lets every claimed row go, and applies ordered keys' policy to what was
published (:func:`~.core.ordered_settlement`): a strict head stays running until its
worker reports, and a head that used up its attempts blocks a ``block`` key. The
flow gate (:class:`celery_outbox.flow.gate.FlowGate`) builds on it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.gate import RUNNING_SECONDS, Admission
from ..envelope import StoredMessage
from ..outcomes import Settlement
from .core import ordered_settlement


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
        """Ordered keys' rows settled as :func:`~.core.ordered_settlement` says."""
        return ordered_settlement(settlement, published, self.running_seconds)
