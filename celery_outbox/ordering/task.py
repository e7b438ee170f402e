"""``OrderingMixin``: per-task ordering defaults, the ordering part of the task class.

``@app.task(ordering="strict", ordering_policy="skip", coalesce=True)`` sets the
defaults of that task's calls that carry an ``ordering_key`` (or ``coalesce_key``);
a call's own option wins. :class:`celery_outbox.task.OutboxTask` composes this part
with the inbox's.

``OrderedTask``, the task class this module used to define, is now ``OutboxTask``:
the old name still works and warns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..deprecation import deprecated

#: Task attributes that become call options when the call has a key.
DEFAULTS = ("ordering", "ordering_policy", "coalesce")

if TYPE_CHECKING:
    from celery import Task

    _Base = Task[Any, Any]
else:  # a part of the task class: Celery's Task comes after it in the class's MRO
    _Base = object


class OrderingMixin(_Base):
    """The ordering part of a task class: per-task defaults for keyed calls.
    Needs Celery's ``Task`` after it in the bases."""

    #: ``"publish"`` (the default) or ``"strict"`` for keyed calls of this task.
    ordering: str | None = None
    #: ``"block"`` (the default) or ``"skip"``: a head that fails for good.
    ordering_policy: str | None = None
    #: Keyed calls of this task coalesce (only the newest unpublished one goes).
    coalesce: bool | None = None

    def apply_async(self, *args: Any, **options: Any) -> Any:
        """Celery's ``apply_async``, with this task's ordering defaults for keyed calls."""
        if options.get("ordering_key") is not None or options.get("coalesce_key"):
            for name in DEFAULTS:
                value = getattr(self, name, None)
                if value is not None and options.get(name) is None:
                    options[name] = value
        return super().apply_async(*args, **options)


def __getattr__(name: str) -> Any:
    if name == "OrderedTask":
        deprecated(
            f"{__name__}.OrderedTask",
            "celery_outbox.task.OutboxTask",
            note="It is the app's task class, composed of the inbox and ordering parts.",
        )
        from ..task import OutboxTask

        return OutboxTask
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
