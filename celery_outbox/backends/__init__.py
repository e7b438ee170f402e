"""Database engines that write a transaction's outbox rows in its ``COMMIT``'s round trip.

``DATABASES["default"]["ENGINE"] = "celery_outbox.backends.postgresql"`` is Django's
PostgreSQL backend plus :class:`WriteOnCommitMixin`; a project with an engine of its
own (PostGIS, a metrics wrapper) mixes the class into that engine's ``DatabaseWrapper``.
"""

from __future__ import annotations

from ..store.commit import WriteOnCommitMixin

__all__ = ["WriteOnCommitMixin"]
