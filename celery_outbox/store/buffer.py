"""Outbox rows buffered on a connection until its next statement or its ``COMMIT``.

Only connections of the write-on-commit engine (:mod:`celery_outbox.backends`) carry
a :class:`RowBuffer`; :meth:`~celery_outbox.store.store.OutboxWriter.insert` looks for
it under :data:`ROW_BUFFER`. (Not "held": in this project a message is *held* until it
is due, as a scheduled task or an event's retry is; these rows are due at once and
only wait for the connection's next round trip.)
"""

from __future__ import annotations

from collections.abc import Sequence

from ..envelope import Envelope

#: The connection attribute that holds a :class:`RowBuffer`.
ROW_BUFFER = "outbox_row_buffer"


class RowBuffer:
    """Messages enqueued inside ``atomic()`` since the connection's last statement."""

    __slots__ = ("_envelopes", "_notify")

    def __init__(self) -> None:
        self._envelopes: list[Envelope] = []
        self._notify = False

    def __bool__(self) -> bool:
        return bool(self._envelopes)

    def add(self, envelopes: Sequence[Envelope], notify: bool) -> None:
        """Buffer more messages; one of the writes asking for a wake-up is enough."""
        self._envelopes.extend(envelopes)
        self._notify = self._notify or notify

    def take(self) -> tuple[list[Envelope], bool]:
        """Everything buffered, in enqueue order, and whether to wake relays; empty after."""
        envelopes, notify = self._envelopes, self._notify
        self._envelopes, self._notify = [], False
        return envelopes, notify

    def clear(self) -> None:
        """Forget what is buffered: its transaction or savepoint rolled back."""
        self._envelopes, self._notify = [], False
