"""Handler outboxes: ordered, coalesced messages run by receivers in your processes.

Declare a receiver per category, emit messages in your transaction, and run
``python manage.py outbox handlers run`` (see ``docs/handlers.md``)::

    from celery_outbox import handlers as outbox

    @outbox.receiver("org.update", max_attempts=None)
    def on_org_update(*, shard, object_id, payload, **kw):
        ...

    with transaction.atomic():
        org.save()
        outbox.emit("org.update", shard=("org", org.id), object_id=org.id,
                    payload={"name": org.name})

Nothing here needs the broker. Add ``"celery_outbox.handlers"`` to
``INSTALLED_APPS`` and migrate.
"""

from __future__ import annotations

from collections.abc import Callable

from .emit import emit, outbox_context
from .registry import Category, Receiver, Registry, registry


def receiver(
    category: str,
    *,
    coalesce: bool = True,
    max_attempts: int | None = None,
    atomic: bool = True,
) -> Callable[[Receiver], Receiver]:
    """Declare the receiver of ``category``.

    ``coalesce``: only the newest message of a (shard, category, object id) runs;
    False runs every one. ``max_attempts``: failed runs before the message goes to the
    dead letters; None (the default) retries forever, blocking its shard. ``atomic``:
    run the receiver in a transaction on the message's database that also deletes
    the message, so its writes and the deletion commit together.
    """

    def register(function: Receiver) -> Receiver:
        registry.add(
            Category(
                name=category,
                receiver=function,
                coalesce=coalesce,
                max_attempts=max_attempts,
                atomic=atomic,
            )
        )
        return function

    return register


__all__ = [
    "Category",
    "Receiver",
    "Registry",
    "emit",
    "outbox_context",
    "receiver",
    "registry",
]
