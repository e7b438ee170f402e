"""Django's SQLite backend with the test project's flush (``tests.project.backends``)."""

from __future__ import annotations

from django.db.backends.sqlite3 import base, operations

from .. import KeepingFlush


class DatabaseOperations(KeepingFlush, operations.DatabaseOperations):
    pass


class DatabaseWrapper(base.DatabaseWrapper):
    ops_class = DatabaseOperations
