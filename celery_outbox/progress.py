"""Progress bars for long commands, drawn by tqdm (the ``progress`` extra).

A bar is cosmetic: without tqdm installed the command runs the same and draws none.
tqdm is imported only when a job is large enough to draw one.
"""

from __future__ import annotations

from typing import Any, Protocol

from django.core.management.base import OutputWrapper


class Output(Protocol):
    """Where a command writes (a file, Django's ``OutputWrapper``)."""

    def write(self, text: str) -> Any: ...

    def flush(self) -> Any: ...


class _Unended:
    """A stream that writes exactly what tqdm gives it.

    Django's ``OutputWrapper`` ends every write with a newline unless told not to,
    which would turn each redraw into a line of its own.
    """

    def __init__(self, stream: Output) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        if isinstance(self._stream, OutputWrapper):
            self._stream.write(text, ending="")
        else:
            self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()


def _tqdm_class() -> Any:
    """tqdm's bar class, or None when the ``progress`` extra is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class ProgressBar:
    """``update(done, total)`` from a job's progress callback; ``close()`` at its end.

    Draws only for jobs of more than ``threshold`` items, on ``stream``.
    """

    def __init__(
        self,
        stream: Output,
        description: str,
        *,
        unit: str = "it",
        threshold: int = 0,
    ) -> None:
        self.stream = stream
        self.description = description
        self.unit = unit
        self.threshold = threshold
        self._bar: Any = None
        self._unavailable = False

    def update(self, done: int, total: int) -> None:
        """Show ``done`` of ``total`` items."""
        if total <= self.threshold or self._unavailable:
            return
        if self._bar is None:
            bar_class = _tqdm_class()
            if bar_class is None:
                self._unavailable = True
                return
            self._bar = bar_class(
                total=total,
                desc=self.description,
                unit=self.unit,
                file=_Unended(self.stream),
            )
        bar = self._bar
        if bar.total != total:
            bar.total = total
        bar.update(done - bar.n)

    def close(self) -> None:
        """Draw the final state and end the line, if a bar was drawn."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    @property
    def drawn(self) -> bool:
        """Whether a bar is on the stream."""
        return self._bar is not None
