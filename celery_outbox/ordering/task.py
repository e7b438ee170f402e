"""``OrderingMixin``: per-task ordering defaults, the ordering part of the task class.

``@app.task(ordering="strict", ordering_policy="skip", coalesce=True)`` sets the
defaults of that task's calls that carry an ``ordering_key`` (or ``coalesce_key``);
a call's own option wins. :class:`celery_outbox.task.OutboxTask` composes this part
with the inbox's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore

from ..engine.endings import Replaced, watched_headers
from ..ordering_options import is_strict

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

    def on_replace(self, sig: Any) -> Any:
        """Celery's ``on_replace``; a strict head's replacement reports in its stead.

        Celery gives the replacement the replaced task's id; it also gets the
        head's ordering header, so that its own ending settles the head: the key
        stays held until the work the head handed on is done. The head itself
        ends with :class:`~.endings.Replaced` (an ``Ignore``).
        """
        headers = watched_headers(self.request)
        if (
            headers is None
            or not is_strict(headers)
            or not _carry(sig, str(self.request.id), headers)
        ):
            return super().on_replace(sig)
        try:
            return super().on_replace(sig)
        except Ignore as ignored:
            raise Replaced(str(ignored)) from None


def _carry(sig: Any, task_id: str, headers: Mapping[str, Any]) -> bool:
    """Put ``headers`` on the step of ``sig`` that takes ``task_id``; False if none does."""
    step = _step_taking(sig, task_id)
    if step is None:
        return False
    step.options["headers"] = {**(step.options.get("headers") or {}), **headers}
    return True


def _step_taking(sig: Any, task_id: str) -> Any:
    """The signature in ``sig`` that Celery's ``replace`` gave ``task_id``, or None.

    A signature takes it itself; a chord (what Celery makes of a group) gives it to
    its body; a chain to one of its steps (the replaced task's own chain comes
    after it).
    """
    body = getattr(sig, "body", None)
    if body is not None:
        return _step_taking(body, task_id)
    steps = getattr(sig, "tasks", None)
    if steps is not None:
        for step in steps:
            found = _step_taking(step, task_id)
            if found is not None:
                return found
        return None
    return sig if sig.options.get("task_id") == task_id else None
