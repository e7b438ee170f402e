"""One log line per refused and per dead-lettered message, rate-limited per kind.

A broker that refuses everything (a missing exchange, a permission) turns every row
of every batch into a retry: one line each would bury the log. :class:`LogLimiter`
lets ``limit`` lines of a kind through per ``interval`` seconds and counts the rest;
:class:`FailureLog`, a relay listener, writes them and then one summary line such as
``... and 4,213 more retries in the last 10 s``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from ..envelope import StoredMessage
from ..outcomes import Decision
from .observations import BatchSettled, RelayObservation

logger = logging.getLogger("celery_outbox.relay")

#: Lines of one kind written per window; the rest are counted into a summary.
LOG_LIMIT = 10
#: The window, in seconds.
LOG_INTERVAL = 10.0

RETRY = "retries"
DEAD_LETTER = "dead letters"
BLOCKED = "blocked heads"


@dataclass(frozen=True)
class Suppressed:
    """Lines of ``kind`` held back during a window of ``seconds`` that has ended."""

    kind: str
    count: int
    seconds: float

    def line(self) -> str:
        """``... and 4,213 more retries in the last 10 s``."""
        return f"... and {self.count:,} more {self.kind} in the last {self.seconds:g} s"


@dataclass
class _Window:
    started: float
    written: int = 0
    held_back: int = 0


class LogLimiter:
    """At most ``limit`` lines per ``interval`` seconds for each kind; counts the rest.

    A window opens with the first line of its kind and lasts ``interval`` seconds.
    Pure bookkeeping over the injected ``clock``: it writes nothing itself.
    """

    def __init__(
        self,
        limit: int = LOG_LIMIT,
        interval: float = LOG_INTERVAL,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if limit < 1 or interval <= 0:
            raise ValueError(
                f"a log limit needs limit >= 1 and interval > 0, got {limit}, {interval}"
            )
        self.limit = limit
        self.interval = interval
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._ended: list[Suppressed] = []

    def allow(self, kind: str) -> bool:
        """Whether one more line of ``kind`` may be written now (else it is counted)."""
        now = self._clock()
        window = self._windows.get(kind)
        if window is None or now - window.started >= self.interval:
            if window is not None:
                self._close(kind, window)
            window = self._windows[kind] = _Window(now)
        if window.written < self.limit:
            window.written += 1
            return True
        window.held_back += 1
        return False

    def ended(self) -> list[Suppressed]:
        """The windows over by now that held lines back, oldest first; each told once."""
        now = self._clock()
        for kind, window in list(self._windows.items()):
            if now - window.started >= self.interval:
                self._close(kind, window)
                del self._windows[kind]
        ended, self._ended = self._ended, []
        return ended

    def _close(self, kind: str, window: _Window) -> None:
        if window.held_back:
            self._ended.append(Suppressed(kind, window.held_back, self.interval))


#: Binds a message's enqueue-time log context around the lines about it.
ContextBinder = Callable[[StoredMessage], AbstractContextManager[Any]]


def _no_context(message: StoredMessage) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


class FailureLog:
    """Relay listener: a WARNING per retry, an ERROR per dead letter, rate-limited.

    Each line names the task, its id and the broker's reason; so does the ERROR for
    the head of an ordering key that failed for good and now blocks its key. Lines
    over the limit are counted, and their summary is written once their window has
    ended, on the next event of any kind (the loop emits one at least every poll
    interval). ``context`` binds each message's enqueue-time structlog context
    around its line.
    """

    def __init__(
        self,
        limiter: LogLimiter | None = None,
        *,
        context: ContextBinder = _no_context,
    ) -> None:
        self.limiter = limiter or LogLimiter()
        self.context = context

    def __call__(self, event: RelayObservation) -> None:
        """Write the summaries now due, then the lines of a settled batch."""
        for suppressed in self.limiter.ended():
            level = logging.WARNING if suppressed.kind == RETRY else logging.ERROR
            logger.log(level, "%s", suppressed.line())
        if not isinstance(event, BatchSettled):
            return
        settlement = event.settlement
        if not (settlement.retry or settlement.dead_letter or settlement.block):
            return
        by_id = {m.id: m for m in event.messages}
        for kind, decisions in (
            (RETRY, settlement.retry),
            (DEAD_LETTER, settlement.dead_letter),
            (BLOCKED, settlement.block),
        ):
            for decision in decisions:
                message = by_id.get(decision.message_id)
                if message is not None and self.limiter.allow(kind):
                    with self.context(message):
                        _write(kind, message, decision)


def _write(kind: str, message: StoredMessage, decision: Decision) -> None:
    envelope = message.envelope
    attempt = message.attempts + 1
    if kind == RETRY:
        logger.warning(
            "task %s [%s] refused by the broker (attempt %d), retrying in %.1f s: %s",
            envelope.task_name,
            envelope.task_id,
            attempt,
            decision.delay,
            decision.error,
        )
    elif kind == DEAD_LETTER:
        logger.error(
            "task %s [%s] dead-lettered after %d attempts: %s",
            envelope.task_name,
            envelope.task_id,
            attempt,
            decision.error,
        )
    else:
        logger.error(
            "task %s [%s] failed for good after %d attempts and blocks ordering key "
            "%r (manage.py outbox ordering retry --key KEY, or skip --key KEY): %s",
            envelope.task_name,
            envelope.task_id,
            attempt,
            envelope.ordering_key,
            decision.error,
        )
