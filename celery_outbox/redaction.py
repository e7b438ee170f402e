"""Hide sensitive task arguments wherever celery-outbox shows them (admin, logs, stats).

``CELERY_OUTBOX_REDACTOR`` names a callable ``(task_name, args, kwargs) -> (args, kwargs)``.
It is imported once (the system check ``celery_outbox.E005`` reports a bad path at
start-up) and applied by :func:`redact_arguments`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string

from .conf import PREFIX, OutboxSettings, get_settings
from .exceptions import OutboxConfigurationError

logger = logging.getLogger("celery_outbox")

#: ``(task_name, args, kwargs) -> (args, kwargs)``
Redactor = Callable[[str, Sequence[Any], Mapping[str, Any]], tuple[Any, Any]]

#: Shown instead of the arguments when the redactor itself fails.
REDACTION_FAILED = "<hidden: the redactor raised an error>"


def load_redactor(settings: OutboxSettings | None = None) -> Redactor | None:
    """Import the configured redactor, or None; raises :class:`OutboxConfigurationError`."""
    settings = settings or get_settings()
    if settings.redactor is None:
        return None
    return _import(settings.redactor)


@functools.lru_cache(maxsize=8)
def _import(path: str) -> Redactor:
    try:
        redactor = import_string(path)
    except ImportError as exc:
        raise OutboxConfigurationError(
            f"{PREFIX}REDACTOR = {path!r} cannot be imported ({exc}). Set it to the dotted "
            f"path of a callable (task_name, args, kwargs) -> (args, kwargs)."
        ) from exc
    if not callable(redactor):
        raise OutboxConfigurationError(
            f"{PREFIX}REDACTOR = {path!r} is a {type(redactor).__name__}, not a callable "
            f"(task_name, args, kwargs) -> (args, kwargs)."
        )
    return redactor  # type: ignore[no-any-return]


def redact_arguments(
    task_name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    settings: OutboxSettings | None = None,
) -> tuple[list[Any], dict[str, Any]]:
    """The arguments as they may be shown: passed through the redactor when one is set.

    A redactor that raises or returns something other than a pair hides everything
    (fail closed) and the problem is logged without the arguments.
    """
    redactor = load_redactor(settings)
    if redactor is None:
        return list(args), dict(kwargs)
    try:
        result = redactor(task_name, list(args), dict(kwargs))
        new_args, new_kwargs = result
        return list(new_args), dict(new_kwargs)
    except Exception as exc:
        logger.error(
            "CELERY_OUTBOX_REDACTOR failed for task %r (%s); its arguments are hidden",
            task_name,
            type(exc).__name__,
        )
        return [REDACTION_FAILED], {}


@receiver(setting_changed)
def _forget_redactor(*, setting: str, **_: Any) -> None:
    if setting == PREFIX + "REDACTOR":
        _import.cache_clear()
