"""The one loop of leased work: turn → rest → turn, until stopped.

A lane (the task relay, the handler processor) supplies what differs through
:class:`Lane`: one turn of its work, how long to rest after a paused turn, when its
next scheduled work falls due, and what to do once stopped. The loop does the rest,
the same for every lane: stop on :meth:`Loop.stop` (safe in a SIGTERM/SIGINT
handler), adaptive polling between ``min_poll_interval`` and ``poll_interval``,
wake-ups (a signal, a LISTEN/NOTIFY hint, a heartbeat's takeover), the liveness
file, the heartbeat thread, and :class:`~.observations.Idle` for its observers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from .heartbeat import Heartbeat
from .observations import Idle, StopReason, notify
from .waiter import Waiter

logger = logging.getLogger("celery_outbox.engine")

#: An idle lane about to rest at least this long asks when its next work falls due.
ASK_DUE_AFTER = 0.05


@dataclass(frozen=True)
class Left:
    """What a run ``until_empty`` leaves behind, as the lane reads it from its state.

    Read when the run ends, never counted along the way: a row an earlier run put
    back is as unsent as one this run put back.
    """

    #: Work the lane could do and has not (rows put back after an outage or a
    #: refusal, a database that did not answer), and why; None when there is none.
    unfinished: str | None = None
    #: Work a limit holds back (a flow's rate, a key at its limit), and how much;
    #: None when there is none.
    held: str | None = None

    @property
    def reason(self) -> StopReason:
        """Why a run that leaves this stops: unfinished before held before empty."""
        if self.unfinished is not None:
            return StopReason.UNFINISHED
        if self.held is not None:
            return StopReason.HELD
        return StopReason.EMPTY

    def describe(self) -> str:
        """Everything left, in the lane's words ("nothing" when nothing is)."""
        return "; ".join(p for p in (self.unfinished, self.held) if p) or "nothing"


class Turn(enum.Enum):
    """How one turn of a lane ended, which decides how long the loop rests."""

    FULL = "full"  # a whole batch: go again at once
    PARTIAL = "partial"  # less than a batch: drained for now
    EMPTY = "empty"  # nothing due
    PAUSED = "paused"  # breaker open or an error: rest before trying again


class Lane(Protocol):
    """What a lane gives the loop."""

    def turn(self) -> Turn:
        """Claim, run and settle one batch of leased work."""
        ...

    def paused_for(self) -> float:
        """Seconds to rest after a :attr:`Turn.PAUSED` turn."""
        ...

    def next_due(self) -> float:
        """Seconds until work not yet due falls due (``math.inf``: none known)."""
        ...

    def finish(self) -> None:
        """Called once the loop stops (a last settlement, say)."""
        ...

    def left(self) -> Left:
        """The work left, read from the lane's state (its database) when a run
        ``until_empty`` ends; a lane whose last turn failed says why in
        :attr:`Left.unfinished`."""
        ...


class WakeupSource(Protocol):
    """Something that becomes readable when new rows commit (LISTEN/NOTIFY)."""

    def fileno(self) -> int | None:
        """The file to select on, or None when not available right now."""
        ...

    def drain(self) -> int:
        """Consume what woke us; how many hints arrived."""
        ...

    def close(self) -> None:
        """Release the source."""
        ...


@dataclass(frozen=True)
class Pacing:
    """How a loop waits, and where it says it is alive."""

    poll_interval: float = 1.0
    #: The first wait after work; every empty look doubles it up to poll_interval.
    min_poll_interval: float = 1.0
    #: Touch this file at least every ``liveness_interval`` seconds.
    liveness_file: str | None = None
    liveness_interval: float = 5.0
    #: Return once nothing is due, or at the first paused turn (an outage, an
    #: error): with the reason the lane's :meth:`Lane.left` gives.
    until_empty: bool = False


class Loop:
    """Drives one lane until stopped."""

    def __init__(
        self,
        lane: Lane,
        pacing: Pacing,
        *,
        clock: Callable[[], float] = time.monotonic,
        waiter: Waiter | None = None,
        observers: Sequence[Callable[[Any], None]] = (),
        wakeup: WakeupSource | None = None,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        self.lane = lane
        self.pacing = pacing
        self.clock = clock
        self.waiter = waiter or Waiter()
        #: Kept by reference: a lane may add observers after building its loop.
        self.observers = observers
        self.wakeup = wakeup
        #: Beats while :meth:`run` runs, so that a killed member's leases are
        #: taken over by the others long before they end.
        self.heartbeat = heartbeat
        self._stopping = False
        #: When :meth:`stop` was first called (the loop's clock).
        self.stop_at: float | None = None
        self._idle_wait = pacing.min_poll_interval
        self._last_touch = 0.0
        #: What a run ``until_empty`` left, as the lane said when it ended.
        self.left = Left()

    def stop(self) -> None:
        """Ask the loop to end the turn in hand and return; safe in a signal handler."""
        if self.stop_at is None:
            self.stop_at = self.clock()
        self._stopping = True
        self.waiter.wake()

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stopping

    def run(self) -> StopReason:
        """Turn the lane until stopped (or, with ``until_empty``, until nothing is due)."""
        if self.heartbeat is not None:
            self.heartbeat.start()
        try:
            return self._loop()
        finally:
            if self.heartbeat is not None:
                self.heartbeat.stop()

    def _loop(self) -> StopReason:
        pacing = self.pacing
        while not self._stopping:
            self.touch_liveness()
            turn = self.lane.turn()
            if turn is Turn.FULL:
                continue
            if pacing.until_empty:
                if turn in (Turn.EMPTY, Turn.PARTIAL):
                    # One more look: rows may have committed meanwhile.
                    turn = self.lane.turn()
                    if turn not in (Turn.EMPTY, Turn.PAUSED):
                        continue
                self.lane.finish()
                return self._until_empty_stop(turn)
            seconds = self._rest_seconds(turn)
            notify(self.observers, Idle(seconds))
            self._rest(seconds, woken_by_rows=turn is not Turn.PAUSED)
        self.lane.finish()
        return StopReason.SIGNAL

    def _until_empty_stop(self, turn: Turn) -> StopReason:
        """Why a run ``until_empty`` ends after an empty or paused ``turn``.

        Waiting for an outage to end is not "until empty": a paused turn ends the
        run as unfinished, with the lane's reason when it has one.
        """
        left = self.lane.left()
        if turn is Turn.PAUSED and left.unfinished is None:
            left = dataclasses.replace(
                left, unfinished="paused by an outage or an error (see the log)"
            )
        self.left = left
        return left.reason

    def _rest_seconds(self, turn: Turn) -> float:
        if turn is Turn.PAUSED:
            return self.lane.paused_for()
        pacing = self.pacing
        # Adaptive polling: right after work, look again soon (rows may have committed
        # meanwhile); every empty look doubles the wait, up to poll_interval.
        if turn is Turn.PARTIAL:
            self._idle_wait = pacing.min_poll_interval
        wait = min(self._idle_wait, pacing.poll_interval)
        self._idle_wait = min(self._idle_wait * 2, pacing.poll_interval)
        if turn is Turn.EMPTY and wait >= ASK_DUE_AFTER:
            # Scheduled work: wake when the next falls due, not at a later poll.
            wait = min(wait, self.lane.next_due())
        return wait

    def _rest(self, seconds: float, *, woken_by_rows: bool) -> None:
        end = self.clock() + seconds
        while not self._stopping:
            remaining = end - self.clock()
            if remaining <= 0:
                return
            fd = (
                self.wakeup.fileno()
                if (woken_by_rows and self.wakeup is not None)
                else None
            )
            also = () if fd is None else (fd,)
            if self.waiter.wait(min(remaining, self.pacing.liveness_interval), also):
                if self.wakeup is not None and self.wakeup.drain():
                    self._idle_wait = self.pacing.min_poll_interval
                return
            self.touch_liveness()

    def touch_liveness(self) -> None:
        """Touch the liveness file (at most once a second); a lane's long turn calls it."""
        path = self.pacing.liveness_file
        if path is None:
            return
        now = self.clock()
        if now - self._last_touch < 1.0:
            return
        self._last_touch = now
        try:
            Path(path).touch()
            os.utime(path)
        except OSError as exc:
            logger.warning("cannot touch liveness file %s: %s", path, exc)


@contextlib.contextmanager
def stop_on_signals(
    stop: Callable[[], None],
    signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
) -> Iterator[None]:
    """Call ``stop`` on SIGTERM and SIGINT while the block runs (main thread only)."""

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
