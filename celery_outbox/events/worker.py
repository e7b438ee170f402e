"""Worker start: declare the service's topology and consume its event queues."""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import celeryd_after_setup

from ..conf import get_settings
from .declare import declare
from .registry import FIRST_SUBSCRIBER, Registry, registry_of

logger = logging.getLogger("celery_outbox.events")


def prepare_worker(app: Any) -> list[str]:
    """Declare ``app``'s topology and add its event queues to those the worker consumes.

    Returns the names of the queues added (none when the app has no subscriber).
    """
    registry = registry_of(app)
    if not registry.subscribers:
        return []
    topology = registry.topology()
    with app.connection_for_write() as connection:
        declare(connection, topology.all_queues(), get_settings(), topology.service)
    for pattern in topology.patterns:
        app.amqp.queues.select_add(topology.consumed_queue(pattern))
    names = [queue.name for queue in topology.event_queues()]
    logger.info("events: service %s consumes %s", topology.service, ", ".join(names))
    return names


def _on_worker_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    if instance is not None:
        prepare_worker(instance.app)


def listen_at_worker_start(registry: Registry) -> None:
    """Prepare the worker at its start, once a service has a subscriber."""
    # Connecting the same receiver again does nothing: one connection per process.
    celeryd_after_setup.connect(_on_worker_setup, weak=False)


FIRST_SUBSCRIBER.append(listen_at_worker_start)
