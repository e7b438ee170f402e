"""How a renamed or moved name says so: one warning, one wording, everywhere.

Every old spelling of the 0.x line (a module, a class, a decorator, a command)
keeps working and warns through :func:`deprecated`, which names the new spelling.
"""

from __future__ import annotations

import warnings

#: What every deprecation promises, after the new spelling.
PROMISE = "The old spelling keeps working in the 0.x releases and goes in 1.0."


def deprecation_message(old: str, new: str, note: str = "") -> str:
    """``old`` is deprecated: use ``new``. (``note``, then the promise.)"""
    parts = [f"{old} is deprecated: use {new}.", note, PROMISE]
    return " ".join(part for part in parts if part)


def deprecated(old: str, new: str, *, note: str = "", stacklevel: int = 2) -> str:
    """Warn with a :class:`DeprecationWarning` that ``old`` is now ``new``.

    ``stacklevel`` counts as :func:`warnings.warn`'s does from the caller of this
    function (2: the line that called the caller). Returns the message, for a
    command that also prints it.
    """
    message = deprecation_message(old, new, note)
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)
    return message
