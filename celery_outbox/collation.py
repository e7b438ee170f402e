"""Key columns that compare byte for byte: a migration operation for MySQL/MariaDB.

MySQL and MariaDB compare text with the column's collation, by default blind to
case, accents and trailing spaces: ``doc:A`` and ``doc:a``, ``é`` and ``e``, ``k1``
and ``k1 `` would be one key. :class:`ExactKeys` gives a model's key columns the
binary collation of their character set that keeps trailing spaces (``NO PAD``), so
a key means exactly what the caller wrote, as on PostgreSQL and SQLite, whose
default comparisons are exact already.

The rule is the schema's, not each migration's: every text column of the
package's tables is exact on MySQL/MariaDB unless :data:`FREE_TEXT` names it, with
the reason no query compares it (``tests/integration/test_exact_keys.py`` reads
the migrated schema and fails on any other column). A migration that adds a text
column runs ``ExactKeys`` on it, or adds it to :data:`FREE_TEXT`.

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

#: Text no query groups by or matches against a key (it is read back whole, shown
#: or sent on), so a collation that folds it changes no result: ``(table, columns,
#: why)``. Every other text column of the package's tables is a key.
FREE_TEXT: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "celery_outbox_message",
        (
            "content_type",
            "content_encoding",
            "properties",
            "declare_queues",
            "arguments_preview",
            "log_context",
            "last_error",
        ),
        "the broker message and its bookkeeping, read whole and sent or shown",
    ),
    (
        "celery_outbox_message",
        ("headers",),
        "JSON sent to the broker; searched only among one task id's rows, for the "
        "package's strict-row token (row=<uuid hex>), which no collation folds",
    ),
    (
        "celery_outbox_deadletter",
        (
            "content_type",
            "content_encoding",
            "headers",
            "properties",
            "declare_queues",
            "arguments_preview",
            "log_context",
            "last_error",
        ),
        "the broker message kept for a replay, read whole and sent or shown",
    ),
    ("celery_outbox_history", ("error", "process"), "a reason and host:pid, shown"),
    ("celery_outbox_relay", ("name",), "host:pid of a relay, shown"),
    ("celery_outbox_flow", ("rates", "limits"), "an operator's settings, parsed"),
    ("celery_outbox_handler_message", ("payload",), "JSON, given to the receiver"),
    ("celery_outbox_handler_shard", ("last_error",), "a receiver's error, shown"),
    (
        "celery_outbox_handler_deadletter",
        ("payload", "last_error"),
        "JSON and a receiver's error, kept for a replay",
    ),
    ("celery_outbox_handler_pause", ("reason",), "an operator's note, shown"),
    ("celery_outbox_handler_processor", ("name",), "host:pid of a processor, shown"),
)


def exact_collation(connection: Any, charset: str) -> str:
    """The exact collation of ``charset`` on this MySQL/MariaDB server.

    The first the server has of ``<charset>_nopad_bin`` (MariaDB),
    ``<charset>_0900_bin`` (MySQL 8.0.17 and later), ``<charset>_bin``: the first two
    keep trailing spaces, the last (older MySQL only) compares exactly otherwise.
    """
    wanted = [f"{charset}_nopad_bin", f"{charset}_0900_bin", f"{charset}_bin"]
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT COLLATION_NAME FROM information_schema.COLLATIONS "
            "WHERE COLLATION_NAME IN (%s, %s, %s)",
            wanted,
        )
        known = {row[0] for row in cursor.fetchall()}
    return next(name for name in wanted if name in known)


def binary_collation(connection: Any, table: str, column: str) -> tuple[str, str]:
    """The column's collation now, and the exact one of its character set."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CHARACTER_SET_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s AND COLUMN_NAME = %s",
            [table, column],
        )
        charset, current = cursor.fetchone()
    return str(current), exact_collation(connection, str(charset))


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
