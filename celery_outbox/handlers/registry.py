"""Categories and their receivers, declared in the application's code."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..exceptions import OutboxConfigurationError, OutboxValueError
from ..store.handlers.types import KEY_LENGTH
from ..text import check_text

#: ``receiver(*, shard, object_id, payload, category, message_id, attempt, created_at)``.
Receiver = Callable[..., Any]


@dataclass(frozen=True)
class Category:
    """How the messages of one category are run."""

    name: str
    receiver: Receiver
    #: Keep only the newest message of each (shard, category, object id).
    coalesce: bool = True
    #: Failed runs of one message before it is dead-lettered; None retries forever.
    max_attempts: int | None = None
    #: Run the receiver in a transaction on the outbox's database, committed with the
    #: deletion of its message.
    atomic: bool = True


class Registry:
    """The categories this process knows, by name."""

    def __init__(self) -> None:
        self._categories: dict[str, Category] = {}
        self._lock = threading.Lock()

    def add(self, category: Category) -> None:
        """Register a category; a second receiver for the same name is refused."""
        if not category.name:
            raise OutboxConfigurationError("a handler category needs a name")
        try:
            check_text(
                category.name,
                "category",
                "Cannot register a handler receiver",
                limit=KEY_LENGTH,
            )
        except OutboxValueError as exc:  # a mistake in the code, found at import
            raise OutboxConfigurationError(str(exc)) from None
        if category.max_attempts is not None and category.max_attempts < 1:
            raise OutboxConfigurationError(
                f"max_attempts of handler category {category.name!r} must be a "
                f"positive int or None (retry forever), got {category.max_attempts!r}."
            )
        with self._lock:
            known = self._categories.get(category.name)
            if known is not None and known.receiver is not category.receiver:
                raise OutboxConfigurationError(
                    f"handler category {category.name!r} already has a receiver "
                    f"({_name(known.receiver)}); one category has one receiver."
                )
            self._categories[category.name] = category

    def remove(self, name: str) -> None:
        """Forget a category (tests)."""
        with self._lock:
            self._categories.pop(name, None)

    def get(self, name: str) -> Category | None:
        """The category named ``name``, or None when no receiver was declared."""
        return self._categories.get(name)

    def coalesces(self, name: str) -> bool:
        """Whether messages of ``name`` coalesce (unknown categories do not)."""
        category = self._categories.get(name)
        return category is not None and category.coalesce

    def names(self) -> list[str]:
        """Every registered category name, sorted."""
        return sorted(self._categories)


def _name(function: Receiver) -> str:
    module = getattr(function, "__module__", "?")
    return f"{module}.{getattr(function, '__qualname__', repr(function))}"


#: The process-wide registry that :func:`celery_outbox.handlers.receiver` fills.
registry = Registry()
