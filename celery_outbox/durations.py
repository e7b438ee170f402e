"""Small parsers for durations (``90``, ``30m``, ``2h``, ``7d``) and points in time."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta, timezone

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)
#: A unitless whole number this long reads as a date (``20240501``), not as seconds.
_DATE_LIKE = re.compile(r"^\s*\d{8,}\s*$")


def is_seconds(value: object) -> bool:
    """Whether ``value`` is a number of seconds >= 0 (a finite int or float, no bool)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and 0 <= value < math.inf
    )


def parse_duration(value: str | float) -> float:
    """Seconds in ``value``: a positive number of seconds or ``<number><s|m|h|d|w>``.

    Units may be capitals, except ``M``, refused as ambiguous (months or minutes).
    Raises :class:`ValueError` with a message naming the accepted forms. Infinity and
    NaN are refused: no database can add them to a point in time.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise ValueError(
                f"{value!r} is not a duration; use seconds or a number with a unit, "
                f"e.g. 90, 30m, 2h, 7d, 2w"
            )
        unit = match.group(2) or "s"
        if unit == "M":
            # Months to some readers, minutes to others: say which.
            raise ValueError(
                f"{value!r} is ambiguous: write {match.group(1)}m for minutes, or days "
                f"(e.g. 30d) for about a month"
            )
        seconds = float(match.group(1)) * _UNITS[unit.lower()]
    if not seconds > 0 or not math.isfinite(seconds):  # nan compares false
        raise ValueError(f"a duration must be positive and finite, got {value!r}")
    return seconds


def parse_moment(value: str, now: datetime | None = None) -> datetime:
    """An aware datetime from an ISO 8601 string, or ``now`` minus a duration (``2h`` = two hours ago).

    Naive ISO datetimes are taken as UTC. A unitless number of eight digits or more
    (``20240501``) is refused as ambiguous: a date, or that many seconds ago.
    Raises :class:`ValueError` naming the problem.
    """
    now = now or datetime.now(timezone.utc)
    if _DATE_LIKE.match(value):
        raise ValueError(
            f"{value!r} is ambiguous: write the date with dashes (2024-05-01), or the "
            f"seconds ago with a unit ({value.strip()}s)"
        )
    try:
        seconds: float | None = parse_duration(value)
    except ValueError:
        seconds = None
    if seconds is not None:
        try:
            return now - timedelta(seconds=seconds)
        except OverflowError:  # before year 1, or beyond timedelta itself
            raise ValueError(
                f"{value!r} ago is too far back for a date; give an ISO datetime "
                f"(2024-05-01T12:00:00+00:00) or a shorter duration (30m, 2h, 7d)"
            ) from None
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(
            f"{value!r} is neither an ISO datetime (2024-05-01T12:00:00+00:00) nor a "
            f"duration ago (30m, 2h, 7d)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment
