"""Transactional events to many services: ``@app.event`` fires, ``@app.handler`` reacts.

An event is written to the outbox in the caller's transaction and published by the
relay to a topic exchange; every service with a handler of it gets its own copy in
its own queue (RabbitMQ or Redis). A failing handler is retried on the broker (TTL
queues and dead-letter exchanges, RabbitMQ) or through delayed outbox rows (Redis,
:mod:`.held`), then archived, from where ``manage.py outbox events archive replay``
puts it back. ``@app.handler(..., inbox=True)`` runs a handler once per event
(:mod:`.once`). See docs/events.md.
"""

from __future__ import annotations

from .registry import DELIVER_TASK, EVENT_HEADER, Event, Handler, registry_of

__all__ = ["DELIVER_TASK", "EVENT_HEADER", "Event", "Handler", "registry_of"]
