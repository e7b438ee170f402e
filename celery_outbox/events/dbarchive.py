"""A service's archive when the database holds its retries: the outbox's dead letters
routed to the service's queues. Same answers as :mod:`.archive` gives for RabbitMQ's
archive queue; ``outbox tasks replay`` and ``outbox tasks purge`` reach the same rows."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

from ..store import DeadLetterFilter, EventStore, outbox_stores
from ..store.events import DeadEvent
from .archive import ArchivedEvent, ReplayResult
from .held import ERROR_HEADER, RETRIES_HEADER
from .registry import EVENT_HEADER
from .topology import ServiceTopology


def _rows() -> EventStore:
    return outbox_stores().events()


def _prefix(topology: ServiceTopology) -> str:
    return f"{topology.prefix}:"


def count(topology: ServiceTopology) -> int:
    """Archived events of the service."""
    return _rows().count_dead_events(_prefix(topology))


def waiting(topology: ServiceTopology) -> int:
    """Retries of the service waiting in the outbox (due later, or being published)."""
    return _rows().waiting_retries(_prefix(topology))


def list_archive(topology: ServiceTopology, limit: int = 100) -> list[ArchivedEvent]:
    """Up to ``limit`` archived events, oldest first."""
    return [_describe(row) for row in _rows().dead_events(_prefix(topology), limit)]


def replay(
    topology: ServiceTopology,
    *,
    event: str | None = None,
    ids: Sequence[str] = (),
    on_progress: Callable[[int, int], None] = lambda done, total: None,
) -> ReplayResult:
    """Put selected archived events back into the outbox, due now, each for its
    subscriber's queue (their retry count starts again at 0)."""
    wanted = set(ids)
    rows = _rows().dead_events(_prefix(topology))
    chosen = [
        row
        for row in rows
        if (not wanted or row.task_id in wanted)
        and (event is None or fnmatch.fnmatchcase(_event(row), event))
    ]
    matched = frozenset(row.task_id for row in chosen)
    if not chosen:
        return ReplayResult(0, len(rows), 0, matched)
    report = (
        outbox_stores()
        .operator()
        .replay_dead_letters(
            DeadLetterFilter(ids=tuple(row.row_id for row in chosen)),
            progress=lambda done, total: on_progress(done, total),
        )
    )
    return ReplayResult(report.replayed, len(rows) - report.replayed, 0, matched)


def purge(topology: ServiceTopology) -> int:
    """Delete every archived event of the service; returns how many there were."""
    rows = _rows().dead_events(_prefix(topology))
    operator = outbox_stores().operator()
    return len(operator.delete_dead_letters([row.row_id for row in rows]))


def _event(row: DeadEvent) -> str:
    return str(row.headers.get(EVENT_HEADER, ""))


def _describe(row: DeadEvent) -> ArchivedEvent:
    return ArchivedEvent(
        id=row.task_id,
        event=_event(row),
        queue=row.routing_key,
        retries=int(row.headers.get(RETRIES_HEADER) or 0),
        error=str(row.headers.get(ERROR_HEADER, row.last_error)),
        failed_at=row.dead_at.isoformat(),
    )
