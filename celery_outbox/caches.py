"""Every process-wide cache of the package, and the one reset that empties them all.

A module that keeps something between calls (decoded texts, rebuilt queues, the
wake-up hint's clock) makes it here, with :func:`bounded_cache` or :func:`on_reset`,
instead of in a global of its own. :func:`reset` forgets all of it: after a fork,
where the child must not act on what its parent saw, and in tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

#: No lock: ``list.append`` is atomic, and a lock held by another thread at a fork
#: would stay held in the child, where :func:`reset` runs.
_resets: list[Callable[[], None]] = []


class BoundedCache(Generic[K, V]):
    """A dict that starts over once it holds ``size`` entries.

    The values it holds repeat (a handful per process); a process that keeps making
    new ones must not grow without end.
    """

    __slots__ = ("_items", "_size", "name")

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self._size = size
        self._items: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        """The value kept for ``key``, or None."""
        return self._items.get(key)

    def put(self, key: K, value: V) -> V:
        """Keep ``value`` for ``key`` (emptying the cache first when it is full)."""
        if len(self._items) >= self._size:
            self._items.clear()
        self._items[key] = value
        return value

    def clear(self) -> None:
        """Forget everything."""
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


def bounded_cache(name: str, size: int) -> BoundedCache[K, V]:
    """A new :class:`BoundedCache` that :func:`reset` empties."""
    cache: BoundedCache[K, V] = BoundedCache(name, size)
    on_reset(cache.clear)
    return cache


def on_reset(forget: Callable[[], None]) -> None:
    """Have :func:`reset` call ``forget``."""
    _resets.append(forget)


def reset() -> None:
    """Empty every cache of the package (runs in every forked child, too)."""
    for forget in list(_resets):
        forget()


os.register_at_fork(after_in_child=reset)
