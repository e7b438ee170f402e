"""What a relay run ``--until-empty`` leaves in the outbox: one read, by the database clock.

The exit status of the run comes from here, not from what the run itself saw: rows
an earlier run put back after an outage are as unsent as the rows this run put back.
"""

from __future__ import annotations

from typing import Any

from ..flow_limits import HELD_PREFIX
from ..states import BLOCKED, PARKED, RUNNING
from .dialects import MESSAGE_TABLE, Dialect
from .types import Leftover


def read_leftover(cursor: Any, dialect: Dialect) -> Leftover:
    """Count the rows no relay holds, by what they wait for; the latest reasons."""
    now = dialect.now()
    # Rows a relay may not send now and nothing is wrong with: leased to a relay,
    # before their ETA, or published strict heads waiting for their worker.
    # Every part is TRUE or FALSE, never NULL: a NOT of a NULL would drop the row.
    state = "COALESCE(state, '')"
    waiting = (
        f"lease_token IS NULL AND NOT (due_at IS NOT NULL AND due_at > {now}) "
        f"AND {state} <> '{RUNNING}'"
    )
    held = f"SUBSTR(last_error, 1, {len(HELD_PREFIX)}) = '{HELD_PREFIX}'"
    flow = f"({state} = '{PARKED}' OR {held})"
    behind = (
        f"({state} = '{BLOCKED}' OR (ordering_key IS NOT NULL AND ordering_key IN "
        f"(SELECT h.ordering_key FROM {MESSAGE_TABLE} h WHERE h.ordering_key IS NOT "
        f"NULL AND h.state IN ('{RUNNING}', '{BLOCKED}'))))"
    )
    free = f"{waiting} AND NOT {flow} AND NOT {behind}"
    cursor.execute(
        f"SELECT "
        f"COALESCE(SUM(CASE WHEN {free} AND attempts = 0 THEN 1 ELSE 0 END), 0), "
        f"COALESCE(SUM(CASE WHEN {free} AND attempts > 0 THEN 1 ELSE 0 END), 0), "
        f"COALESCE(SUM(CASE WHEN {waiting} AND {flow} THEN 1 ELSE 0 END), 0), "
        f"COALESCE(SUM(CASE WHEN {waiting} AND NOT {flow} AND {behind} THEN 1 "
        f"ELSE 0 END), 0) FROM {MESSAGE_TABLE}",
        [],
    )
    deferred, retrying, flow_held, key_held = (int(n) for n in cursor.fetchone())
    errors = []
    for attempts in ("attempts = 0", "attempts > 0"):
        cursor.execute(
            f"SELECT last_error FROM {MESSAGE_TABLE} WHERE {free} AND {attempts} "
            f"AND last_error <> '' ORDER BY id DESC LIMIT 1",
            [],
        )
        row = cursor.fetchone()
        errors.append("" if row is None else _text(row[0]))
    return Leftover(deferred, retrying, flow_held, key_held, *errors)


def _text(value: Any) -> str:
    """A text column's value (a binary collation hands it back as bytes)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8")
    return str(value)
