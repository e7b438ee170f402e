"""Sleeping that a signal or a wake-up hint can end at once."""

from __future__ import annotations

import contextlib
import os
import select
import weakref
from collections.abc import Sequence


class Waiter:
    """A self-pipe: :meth:`wake` is safe to call from a signal handler or another thread.

    ``time.sleep`` and ``Event.wait`` resume after a signal handler returns (PEP 475),
    so a SIGTERM during a backoff would wait the whole backoff out; ``select`` on a
    pipe that the handler writes to returns at once.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        # A waiter dropped without close() (the relay of a finished thread that
        # published on commit) must not keep its pipe open for the life of the process.
        self._closer = weakref.finalize(self, _close_pipe, self._read, self._write)

    def wake(self) -> None:
        """End the current (or next) :meth:`wait` early."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, b"!")

    def wait(self, timeout: float, also: Sequence[int] = ()) -> bool:
        """Sleep up to ``timeout`` seconds or until a file in ``also`` is readable.

        Returns True if woken early.
        """
        ready, _, _ = select.select([self._read, *also], [], [], max(timeout, 0.0))
        if not ready:
            return False
        if self._read not in ready:
            return True
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._read, 4096):
                pass
        return True

    def close(self) -> None:
        """Release the pipe."""
        self._closer()


def _close_pipe(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
