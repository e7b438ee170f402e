"""Django's PostgreSQL backend with the test project's flush (``tests.project.backends``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.backends.postgresql import base, operations

from .. import KEPT, KeepingFlush


class DatabaseOperations(KeepingFlush, operations.DatabaseOperations):
    def sql_flush(
        self,
        style: Any,
        tables: Sequence[str],
        *,
        reset_sequences: bool = False,
        allow_cascade: bool = False,
    ) -> list[str]:
        if reset_sequences or allow_cascade:
            return super().sql_flush(
                style,
                tables,
                reset_sequences=reset_sequences,
                allow_cascade=allow_cascade,
            )
        # DELETE rather than TRUNCATE: see tests.project.backends.
        return [
            f"DELETE FROM {self.quote_name(table)};"
            for table in tables
            if table not in KEPT
        ]


class DatabaseWrapper(base.DatabaseWrapper):
    ops_class = DatabaseOperations
