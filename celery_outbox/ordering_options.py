"""The ordering options of one call: ``ordering_key``, ``ordering``, ``ordering_policy``,
``coalesce`` and ``coalesce_key``, checked once at enqueue.

They travel with the message in one header (:data:`HEADER`), read by the relay (hold
a strict head, block or skip a failed one) and by the worker (report completion).
"""

from __future__ import annotations

import enum
import re
import uuid
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from .exceptions import OutboxValueError
from .text import check_text

#: The message header that carries the non-default options: ``strict,skip,coalesce``,
#: and a strict row's token (``row=<32 hex digits>``).
HEADER = "outbox_ordering"
#: How a strict row's token is written in :data:`HEADER`, before its hex digits.
ROW_FLAG = "row="

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
    #: A strict row's own token, made at enqueue: the worker's reports name the row
    #: by it, since another row may carry the same task id. None: unkeyed, not
    #: strict, or written before strict rows carried one.
    row_token: str | None = field(default=None, compare=False)

    @property
    def header(self) -> str | None:
        """The :data:`HEADER` value, or None when every option has its default."""
        flags = [
            flag
            for flag, on in (
                ("strict", self.strict),
                ("skip", self.policy is Policy.SKIP),
                ("coalesce", self.coalesce),
                (f"{ROW_FLAG}{self.row_token}", self.row_token is not None),
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
        tokens = [
            flag[len(ROW_FLAG) :]
            for flag in flags
            if flag.startswith(ROW_FLAG) and _TOKEN.fullmatch(flag[len(ROW_FLAG) :])
        ]
        return cls(
            key,
            strict="strict" in flags,
            policy=Policy.SKIP if "skip" in flags else Policy.BLOCK,
            coalesce="coalesce" in flags,
            row_token=tokens[0] if tokens else None,
        )


UNORDERED = Ordering()
#: What a row token looks like (``uuid4().hex``); anything else in the header is
#: ignored, and the reports fall back to the task id.
_TOKEN = re.compile("[0-9a-f]{32}")


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
    strict = mode == "strict"
    return Ordering(
        key,
        strict=strict,
        policy=Policy(policy or "block"),
        coalesce=coalesce,
        row_token=uuid.uuid4().hex if strict else None,
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
