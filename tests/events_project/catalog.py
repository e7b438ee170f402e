"""The events the shop fires, declared on whichever app is given (the shop's module
app in subprocesses, a short-lived app in the test process)."""

from __future__ import annotations

from typing import Any


def declare_events(app: Any) -> Any:
    """Declare ``order.created`` on ``app``; returns the event."""

    @app.event("order.created")
    def order_created(order_id: int, total: str) -> None:
        """An order was committed."""
        if order_id < 0:
            raise ValueError("order_id must not be negative")

    return order_created
