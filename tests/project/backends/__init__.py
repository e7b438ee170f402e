"""The test project's database backends: Django's own, with a cheaper flush.

Between two transactional tests (``django_db(transaction=True)``) Django empties
every table of every database the test used, then sends ``post_migrate``, whose
receivers write the content types and permissions back, one statement and one
commit at a time. That second half was 96 % of a flush (profiled on SQLite), and a
flush about as long as a short test: these backends keep the two tables the
receivers fill (no test changes them), so the receivers find every row there and
write nothing. On PostgreSQL the tables are emptied with ``DELETE`` rather than one
``TRUNCATE`` of them all, which gives each table and index a new file: they hold a
few rows at that point, and Django's MySQL and SQLite backends delete too. Foreign
keys are deferred on PostgreSQL and the flush is one transaction, so the order of
the statements does not matter. A flush that resets sequences or cascades is left
to Django.

Only the test project uses them (``tests/project/settings.py``); what the package
runs on is Django's backends, and the write-on-commit engine, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Filled by post_migrate receivers (contenttypes, auth) and never changed by a test.
KEPT = frozenset({"django_content_type", "auth_permission"})


class KeepingFlush:
    """``sql_flush`` that leaves :data:`KEPT` alone (mixed into a backend's operations)."""

    def sql_flush(
        self,
        style: Any,
        tables: Sequence[str],
        *,
        reset_sequences: bool = False,
        allow_cascade: bool = False,
    ) -> list[str]:
        emptied = [table for table in tables if table not in KEPT]
        return list(
            super().sql_flush(  # type: ignore[misc]
                style,
                emptied,
                reset_sequences=reset_sequences,
                allow_cascade=allow_cascade,
            )
        )
