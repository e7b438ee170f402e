"""A queue declaration as the calling process made it, stored with the row.

A ``kombu.Queue`` given per call (``queue=Queue(...)``) or through ``task_routes``
may exist only in the caller's process: the relay's own app does not know it, and
declaring Celery's automatic direct queue of that name instead would route the
message to the wrong place (or nowhere). So the enqueue path stores each queue it
was asked to declare as a plain JSON object, built from the queue's public
attributes, and the relay rebuilds the same ``Queue`` from it.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kombu import Exchange, Queue, binding

from .caches import BoundedCache, bounded_cache

#: The queue attributes stored as they are (all plain values, or None).
_QUEUE_ATTRIBUTES = (
    "routing_key",
    "durable",
    "exclusive",
    "auto_delete",
    "queue_arguments",
    "binding_arguments",
    "expires",
    "message_ttl",
    "max_length",
    "max_length_bytes",
    "max_priority",
    "no_declare",
)
_EXCHANGE_ATTRIBUTES = ("name", "type", "durable", "auto_delete", "arguments")


#: Specs of long-lived queues (the app's ``task_queues``, routes), by object identity:
#: most calls declare one of the same few Queue objects.
_SPECS: BoundedCache[int, tuple[weakref.ref[Queue], str]] = bounded_cache(
    "queues.specs", 256
)


def cached_queue_spec(queue: Queue) -> str:
    """:func:`queue_spec`, remembered for this very Queue object while it lives."""
    found = _SPECS.get(id(queue))
    if found is not None and found[0]() is queue:
        return found[1]
    spec = queue_spec(queue)
    _SPECS.put(id(queue), (weakref.ref(queue), spec))
    return spec


def queue_spec(queue: Queue) -> str:
    """What the relay needs to declare ``queue`` and its bindings exactly as given, as JSON.

    Raises :class:`ValueError` naming the part JSON cannot hold.
    """
    spec: dict[str, Any] = {"name": queue.name}
    for attribute in _QUEUE_ATTRIBUTES:
        spec[attribute] = getattr(queue, attribute, None)
    spec["exchange"] = _exchange_spec(queue.exchange)
    spec["bindings"] = [
        {
            "exchange": _exchange_spec(each.exchange),
            "routing_key": each.routing_key,
            "arguments": each.arguments,
        }
        for each in sorted(queue.bindings or (), key=_binding_order)
    ]
    try:
        return json.dumps(spec, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"the declaration of queue {queue.name!r} holds a value JSON cannot "
            f"store ({exc})"
        ) from None


def queue_from_spec(spec: Mapping[str, Any]) -> Queue:
    """The ``Queue`` :func:`queue_spec` described."""
    options = {attribute: spec.get(attribute) for attribute in _QUEUE_ATTRIBUTES}
    bindings = [
        binding(
            _exchange_from(each.get("exchange")),
            routing_key=each.get("routing_key") or "",
            arguments=each.get("arguments"),
        )
        for each in spec.get("bindings") or ()
    ]
    exchange = _exchange_from(spec.get("exchange"))
    return Queue(
        str(spec["name"]),
        exchange=exchange,
        bindings=bindings or None,
        **{key: value for key, value in options.items() if value is not None},
    )


def is_spec(value: Any) -> bool:
    """Whether a stored ``declare_queues`` item is a declaration (else a bare name)."""
    return isinstance(value, dict) and isinstance(value.get("name"), str)


def _exchange_spec(exchange: Exchange | None) -> dict[str, Any] | None:
    if exchange is None:
        return None
    return {
        attribute: getattr(exchange, attribute, None)
        for attribute in _EXCHANGE_ATTRIBUTES
    }


def _exchange_from(spec: Mapping[str, Any] | None) -> Exchange | None:
    if spec is None:
        return None
    return Exchange(
        spec.get("name") or "",
        type=spec.get("type") or "direct",
        durable=spec.get("durable", True),
        auto_delete=spec.get("auto_delete", False),
        arguments=spec.get("arguments"),
    )


def _binding_order(each: Any) -> tuple[str, str]:
    exchange = getattr(each, "exchange", None)
    return (getattr(exchange, "name", "") or "", each.routing_key or "")


#: Queues rebuilt from stored declarations, by their JSON text (unbound: a
#: publisher binds a copy to its channel).
_REBUILT: BoundedCache[str, Queue] = bounded_cache("queues.rebuilt", 256)


def queues_to_declare(
    names: Sequence[str], specs: Sequence[str], resolve: Callable[[str], Any]
) -> list[tuple[str, Any]]:
    """Each queue a message declares, by name: rebuilt from its stored declaration,
    or, for a bare name (rows of earlier versions), whatever ``resolve`` knows
    (the relay app's queue of that name, or None)."""
    found: list[tuple[str, Any]] = []
    for index, name in enumerate(names):
        spec = specs[index] if index < len(specs) else ""
        if not spec:
            found.append((name, resolve(name)))
            continue
        queue = _REBUILT.get(spec)
        if queue is None:
            queue = _REBUILT.put(spec, queue_from_spec(json.loads(spec)))
        found.append((name, queue))
    return found
