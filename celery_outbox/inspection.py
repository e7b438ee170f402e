"""What ``outbox tasks inspect TASK_ID`` does, apart from parsing: where a message is now.

The store answers with a :class:`~celery_outbox.store.history.MessageTrace` (rows,
dead letters, history); :func:`message_state` decides the state from it and the
renderers format it. An unknown task id raises
:class:`~django.core.management.base.CommandError` (exit status 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from django.core.management.base import CommandError

from .states import DEAD, PUBLISHED, REVOKED, SCHEDULED
from .store.history import HistoryEntry, MessageTrace

FORMATS = ("text", "json")


@dataclass(frozen=True)
class InspectRequest:
    """``outbox tasks inspect`` options: the task id and the output format."""

    task_id: str
    format: str = "text"

    @classmethod
    def parse(cls, *, task_id: str, format: str) -> InspectRequest:
        """Check the command-line values; raises CommandError naming the bad one."""
        if not task_id.strip():
            raise CommandError("inspect: give a task id")
        if format not in FORMATS:
            raise CommandError(f"inspect: --format is one of {', '.join(FORMATS)}")
        return cls(task_id.strip(), format)


def message_state(trace: MessageTrace) -> str | None:
    """The message's state: its newest outbox row's, else dead, published or revoked
    (whichever happened last); None: unknown."""
    if trace.rows:
        return trace.rows[-1].state
    ends = [(d.dead_at, DEAD) for d in trace.dead]
    ends += [(e.at, e.event) for e in trace.events if e.event in (PUBLISHED, REVOKED)]
    if not ends:
        return None
    return max(ends, key=lambda end: end[0])[1]


def enqueued_at(trace: MessageTrace) -> datetime | None:
    """The earliest enqueue any record of the task remembers."""
    moments = [
        *(row.created_at for row in trace.rows),
        *(dead.created_at for dead in trace.dead),
        *(event.enqueued_at for event in trace.events),
    ]
    return min(moments, default=None)


def inspect_message(trace: MessageTrace, request: InspectRequest) -> str:
    """The report of one task id in the requested format; raises for an unknown id."""
    state = message_state(trace)
    if state is None:
        hint = (
            ""
            if trace.history
            else "; CELERY_OUTBOX_HISTORY is off, so a published message leaves no "
            "trace (turn it on to keep one)"
        )
        raise CommandError(
            f"inspect: no message with task id {trace.task_id!r} in the outbox, the "
            f"dead letters or the history{hint}"
        )
    if request.format == "json":
        return json.dumps(_as_dict(trace, state), default=_iso)
    return _text(trace, state)


# -- text --------------------------------------------------------------------------


def _field(label: str, value: object) -> str:
    """One ``label  value`` line, the values aligned."""
    return f"{label:<12} {value}"


def _text(trace: MessageTrace, state: str) -> str:
    names = [r.task_name for r in trace.rows] + [d.task_name for d in trace.dead]
    lines = [
        _field("task id", trace.task_id),
        _field("task", names[-1] if names else _event_task(trace)),
        _field("state", state),
        _field("enqueued", _moment(enqueued_at(trace))),
        *_where(trace, state),
        "",
    ]
    if trace.events:
        lines.append("history:")
        lines += [_event_line(event) for event in trace.events]
    elif trace.history:
        lines.append("history: no event yet (written when a relay settles the row)")
    else:
        lines.append(
            "history: off (set CELERY_OUTBOX_HISTORY = True to keep each message's)"
        )
    return "\n".join(lines)


def _where(trace: MessageTrace, state: str) -> list[str]:
    """The lines that say where the message is, for its state."""
    if trace.rows:
        row = trace.rows[-1]
        lines = [_field("outbox row", row.id), _field("attempts", row.attempts)]
        if state == "in_flight":
            holder = (
                f"relay {row.holder_name or '(heartbeat gone)'} ({row.holder})"
                if row.holder
                else "a process without a heartbeat (publish-on-commit, a command)"
            )
            lines += [
                _field("leased to", holder),
                _field("lease ends", _moment(row.available_at)),
            ]
        elif state == "due":
            lines.append(_field("due since", _moment(row.available_at)))
        elif state == SCHEDULED:
            lines.append(_field("due at", f"{_moment(row.due_at)} (its ETA)"))
        elif state in ("retrying", "deferred"):
            lines.append(_field("next try", _moment(row.available_at)))
        elif state == "running":
            until = f"{_moment(row.available_at)} (strict ordering)"
            lines.append(_field("runs until", until))
        if row.last_error:
            lines.append(_field("last error", row.last_error))
        return lines
    if state == DEAD:
        dead = max(trace.dead, key=lambda d: d.dead_at)
        return [
            _field(
                "dead letter",
                f"{dead.id} (replay: manage.py outbox tasks replay {dead.id})",
            ),
            _field("dead at", _moment(dead.dead_at)),
            _field("attempts", dead.attempts),
            _field("reason", dead.last_error),
        ]
    if state == REVOKED:
        revoked = _last(trace, REVOKED)
        assert revoked is not None  # message_state said so
        return [
            _field("revoked", f"{_moment(revoked.at)}, before it was published"),
            _field("by", _relay(revoked)),
        ]
    published = _last(trace, PUBLISHED)
    assert published is not None  # message_state said so
    return [
        _field("published", _moment(published.at)),
        _field("by", _relay(published)),
        _field("attempts", published.attempt),
    ]


def _event_line(event: HistoryEntry) -> str:
    line = f"  {_moment(event.at)}  {event.event:<9} attempt {event.attempt}"
    if event.process or event.relay_id:
        line += f"  by {_relay(event)}"
    if event.error:
        reason = "last reason" if event.event == "replayed" else "reason"
        line += f"  {reason}: {event.error}"
    return line


def _relay(event: HistoryEntry) -> str:
    """Who wrote an event: a relay (its ``host:pid`` and id), or another process."""
    if event.relay_id:
        return f"relay {event.process} ({event.relay_id})"
    if event.event == PUBLISHED:
        return f"{event.process or '?'} (no relay heartbeat: publish-on-commit)"
    return event.process or "?"


def _event_task(trace: MessageTrace) -> str:
    return trace.events[-1].task_name if trace.events else "?"


def _last(trace: MessageTrace, event: str) -> HistoryEntry | None:
    found = [e for e in trace.events if e.event == event]
    return found[-1] if found else None


def _moment(moment: datetime | None) -> str:
    """A UTC time to the millisecond; the outbox writes naive times in UTC."""
    if moment is None:
        return "-"
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    text: str = moment.strftime("%Y-%m-%d %H:%M:%S.%f")
    return text[:-3] + " UTC"


# -- json --------------------------------------------------------------------------


def _iso(moment: Any) -> str:
    """A time as ISO 8601 (naive times are UTC, as the outbox writes them)."""
    if not isinstance(moment, datetime):
        raise TypeError(f"not JSON serializable: {type(moment).__name__}")
    when: datetime = moment
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc).isoformat()


def _as_dict(trace: MessageTrace, state: str) -> dict[str, Any]:
    return {
        "task_id": trace.task_id,
        "state": state,
        "enqueued_at": enqueued_at(trace),
        "outbox": [
            {
                "id": r.id,
                "task_name": r.task_name,
                "state": r.state,
                "attempts": r.attempts,
                "last_error": r.last_error,
                "created_at": r.created_at,
                "available_at": r.available_at,
                "holder": r.holder,
                "holder_name": r.holder_name or None,
                "due_at": r.due_at,
            }
            for r in trace.rows
        ],
        "dead": [
            {
                "id": d.id,
                "task_name": d.task_name,
                "attempts": d.attempts,
                "last_error": d.last_error,
                "created_at": d.created_at,
                "dead_at": d.dead_at,
            }
            for d in trace.dead
        ],
        "history_on": trace.history,
        "history": [
            {
                "event": e.event,
                "at": e.at,
                "enqueued_at": e.enqueued_at,
                "attempt": e.attempt,
                "error": e.error,
                "relay_id": e.relay_id,
                "process": e.process,
            }
            for e in trace.events
        ],
    }
