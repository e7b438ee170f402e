"""The relay's and the processor's metrics exist from their start, at 0."""

from __future__ import annotations

import prometheus_client

from celery_outbox.handlers.metrics import HandlerMetrics
from celery_outbox.metrics import RelayMetrics
from celery_outbox.sinks import PrometheusSink


def test_a_starting_relay_reports_its_counters_at_zero_and_its_breaker_closed() -> None:
    registry = prometheus_client.CollectorRegistry()
    RelayMetrics(PrometheusSink(registry))
    value = registry.get_sample_value
    # Present before anything happened: increase() sees the first dead letter after a
    # restart, and absent() of these means that no relay is scraped.
    for name in (
        "published",
        "failed",
        "dead_lettered",
        "outages",
        "coalesced",
        "blocked",
    ):
        assert value(f"celery_outbox_{name}_total") == 0, name
    assert value("celery_outbox_breaker_open") == 0


def test_a_starting_processor_reports_its_counters_at_zero() -> None:
    registry = prometheus_client.CollectorRegistry()
    HandlerMetrics(PrometheusSink(registry))
    value = registry.get_sample_value
    for name in ("processed", "retried", "dead_lettered", "coalesced"):
        assert value(f"celery_outbox_handler_{name}_total") == 0, name
