"""Outbox rows held on a connection until its next statement or its ``COMMIT``.

Only connections of the write-on-commit engine (:mod:`celery_outbox.backends`) carry
a :class:`HeldRows`; :meth:`~celery_outbox.store.store.OutboxWriter.insert` looks for
it under :data:`HELD_ROWS`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..envelope import Envelope

#: The connection attribute that holds a :class:`HeldRows`.
HELD_ROWS = "outbox_held_rows"


class HeldRows:
    """Messages enqueued inside ``atomic()`` since the connection's last statement."""

    __slots__ = ("_envelopes", "_notify")

    def __init__(self) -> None:
        self._envelopes: list[Envelope] = []
        self._notify = False

    def __bool__(self) -> bool:
        return bool(self._envelopes)

    def add(self, envelopes: Sequence[Envelope], notify: bool) -> None:
        """Hold more messages; one of the writes asking for a wake-up is enough."""
        self._envelopes.extend(envelopes)
        self._notify = self._notify or notify

    def take(self) -> tuple[list[Envelope], bool]:
        """Everything held, in enqueue order, and whether to wake relays; holds nothing after."""
        envelopes, notify = self._envelopes, self._notify
        self._envelopes, self._notify = [], False
        return envelopes, notify

    def clear(self) -> None:
        """Forget what is held: its transaction or savepoint rolled back."""
        self._envelopes, self._notify = [], False
