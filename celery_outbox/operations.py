"""What ``outbox tasks stats``, ``replay`` and ``purge`` do, apart from parsing.

Each request object turns command-line text into checked values (raising
:class:`~django.core.management.base.CommandError` naming the bad argument); the
functions call the store and format its answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.core.management.base import CommandError, OutputWrapper

from .durations import parse_moment
from .progress import ProgressBar
from .store import DeadLetterFilter, OperatorStore, Summary, TopFailures

#: Replays larger than this many dead letters (or than one chunk) draw a progress
#: bar on stderr, when tqdm (the ``progress`` extra) is installed.
PROGRESS_THRESHOLD = 1000


# -- stats ---------------------------------------------------------------------


@dataclass(frozen=True)
class StatsRequest:
    """``outbox tasks stats`` options: output format, top-N failures, refresh interval."""

    format: str = "text"
    top: int | None = None
    interval: float | None = None
    #: Stop after this many refreshes (tests); None refreshes until Ctrl-C.
    iterations: int | None = None


def render_stats(store: OperatorStore, request: StatsRequest) -> str:
    """One snapshot of the outbox in the requested format."""
    summary = store.summary()
    failures = store.top_failures(request.top) if request.top else None
    if request.format == "json":
        return json.dumps(_stats_dict(summary, failures))
    if request.format == "prometheus":
        return _prometheus(summary, failures)
    return _text(summary, failures)


def watch(
    store: OperatorStore,
    request: StatsRequest,
    write: Callable[[str], Any],
    sleep: Callable[[float], Any] = time.sleep,
) -> None:
    """Write a snapshot; with an interval, again every ``interval`` seconds until Ctrl-C."""
    done = 0
    try:
        while True:
            write(render_stats(store, request))
            done += 1
            if request.interval is None or (
                request.iterations is not None and done >= request.iterations
            ):
                return
            sleep(request.interval)
    except KeyboardInterrupt:
        return


def _stats_dict(summary: Summary, failures: TopFailures | None) -> dict[str, Any]:
    result: dict[str, Any] = {
        "pending": summary.pending,
        "due": summary.due,
        "in_flight": summary.in_flight,
        "dead": summary.dead,
        "oldest_pending_seconds": summary.oldest_pending_seconds,
        "retrying": summary.retrying,
        "scheduled": summary.scheduled,
        "next_due_seconds": summary.next_due_seconds,
        "parked": dict(summary.parked),
        "backlog": [
            {
                "task_name": group.task_name,
                "queue": group.queue,
                "pending": group.pending,
                "due": group.due,
                "oldest_seconds": group.oldest_seconds,
            }
            for group in summary.backlog
        ],
    }
    if failures is not None:
        result["top_failures"] = {
            "retrying": [
                {
                    "task_name": task.task_name,
                    "rows": task.rows,
                    "attempts": task.attempts,
                    "max_attempts": task.max_attempts,
                }
                for task in failures.retrying
            ],
            "dead": [
                {"task_name": task.task_name, "dead": task.dead}
                for task in failures.dead
            ],
        }
    return result


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _text(summary: Summary, failures: TopFailures | None) -> str:
    lines = [
        f"pending   {summary.pending}",
        f"due       {summary.due}",
        f"retrying  {summary.retrying}",
        f"in_flight {summary.in_flight}",
        f"scheduled {summary.scheduled}"
        + (
            f" (next due in {_seconds(summary.next_due_seconds)})"
            if summary.next_due_seconds is not None
            else ""
        ),
        f"dead      {summary.dead}",
        f"oldest    {_seconds(summary.oldest_pending_seconds)}",
    ]
    if summary.parked:
        by_flow = ", ".join(f"{name or '?'} {n}" for name, n in summary.parked)
        total = sum(n for _, n in summary.parked)
        lines.insert(5, f"parked    {total} ({by_flow})")
    if summary.backlog:
        lines += ["", "backlog by task and queue (pending, due, oldest):"]
        lines += [
            f"  {g.task_name} [{g.queue or '-'}]  {g.pending}  {g.due}  "
            f"{_seconds(g.oldest_seconds)}"
            for g in summary.backlog
        ]
    if failures is not None:
        lines += ["", "failing in the outbox (rows, attempts, most attempts):"]
        lines += [
            f"  {t.task_name}  {t.rows}  {t.attempts}  {t.max_attempts}"
            for t in failures.retrying
        ] or ["  none"]
        lines += ["dead letters by task:"]
        lines += [f"  {t.task_name}  {t.dead}" for t in failures.dead] or ["  none"]
    return "\n".join(lines)


def _label(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def _prometheus(summary: Summary, failures: TopFailures | None) -> str:
    lines: list[str] = []

    def gauge(name: str, help_text: str, samples: Sequence[tuple[str, Any]]) -> None:
        lines.append(f"# HELP celery_outbox_{name} {help_text}")
        lines.append(f"# TYPE celery_outbox_{name} gauge")
        for labels, value in samples:
            shown = "NaN" if value is None else value
            lines.append(f"celery_outbox_{name}{labels} {shown}")

    gauge("pending", "Rows waiting in the outbox.", [("", summary.pending)])
    gauge("due", "Rows a relay may claim now.", [("", summary.due)])
    gauge(
        "retrying",
        "Refused rows waiting for their next attempt.",
        [("", summary.retrying)],
    )
    gauge("in_flight", "Rows leased to a relay.", [("", summary.in_flight)])
    gauge(
        "scheduled",
        "Rows held until their ETA (not late).",
        [("", summary.scheduled)],
    )
    gauge(
        "next_due_seconds",
        "Seconds until the first scheduled row is due.",
        [("", summary.next_due_seconds)],
    )
    gauge("dead", "Dead letters.", [("", summary.dead)])
    gauge(
        "oldest_pending_seconds",
        "Age of the oldest waiting row (scheduled rows from their ETA).",
        [("", summary.oldest_pending_seconds)],
    )
    gauge(
        "backlog",
        "Waiting rows by task name and queue (largest groups).",
        [
            (f"{{task_name={_label(g.task_name)},queue={_label(g.queue)}}}", g.pending)
            for g in summary.backlog
        ],
    )
    if failures is not None:
        gauge(
            "retrying_by_task",
            "Refused rows still in the outbox, by task name (top N).",
            [
                (f"{{task_name={_label(t.task_name)}}}", t.rows)
                for t in failures.retrying
            ],
        )
        gauge(
            "dead_by_task",
            "Dead letters by task name (top N).",
            [(f"{{task_name={_label(t.task_name)}}}", t.dead) for t in failures.dead],
        )
    return "\n".join(lines)


# -- replay ----------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayRequest:
    """Which dead letters ``outbox tasks replay`` puts back, and how."""

    selection: DeadLetterFilter
    dry_run: bool = False
    chunk_size: int = 500

    @classmethod
    def parse(
        cls,
        *,
        ids: Sequence[str],
        task: str | None,
        since: str | None,
        until: str | None,
        everything: bool,
        dry_run: bool,
        chunk_size: int,
        now: datetime | None = None,
    ) -> ReplayRequest:
        """Check the command-line values; raises CommandError naming the bad one."""
        numbers: list[int] = []
        for text in ids:
            if not (text.isascii() and text.isdigit()) or int(text) <= 0:
                raise CommandError(
                    f"replay: dead-letter ids are positive integers, got {text!r}"
                )
            numbers.append(int(text))
        if task is not None and not task.strip():
            raise CommandError("replay: --name needs a task name or glob")
        start = _moment("--since", since, now)
        end = _moment("--until", until, now)
        if start is not None and end is not None and start >= end:
            raise CommandError(
                f"replay: --since ({start.isoformat()}) must be before --until "
                f"({end.isoformat()})"
            )
        selection = DeadLetterFilter(tuple(numbers) or None, task, start, end)
        if selection.is_empty and not everything:
            raise CommandError(
                "replay: say which dead letters to replay: ids, --name GLOB, "
                "--since/--until, or --all for every one"
            )
        if everything and not selection.is_empty:
            raise CommandError("replay: --all cannot be combined with ids or filters")
        return cls(selection, dry_run, chunk_size)


def _moment(flag: str, text: str | None, now: datetime | None) -> datetime | None:
    if text is None:
        return None
    try:
        return parse_moment(text, now)
    except ValueError as exc:
        raise CommandError(f"{flag}: {exc}") from None


def replay(store: OperatorStore, request: ReplayRequest, stderr: OutputWrapper) -> str:
    """Run a replay (drawing a progress bar on ``stderr`` when large); returns a summary."""
    bar = ProgressBar(
        stderr,
        "replaying",
        unit=" dead letters",
        threshold=min(PROGRESS_THRESHOLD, request.chunk_size),
    )
    try:
        report = store.replay_dead_letters(
            request.selection,
            dry_run=request.dry_run,
            chunk_size=request.chunk_size,
            progress=bar.update,
        )
    finally:
        bar.close()
    breakdown = _breakdown(report.by_task)
    if report.dry_run:
        summary = f"would replay {report.matched} dead letter(s){breakdown} (dry run)"
    elif not report.matched:
        summary = "no dead letter matched; nothing replayed"
    else:
        summary = (
            f"replayed {report.replayed} dead letter(s) into the outbox{breakdown}"
        )
    asked = request.selection.ids
    if asked and report.matched < len(set(asked)):
        # The ids that did match were replayed; a script must still hear of the rest.
        missing = len(set(asked)) - report.matched
        raise CommandError(
            f"{summary}; {missing} of the {len(set(asked))} id(s) given match no dead "
            f"letter (already replayed or purged?). Check the ids in the admin or with "
            f"'outbox tasks stats --top N'."
        )
    return summary


def _breakdown(by_task: Mapping[str, int]) -> str:
    if not by_task:
        return ""
    return ": " + ", ".join(f"{name} {count}" for name, count in by_task.items())


# -- purge -----------------------------------------------------------------------


@dataclass(frozen=True)
class PurgeRequest:
    """Which dead letters ``outbox tasks purge`` deletes."""

    older_than: float
    task: str | None = None
    dry_run: bool = False
    chunk_size: int = 1000


def purge(store: OperatorStore, request: PurgeRequest) -> str:
    """Run a purge; returns a one-line summary."""
    report = store.purge_dead_letters(
        request.older_than,
        task=request.task,
        dry_run=request.dry_run,
        chunk_size=request.chunk_size,
    )
    scope = f" of {request.task}" if request.task else ""
    age = (
        f"older than {_duration_text(request.older_than)}"
        if request.older_than
        else "of any age"
    )
    if report.dry_run:
        return f"would delete {report.matched} dead letter(s){scope} {age} (dry run)"
    return f"deleted {report.deleted} dead letter(s){scope} {age}"


def _duration_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"
