"""The wake-up hint's coalescing: only a committed hint silences the next ones."""

from __future__ import annotations

from celery_outbox.store.notify import HintCoalescer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_committed_hint_silences_the_next_ones_for_the_window_only() -> None:
    clock = Clock()
    hints = HintCoalescer(0.02, clock)
    assert hints.due()
    hints.committed()
    clock.now += 0.019
    assert not hints.due()
    clock.now += 0.001
    assert hints.due()


def test_a_hint_that_never_committed_silences_nothing() -> None:
    clock = Clock()
    hints = HintCoalescer(0.02, clock)
    assert hints.due()  # written, then its transaction rolled back: no committed()
    clock.now += 0.001
    assert hints.due()


def test_forget_starts_over() -> None:
    clock = Clock()
    hints = HintCoalescer(0.02, clock)
    hints.committed()
    hints.forget()
    assert hints.due()
