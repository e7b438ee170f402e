"""Event names, subscriber patterns and the service name: checks and topic matching.

All pure: no broker, no Django. A pattern follows RabbitMQ's topic syntax: words
separated by dots, ``*`` stands for exactly one word and ``#`` for zero or more.
"""

from __future__ import annotations

import functools
import re

from ..exceptions import OutboxConfigurationError, OutboxValueError
from ..text import check_text

_WORD = re.compile(r"[A-Za-z0-9_-]+\Z")
#: Names RabbitMQ accepts are at most 255 bytes; ours are embedded in queue names.
_MAX_LENGTH = 120


def check_event_name(name: str) -> str:
    """``name`` if it is a valid event name (dotted words, no wildcard); raises otherwise."""
    _check(name, "event name", wildcards=False)
    return name


def check_pattern(pattern: str) -> str:
    """``pattern`` if it is a valid subscriber pattern (``order.created``, ``order.*``)."""
    _check(pattern, "subscriber pattern", wildcards=True)
    return pattern


def check_service(name: object) -> str:
    """The service name of an app's ``main``; refuses a missing or default one."""
    if not isinstance(name, str) or not name or name == "__main__":
        raise OutboxConfigurationError(
            f"An app with event subscribers needs a unique service name, got {name!r}: "
            f"create it as OutboxCelery('billing'). Services sharing one name share "
            f"its queues, so each would get only some of the events."
        )
    if not all(_WORD.match(word) for word in name.split(".")):
        raise OutboxConfigurationError(
            f"The service name {name!r} may hold letters, digits, '_', '-' and dots "
            f"only (it is part of queue names)."
        )
    return name


def check_name(name: object, what: str, where: str) -> str:
    """``name`` if a table and a queue name can hold it; else a configuration error
    naming the character that cannot be stored and its position."""
    try:
        return check_text(name, what, where)
    except OutboxValueError as exc:
        raise OutboxConfigurationError(str(exc)) from None


def _check(name: str, what: str, *, wildcards: bool) -> None:
    if not isinstance(name, str) or not name or len(name) > _MAX_LENGTH:
        raise OutboxConfigurationError(
            f"An {what} must be a non-empty string of at most {_MAX_LENGTH} "
            f"characters, got {name!r}."
        )
    check_name(name, what, f"Invalid {what}")
    for word in name.split("."):
        if wildcards and word in {"*", "#"}:
            continue
        if not _WORD.match(word):
            allowed = " and the words '*' and '#'" if wildcards else ""
            raise OutboxConfigurationError(
                f"Invalid {what} {name!r}: use words of letters, digits, '_' and '-' "
                f"separated by dots{allowed}."
            )


def matches(pattern: str, name: str) -> bool:
    """Whether the topic ``pattern`` matches the event ``name``, as RabbitMQ decides."""
    return overlap(pattern, name)


def overlap(first: str, second: str) -> bool:
    """Whether some event name matches both topic patterns.

    A service must not have two patterns that overlap: the event would reach two of
    its queues and, without knowing which queue a copy came from, both copies would
    run the same subscriber.
    """
    return _overlap(tuple(first.split(".")), tuple(second.split(".")))


@functools.lru_cache(maxsize=4096)
def _overlap(left: tuple[str, ...], right: tuple[str, ...]) -> bool:
    if not left or not right:
        rest = left or right
        return all(word == "#" for word in rest)
    head_left, head_right = left[0], right[0]
    if head_left == "#":
        # '#' takes nothing, or one more word from the other side.
        return _overlap(left[1:], right) or _overlap(left, right[1:])
    if head_right == "#":
        return _overlap(left, right[1:]) or _overlap(left[1:], right)
    if head_left == "*" or head_right == "*" or head_left == head_right:
        return _overlap(left[1:], right[1:])
    return False
