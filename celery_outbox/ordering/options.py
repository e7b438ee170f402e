"""The ordering options of one call: ``ordering_key``, ``ordering``, ``ordering_policy``,
``coalesce`` and ``coalesce_key``, checked once at enqueue.

They travel with the message in one header (:data:`HEADER`), read by the relay (hold
a strict head, block or skip a failed one) and by the worker (report completion).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from ..exceptions import OutboxValueError
from ..text import check_text

#: The message header that carries the non-default options: ``strict,skip,coalesce``.
HEADER = "outbox_ordering"

#: The options :func:`pop_options` takes out of ``apply_async``'s keyword arguments.
OPTION_NAMES = (
    "ordering_key",
    "ordering",
    "ordering_policy",
    "coalesce",
    "coalesce_key",
)


class Policy(enum.Enum):
    """What a key does when its head fails for good (publish attempts or task failure)."""

    BLOCK = "block"  # the key waits for an operator; the head keeps its last error
    SKIP = "skip"  # the head goes to the dead letters and the key moves on


@dataclass(frozen=True)
class Ordering:
    """The ordering of one message. ``key`` None: an unkeyed message, as before."""

    key: str | None = None
    #: Publish the next row of the key only once this one finished on a worker.
    strict: bool = False
    policy: Policy = Policy.BLOCK
    #: Older unpublished rows of the same task and key are dropped for this one.
    coalesce: bool = False

    @property
    def header(self) -> str | None:
        """The :data:`HEADER` value, or None when every option has its default."""
        flags = [
            flag
            for flag, on in (
                ("strict", self.strict),
                ("skip", self.policy is Policy.SKIP),
                ("coalesce", self.coalesce),
            )
            if on
        ]
        return ",".join(flags) or None

    @classmethod
    def read(cls, key: str | None, headers: Mapping[str, Any]) -> Ordering:
        """The ordering of a stored or delivered message (its key and headers)."""
        if key is None:
            return UNORDERED
        value = headers.get(HEADER)
        if not value:
            return cls(key)
        flags = set(str(value).split(","))
        return cls(
            key,
            strict="strict" in flags,
            policy=Policy.SKIP if "skip" in flags else Policy.BLOCK,
            coalesce="coalesce" in flags,
        )


UNORDERED = Ordering()


def is_strict(headers: Mapping[str, Any]) -> bool:
    """Whether a delivered message is a strict head (its worker must report back)."""
    value = headers.get(HEADER)
    return bool(value) and "strict" in str(value).split(",")


def pop_options(options: MutableMapping[str, Any], task_name: str) -> Ordering:
    """Take the ordering options out of a publish's keyword arguments and check them.

    Raises :class:`OutboxValueError` naming the mistake; nothing is written then.
    """
    given = {name: options.pop(name, None) for name in OPTION_NAMES}
    where = f"Cannot enqueue task {task_name[:80]!r}"
    key = _text(given["ordering_key"], "ordering_key", where)
    coalesce_key = _text(given["coalesce_key"], "coalesce_key", where)
    if coalesce_key is not None:
        if key is not None and key != coalesce_key:
            raise OutboxValueError(
                f"{where}: coalesce_key {coalesce_key!r} differs from ordering_key "
                f"{key!r}; a message coalesces within its ordering key. Pass "
                f"coalesce=True with the ordering_key. Nothing was written."
            )
        key = coalesce_key
    mode = given["ordering"]
    if mode not in (None, "publish", "strict"):
        raise OutboxValueError(
            f"{where}: ordering must be 'publish' or 'strict', got {mode!r}. "
            f"Nothing was written."
        )
    policy = given["ordering_policy"]
    if policy not in (None, "block", "skip"):
        raise OutboxValueError(
            f"{where}: ordering_policy must be 'block' or 'skip', got {policy!r}. "
            f"Nothing was written."
        )
    coalesce = given["coalesce"]
    if coalesce not in (None, True, False):
        raise OutboxValueError(
            f"{where}: coalesce must be True or False, got {coalesce!r}. "
            f"Nothing was written."
        )
    coalesce = bool(coalesce) or coalesce_key is not None
    if key is None:
        if mode == "strict" or policy is not None or coalesce:
            raise OutboxValueError(
                f"{where}: ordering, ordering_policy and coalesce need an "
                f"ordering_key (or a coalesce_key). Nothing was written."
            )
        return UNORDERED
    return Ordering(
        key,
        strict=mode == "strict",
        policy=Policy(policy or "block"),
        coalesce=coalesce,
    )


def _text(value: Any, name: str, where: str) -> str | None:
    """A key as text (an int or a UUID as ``str()`` writes it), as before this option."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise OutboxValueError(
            f"{where}: {name} must be a string, got {value!r}. Nothing was written."
        )
    return check_text(str(value), name, where)
