"""Transactional events to many services: ``@app.event`` fires, ``@app.subscriber`` reacts.

An event is written to the outbox in the caller's transaction and published by the
relay to a topic exchange; every service with a subscriber to it gets its own copy in
its own queue (RabbitMQ or Redis). A failing subscriber is retried on the broker (TTL
queues and dead-letter exchanges, RabbitMQ) or through outbox rows due later (Redis,
:mod:`.held`), then archived, from where ``manage.py outbox events replay``
puts it back. ``@app.subscriber(..., inbox=True)`` runs a subscriber once per
event (:mod:`.once`). See docs/events.md.

``@app.handler`` and :class:`Handler` are the old names of ``@app.subscriber`` and
:class:`Subscriber`: they still work and warn.
"""

from __future__ import annotations

from typing import Any

# delivery and worker hook into the registry's first subscriber as they are imported.
from . import delivery, worker  # noqa: F401
from .registry import DELIVER_TASK, EVENT_HEADER, Event, Subscriber, registry_of

__all__ = ["DELIVER_TASK", "EVENT_HEADER", "Event", "Subscriber", "registry_of"]


def __getattr__(name: str) -> Any:
    if name == "Handler":
        from .registry import _renamed

        _renamed("celery_outbox.events.Handler", "celery_outbox.events.Subscriber")
        return Subscriber
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
