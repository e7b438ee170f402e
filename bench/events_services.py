"""The two services of the events part's end-to-end run (``bench.events_e2e``).

Each is its own Celery app, as separate services would be, run by one worker process
(``celery -A bench.events_services:billing worker``). ``billing`` handles ``order.*``
and ``shipping`` ``order.created``; both handle ``probe.retry``, which fails
``PROBE_FAILURES`` times before it succeeds, so that the part can time the retries.
Subscribers record what they ran, with the time (monotonic clock), in Redis lists named
after the run's events exchange.
"""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.events_settings")

from bench.events_records import HANDLED, PROBED, Records, service_name
from celery_outbox import OutboxCelery
from celery_outbox.conf import get_settings

#: How many times a probe fails before it succeeds: one failure per retry step.
PROBE_FAILURES = 3


class ProbeFailure(RuntimeError):
    """Raised on purpose by the probe subscriber, to be retried."""


def _records() -> Records:
    return Records(get_settings().events_exchange)


def service_app(name: str) -> OutboxCelery:
    """The app of service ``name``, configured from the Django settings."""
    app = OutboxCelery(service_name(name), set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    return app


def probe(name: str, number: int) -> None:
    """Record an attempt of probe ``number``; fail while it has failures left."""
    records = _records()
    records.add(service_name(name), PROBED, number)
    if records.attempt(service_name(name), number) <= PROBE_FAILURES:
        raise ProbeFailure(f"probe {number} fails on purpose")


billing = service_app("billing")
shipping = service_app("shipping")


@billing.subscriber("order.*")
def billing_order(order_id: int, total: str) -> None:
    """Billing handles every order event."""
    _records().add(service_name("billing"), HANDLED, order_id)


@billing.subscriber("probe.retry")
def billing_probe(number: int) -> None:
    """Billing's retry probe."""
    probe("billing", number)


@shipping.subscriber("order.created")
def shipping_order(order_id: int, total: str) -> None:
    """Shipping handles created orders."""
    _records().add(service_name("shipping"), HANDLED, order_id)


@shipping.subscriber("probe.retry")
def shipping_probe(number: int) -> None:
    """Shipping's retry probe."""
    probe("shipping", number)
