"""The demo's event, declared on the app that fires it (the relay's app)."""

from __future__ import annotations

from demo.celery import app
from demo.services import ORDER_PLACED


@app.event(ORDER_PLACED)
def order_placed(order_number: str) -> None:
    """An order was placed; billing and shipping each get their own copy."""
    if not order_number:
        raise ValueError("order_number must not be empty")
