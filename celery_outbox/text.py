"""Text that reaches a database column: failures made storable, callers' keys checked.

Two directions, two rules:

* **What we record** (an exception's text, a traceback, a broker's reason, an
  operator's reason, a process's name) must always be storable, or the failure it
  describes cannot be recorded and is repeated forever. :func:`storable` replaces
  what no database stores (NUL, lone surrogates) and bounds the length; it never
  raises. Should a database refuse it all the same, :func:`unrecorded` is the note
  recorded in its place, so that the failure still counts.
* **What a caller names** (a key, a shard, a category, an id) must mean exactly what
  was written, so nothing is replaced: :func:`check_text` refuses it at the call with
  an :class:`~celery_outbox.exceptions.OutboxValueError` naming the value, the
  character and its position, before any statement of the caller's transaction runs.
"""

from __future__ import annotations

import re

from .exceptions import OutboxValueError

#: Characters of an error, reason or traceback kept in a column.
ERROR_LIMIT = 4000
#: What stands for a character no database stores (U+FFFD, the replacement character).
REPLACEMENT = "\ufffd"
_CUT = " [... cut, {} characters in all]"
#: The same, before the end of a text kept by its end.
_CUT_BEFORE = "[... cut, {} characters in all] "
#: Surrogate code points: UTF-8 has no encoding for them, paired or not.
_SURROGATES = re.compile("[\ud800-\udfff]")


def storable(
    text: str, limit: int | None = ERROR_LIMIT, *, keep_end: bool = False
) -> str:
    """``text`` with NUL and lone surrogates replaced, cut to at most ``limit`` characters.

    PostgreSQL refuses a NUL in text; neither PostgreSQL nor MySQL/MariaDB stores a
    lone surrogate (``'\\udc80'``, what Python decodes an undecodable byte to). The
    start of the text is kept, or its end with ``keep_end`` (a traceback, whose last
    line says what failed); a cut says how long the whole was.
    """
    if not isinstance(text, str):
        text = str(text)
    if "\x00" in text:
        text = text.replace("\x00", REPLACEMENT)
    if not text.isascii():
        text = _SURROGATES.sub(REPLACEMENT, text)
    if limit is not None and len(text) > limit:
        if keep_end:
            cut = _CUT_BEFORE.format(len(text))
            if len(cut) >= limit:
                return text[-limit:]
            return cut + text[len(text) - (limit - len(cut)) :]
        cut = _CUT.format(len(text))
        if len(cut) >= limit:
            return text[:limit]
        text = text[: limit - len(cut)] + cut
    return text


def unrecorded(failure: BaseException | str, refused: BaseException) -> str:
    """What is recorded for ``failure`` when the database ``refused`` its text.

    The failure's kind and why its text is missing, in ASCII (every column of every
    database stores it), so that the failure still counts: an attempt charged, a
    policy applied, instead of the same work running again at every lease.
    """
    kind = failure if isinstance(failure, str) else type(failure).__name__
    note = f"{kind} (its text could not be recorded: {refused})"
    escaped = note.encode("ascii", "backslashreplace").decode("ascii")
    return storable(escaped.replace("\x00", "\\x00"))


def unstorable_at(value: str) -> tuple[int, str] | None:
    """The position and a description of the first character no database stores, or None."""
    position = value.find("\x00")
    if position >= 0:
        return position, "a NUL (0x00) character, which PostgreSQL cannot store"
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            exc.start,
            f"a lone surrogate ({value[exc.start]!r}), which cannot be stored as UTF-8",
        )
    return None


#: Characters of a refused value shown on each side of the culprit.
_SHOWN = 40


def _around(value: str, position: int) -> str:
    """``value`` as Python writes it, cut to the characters around ``position``."""
    start, end = max(0, position - _SHOWN), position + _SHOWN + 1
    if start == 0 and end >= len(value):
        return repr(value)
    head = "..." if start else ""
    tail = "..." if end < len(value) else ""
    return f"{head}{value[start:end]!r}{tail}"


def check_text(
    value: object, what: str, where: str, *, limit: int | None = None
) -> str:
    """``value`` if a text column stores it exactly; else :class:`OutboxValueError`.

    ``what`` names the value (``"ordering_key"``), ``where`` the call (``"Cannot
    enqueue task 'shop.send'"``); the message says what is wrong, where, and that
    nothing was written.
    """
    if not isinstance(value, str):
        raise OutboxValueError(
            f"{where}: {what} must be a string, got {type(value).__name__} "
            f"{value!r}. Nothing was written."
        )
    found = unstorable_at(value)
    if found is not None:
        position, description = found
        raise OutboxValueError(
            f"{where}: {what} {_around(value, position)} contains {description}, at "
            f"position {position}. Remove or encode that character. Nothing was "
            f"written."
        )
    if limit is not None and len(value) > limit:
        raise OutboxValueError(
            f"{where}: {what} is {len(value)} characters long and the outbox stores "
            f"at most {limit}. Use a shorter {what}. Nothing was written."
        )
    return value
