"""The pure decisions of the handler processor: values in, values out, no I/O.

* :func:`coalesce`: which rows of a shard run, and which a newer row supersedes;
* :func:`backoff`: how long a failing head waits before its next run;
* :func:`after_failure`: retry the head later, or move it to the dead letters.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

#: Widest shard key, category and object id (characters; fits a utf8mb4 unique index).
KEY_LENGTH = 255


@dataclass(frozen=True)
class Row:
    """One stored message as the processor reads it."""

    id: int
    category: str
    object_id: str
    payload: str
    created_at: datetime
    #: Seconds since the message was written, by the database's clock at the read.
    age_seconds: float | None = None


@dataclass(frozen=True)
class Plan:
    """What to do with a window of a shard's rows (in id order)."""

    #: Rows to run, in id order.
    run: tuple[Row, ...]
    #: Ids of rows a newer row of the same (category, object id) replaces.
    superseded: tuple[int, ...]
    #: Superseded rows per category (for the counters).
    coalesced: dict[str, int]


def coalesce(rows: Sequence[Row], coalesces: Callable[[str], bool]) -> Plan:
    """Keep the newest row of each (category, object id) whose category coalesces.

    Kept rows keep their place: a row runs where its newest version was written, so
    the order of the last writes across categories is preserved. ``rows`` must be in
    id order; a category that opts out runs every row.
    """
    newest: dict[tuple[str, str], int] = {}
    for row in rows:
        if coalesces(row.category):
            newest[(row.category, row.object_id)] = row.id
    run: list[Row] = []
    superseded: list[int] = []
    counts: dict[str, int] = {}
    for row in rows:
        keep = newest.get((row.category, row.object_id), row.id)
        if keep == row.id:
            run.append(row)
        else:
            superseded.append(row.id)
            counts[row.category] = counts.get(row.category, 0) + 1
    return Plan(tuple(run), tuple(superseded), counts)


def backoff(attempts: int, base: float, cap: float) -> float:
    """Seconds the head waits after its ``attempts``-th failure: base, doubling, capped."""
    if attempts < 1:
        return 0.0
    # 2**attempts overflows a float after ~1000 failures: stop doubling at the cap.
    delay = base
    for _ in range(attempts - 1):
        delay *= 2
        if delay >= cap:
            return cap
    return min(delay, cap)


class Verdict(str, enum.Enum):
    """What happens to a head whose receiver raised."""

    RETRY = "retry"
    DEAD_LETTER = "dead_letter"


@dataclass(frozen=True)
class FailureDecision:
    """The verdict, the head's failure count, and the wait before the next run."""

    verdict: Verdict
    attempts: int
    delay: float


def after_failure(
    attempts: int, max_attempts: int | None, base: float, cap: float
) -> FailureDecision:
    """The decision after the head's ``attempts``-th failure (``max_attempts`` None: forever)."""
    if max_attempts is not None and attempts >= max_attempts:
        return FailureDecision(Verdict.DEAD_LETTER, attempts, 0.0)
    return FailureDecision(Verdict.RETRY, attempts, backoff(attempts, base, cap))


def shard_key(shard: str | Iterable[Any]) -> str:
    """``"org:42"`` from ``("org", 42)``; a string is used as it is."""
    if isinstance(shard, str):
        key = shard
    else:
        parts = [str(part) for part in shard]
        if not parts:
            raise ValueError("a shard needs at least one part, e.g. ('org', 42)")
        key = ":".join(parts)
    if not key:
        raise ValueError("the shard key is empty")
    return key
