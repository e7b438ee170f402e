"""The one backoff of every lane: capped exponential, with equal jitter."""

from __future__ import annotations

from collections.abc import Callable


def backoff(
    attempt: int, base: float, cap: float, random: Callable[[], float]
) -> float:
    """Seconds before retry number ``attempt`` (1-based).

    The ceiling doubles from ``base`` up to ``cap``; the wait is half the ceiling
    plus a random share of the other half (``random()`` in [0, 1)), so members that
    failed together do not come back together. ``attempt`` below 1 waits nothing.
    """
    if attempt < 1:
        return 0.0
    # 2.0**1024 overflows a float: the exponent stops long before that matters.
    exponent = min(attempt - 1, 62)
    ceiling = min(cap, base * 2.0**exponent)
    return ceiling / 2 + random() * ceiling / 2
