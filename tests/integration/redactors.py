"""Redactors named by CELERY_OUTBOX_REDACTOR in the tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def hide_passwords(
    task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """Replace every ``password`` keyword argument with stars."""
    return list(args), {
        key: ("***" if key == "password" else value) for key, value in kwargs.items()
    }


def broken(
    task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """A redactor with a bug."""
    raise RuntimeError("bug in the redactor")


not_callable = 42
