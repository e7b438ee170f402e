"""Flow control: what the relay may publish now, the same on every relay.

A flow names some tasks (names or globs) and the rates they share for the whole
deployment (``CELERY_OUTBOX_FLOWS``). The relay asks its gate
(:mod:`celery_outbox.engine.gate`) which claimed rows it may publish; the flow gate
(:mod:`.gate`) answers from the publish records in the outbox's database
(:mod:`celery_outbox.store.flows`), so every relay sees the same window. A flow's
values and the pure decisions over them, which the settings and the stores read
too, are in :mod:`celery_outbox.flow_limits`. See docs/flow.md.
"""

from __future__ import annotations

from ..flow_limits import Flow, Rate, parse_flows, parse_rate

__all__ = ["Flow", "Rate", "parse_flows", "parse_rate"]
