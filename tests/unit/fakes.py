"""Seams for driving the relay without real time: a clock a test moves by hand."""

from __future__ import annotations

from collections.abc import Sequence


class FakeClock:
    """A monotonic clock that only moves when told to."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move time on by ``seconds``."""
        self.now += seconds


class FakeWaiter:
    """The relay's waiter: instead of sleeping, moves the fake clock past the wait."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        #: Every wait the relay asked for, in seconds.
        self.waits: list[float] = []

    def wait(self, timeout: float, also: Sequence[int] = ()) -> bool:
        """Let ``timeout`` seconds pass at once; never woken early."""
        self.waits.append(timeout)
        self.clock.advance(max(timeout, 0.0))
        return False

    def wake(self) -> None:
        """Nothing sleeps, so there is nothing to wake."""

    def close(self) -> None:
        """Nothing to release."""
