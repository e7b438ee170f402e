"""Revoke before publish: ``revoke()`` of a task still in the outbox deletes its row.

``AsyncResult.revoke()``, ``GroupResult.revoke()`` and ``app.control.revoke()`` all
end in :meth:`celery.app.control.Control.revoke`; :class:`OutboxControl` is the
app's control class (``OutboxCelery.control_cls``). It deletes the rows of the
revoked tasks on the outbox alias, in the caller's transaction when there is one,
then broadcasts the revoke to the workers exactly as Celery does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery.app.control import Control

from .conf import get_settings
from .enqueue import require_installed
from .store import outbox_stores

logger = logging.getLogger("celery_outbox")


class OutboxControl(Control):
    """Celery's remote control, with a revoke that first takes the task out of the outbox."""

    def revoke(self, task_id: str | Sequence[str], *args: Any, **kwargs: Any) -> Any:
        """Delete the task's outbox rows, then broadcast Celery's revoke (same arguments)."""
        ids = [task_id] if isinstance(task_id, str) else list(task_id)
        withdraw(ids)
        return super().revoke(task_id, *args, **kwargs)


def withdraw(task_ids: Sequence[str]) -> list[str]:
    """Delete the outbox rows of ``task_ids`` that no relay holds; the ids deleted."""
    require_installed()
    deleted = outbox_stores(get_settings()).operator().revoke(task_ids)
    if deleted:
        logger.info(
            "revoked before publish (outbox rows deleted): %s", ", ".join(deleted)
        )
    return deleted
