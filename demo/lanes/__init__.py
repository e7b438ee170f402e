"""What the demo sends, lane by lane, and what it checks afterwards.

Each lane places its work in the demo process (``place``: the code to read as an
example), then reads what really ran from the rows the tasks, receivers and handlers
wrote (``collect``), and turns it into rows of the result table (``rows``) and into
broken promises (``problems``, empty when everything held).

* :class:`Tasks` (``tasks.py``): ``send_receipt.delay()`` per order.
* :class:`StrictOrder` (``strict.py``): a parcel's steps with ``ordering_key`` and
  ``ordering="strict"``.
* :class:`HandlerOutbox` (``handlers.py``): ``emit()`` in a transaction under
  ``outbox_context(flush=True)``.
* :class:`Inbox` (``inbox.py``): an ``inbox=True`` task whose message is sent twice.
* :class:`Events` (``events.py``): ``order_placed()`` fired to two services (RabbitMQ
  or Redis only).
"""

from __future__ import annotations

from .base import Lane, RollBack, Row
from .events import Events
from .handlers import HandlerOutbox
from .inbox import Inbox
from .strict import StrictOrder
from .tasks import Tasks

__all__ = [
    "Events",
    "HandlerOutbox",
    "Inbox",
    "Lane",
    "RollBack",
    "Row",
    "StrictOrder",
    "Tasks",
]
