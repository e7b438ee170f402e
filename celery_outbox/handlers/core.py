"""The pure decisions of the handler processor: values in, values out, no I/O.

* :func:`coalesce`: which rows of a shard run, and which a newer row supersedes;
* :func:`after_failure`: retry the head later (the engine's
  :func:`~celery_outbox.engine.backoff.backoff`), or move it to the dead letters,
  in the one decision vocabulary (:class:`celery_outbox.outcomes.Decision`);
* :func:`left_of`: what a run ``until_empty`` leaves, in words, from what the
  databases hold when it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.backoff import backoff
from ..engine.loop import Left
from ..exceptions import OutboxValueError
from ..outcomes import Action, Decision
from ..store.handlers.types import KEY_LENGTH, HandlerLeftover, Row

__all__ = [
    "KEY_LENGTH",
    "Plan",
    "Row",
    "after_failure",
    "coalesce",
    "left_of",
    "shard_key",
]


@dataclass(frozen=True)
class Plan:
    """What to do with a window of a shard's rows (in id order)."""

    #: Rows to run, in id order.
    run: tuple[Row, ...]
    #: Ids of rows a newer row of the same (category, object id) replaces.
    superseded: tuple[int, ...]
    #: Superseded rows per category (for the counters).
    coalesced: dict[str, int]


def coalesce(
    rows: Sequence[Row],
    coalesces: Callable[[str], bool],
    newest_in_shard: Mapping[tuple[str, str], int] | None = None,
) -> Plan:
    """Keep the newest row of each (category, object id) whose category coalesces.

    Kept rows keep their place: a row runs where its newest version was written, so
    the order of the last writes across categories is preserved. ``rows`` must be in
    id order; a category that opts out runs every row. ``newest_in_shard``: the
    newest id of each key in the whole shard, beyond the rows read, so that a row
    whose newer version waits further on is superseded too.
    """
    newest: dict[tuple[str, str], int] = {}
    for row in rows:
        if coalesces(row.category):
            key = (row.category, row.object_id)
            newest[key] = max(row.id, (newest_in_shard or {}).get(key, row.id))
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


def after_failure(
    message_id: int,
    attempts: int,
    max_attempts: int | None,
    base: float,
    cap: float,
    random: Callable[[], float],
) -> Decision:
    """The decision after the head's ``attempts``-th failure (``max_attempts`` None: forever).

    ``Action.DEAD_LETTER`` once ``max_attempts`` is reached, else ``Action.RETRY``
    after the engine's backoff (capped exponential, jittered by ``random``).
    """
    if max_attempts is not None and attempts >= max_attempts:
        return Decision(message_id, Action.DEAD_LETTER)
    return Decision(message_id, Action.RETRY, backoff(attempts, base, cap, random))


def shard_key(shard: str | Iterable[Any]) -> str:
    """``"org:42"`` from ``("org", 42)``; a string is used as it is.

    :func:`~celery_outbox.handlers.emit` then checks the key as it checks the
    category and the object id (not empty, storable, at most ``KEY_LENGTH``).
    """
    if isinstance(shard, str):
        key = shard
    else:
        parts = [str(part) for part in shard]
        if not parts:
            raise OutboxValueError(
                "Cannot emit a handler message: a shard needs at least one part, "
                "e.g. ('org', 42). Nothing was written."
            )
        key = ":".join(parts)
    if not key:
        raise OutboxValueError(
            "Cannot emit a handler message: the shard key is empty. Nothing was "
            "written."
        )
    return key


def left_of(found: Sequence[HandlerLeftover], failures: Sequence[str] = ()) -> Left:
    """What a processor run ``until_empty`` leaves, from what each database holds.

    Messages of failing shards backing off, and due ones no processor took, are work
    it could have done: unfinished, as a database that did not answer (``failures``).
    Messages only a pause holds are counted apart: nothing it could run is left, and
    the outbox is not empty.
    """
    unfinished = list(failures)
    held = []
    for f in found:
        parts = []
        if f.failing:
            last = (f.failing_error.strip().splitlines() or [""])[-1][:200]
            parts.append(
                f"{f.failing} in {f.failing_shards} shard(s) backing off after their "
                f"receiver failed (failing longest: shard {f.failing_shard!r}: "
                f"{last or 'no error recorded'})"
            )
        if f.waiting:
            parts.append(f"{f.waiting} due and not claimed yet")
        if parts:
            total = f.failing + f.waiting
            unfinished.append(
                f"{total} message(s) on {f.database} not run: " + "; ".join(parts)
            )
        if f.held:
            pauses = [f"shard {s!r}" for s in f.held_by_shards] + [
                f"category {c!r}" for c in f.held_by_categories
            ]
            held.append(
                f"{f.held} message(s) on {f.database} held by a pause "
                f"({', '.join(pauses) or 'lifted since'}; 'outbox handlers resume' "
                f"lifts it)"
            )
    return Left(
        unfinished="; ".join(unfinished) if unfinished else None,
        held="; ".join(held) if held else None,
    )
