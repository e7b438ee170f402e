"""The app's task class: the inbox's, plus per-task ordering defaults.

``@app.task(ordering="strict", ordering_policy="skip", coalesce=True)`` sets the
defaults of that task's calls that carry an ``ordering_key`` (or ``coalesce_key``);
a call's own option wins.
"""

from __future__ import annotations

from typing import Any

from ..inbox.task import InboxTask

#: Task attributes that become call options when the call has a key.
DEFAULTS = ("ordering", "ordering_policy", "coalesce")


class OrderedTask(InboxTask):
    """A Django task with the opt-in inbox and per-task ordering defaults."""

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
