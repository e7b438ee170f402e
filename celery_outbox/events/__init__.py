"""Transactional events to many services: ``@app.event`` fires, ``@app.subscriber`` reacts.

An event is written to the outbox in the caller's transaction and published by the
relay to a topic exchange; every service with a subscriber to it gets its own copy in
its own queue (RabbitMQ or Redis). A failing subscriber is retried on the broker (TTL
queues and dead-letter exchanges, RabbitMQ) or through outbox rows due later (Redis,
:mod:`.held`), then archived, from where ``manage.py outbox events replay``
puts it back. ``@app.subscriber(..., inbox=True)`` runs a subscriber once per
event (:mod:`.once`). See docs/events.md.
"""

from __future__ import annotations

# delivery and worker hook into the registry's first subscriber as they are imported.
from . import delivery, worker  # noqa: F401
from .registry import DELIVER_TASK, EVENT_HEADER, Event, Subscriber, registry_of

__all__ = ["DELIVER_TASK", "EVENT_HEADER", "Event", "Subscriber", "registry_of"]
