"""celery-outbox: a transactional outbox for Celery in Django.

``OutboxCelery`` writes every task into an outbox table inside the caller's
transaction; ``manage.py outbox relay`` publishes committed rows to the broker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["OutboxCelery", "__version__"]
__version__ = "0.2.0"

if TYPE_CHECKING:
    from .app import OutboxCelery


def __getattr__(name: str) -> Any:
    # Imported lazily so that ``import celery_outbox`` never needs Django settings.
    if name == "OutboxCelery":
        from .app import OutboxCelery

        return OutboxCelery
    raise AttributeError(name)
