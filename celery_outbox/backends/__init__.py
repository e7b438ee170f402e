"""Database engines that write a transaction's outbox rows in its ``COMMIT``'s round trip.

Experimental, PostgreSQL only (psycopg 3 for the single round trip). Turn it on with
``DATABASES["default"]["ENGINE"] = "celery_outbox.backends.postgresql"`` (Django's
PostgreSQL backend plus :class:`WriteOnCommitMixin`); a project with an engine of its
own (PostGIS, a metrics wrapper) mixes the class into that engine's ``DatabaseWrapper``.
"""

from __future__ import annotations

from .writeoncommit import WriteOnCommitMixin

__all__ = ["WriteOnCommitMixin"]
