"""Key columns that compare byte for byte: a migration operation for MySQL/MariaDB.

MySQL and MariaDB compare text with the column's collation, by default blind to
case, accents and trailing spaces: ``doc:A`` and ``doc:a``, ``é`` and ``e``, ``k1``
and ``k1 `` would be one key. :class:`ExactKeys` gives a model's key columns the
binary collation of their character set that keeps trailing spaces (``NO PAD``), so
a key means exactly what the caller wrote, as on PostgreSQL and SQLite, whose
default comparisons are exact already.

The model state is left as it is (no ``db_collation`` on the fields): the models
stay the same on every database, and only MySQL/MariaDB's columns change. A later
migration that alters one of these columns (``AlterField``) writes the column
again without the collation on MySQL/MariaDB, so it must run ``ExactKeys`` on that
column again after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db.migrations.operations.base import Operation


def binary_collation(connection: Any, table: str, column: str) -> tuple[str, str]:
    """The column's collation now, and the exact one of its character set.

    The exact one is the first the server has of ``<charset>_nopad_bin`` (MariaDB),
    ``<charset>_0900_bin`` (MySQL 8.0.17 and later), ``<charset>_bin``: the first two
    keep trailing spaces, the last (older MySQL only) compares exactly otherwise.
    """
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CHARACTER_SET_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s AND COLUMN_NAME = %s",
            [table, column],
        )
        charset, current = cursor.fetchone()
        wanted = [f"{charset}_nopad_bin", f"{charset}_0900_bin", f"{charset}_bin"]
        cursor.execute(
            "SELECT COLLATION_NAME FROM information_schema.COLLATIONS "
            "WHERE COLLATION_NAME IN (%s, %s, %s)",
            wanted,
        )
        known = {row[0] for row in cursor.fetchall()}
    return str(current), next(name for name in wanted if name in known)


class ExactKeys(Operation):
    """Compare the text columns ``fields`` of ``model_name`` byte for byte.

    On MySQL/MariaDB each column gets its character set's exact binary collation
    (see :func:`binary_collation`) through the schema editor's ``alter_field``,
    which keeps its type, nullability, indexes and unique constraints; backwards,
    the table's default collation again. PostgreSQL and SQLite are left alone, and
    so are databases the routers keep the model off.
    """

    reversible = True
    reduces_to_sql = False

    def __init__(self, model_name: str, fields: Sequence[str]) -> None:
        self.model_name = model_name
        self.fields = tuple(fields)

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (
            self.__class__.__qualname__,
            [],
            {"model_name": self.model_name, "fields": list(self.fields)},
        )

    def state_forwards(self, app_label: str, state: Any) -> None:
        """Nothing: the models do not name a vendor's collation."""

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._alter(app_label, schema_editor, to_state, exact=True)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._alter(app_label, schema_editor, to_state, exact=False)

    def describe(self) -> str:
        return (
            f"Compare {', '.join(self.fields)} of {self.model_name} byte for byte "
            f"(MySQL/MariaDB)"
        )

    @property
    def migration_name_fragment(self) -> str:
        return f"exact_{self.model_name.lower()}"

    def _alter(
        self, app_label: str, schema_editor: Any, state: Any, *, exact: bool
    ) -> None:
        connection = schema_editor.connection
        if connection.vendor != "mysql":
            return
        model = state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(connection.alias, model):
            return
        table = model._meta.db_table
        for name in self.fields:
            field = model._meta.get_field(name)
            current, binary = binary_collation(connection, table, field.column)
            if exact and current != binary:
                schema_editor.alter_field(model, field, _collated(field, binary))
            elif not exact and current == binary:
                schema_editor.alter_field(model, _collated(field, binary), field)


def _collated(field: Any, collation: str) -> Any:
    """A copy of ``field`` with ``db_collation``, for the schema editor only."""
    copy = field.clone()
    copy.db_collation = collation
    copy.set_attributes_from_name(field.name)
    copy.model = field.model
    return copy
