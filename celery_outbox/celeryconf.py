"""Celery's configuration, looked up once per key instead of on every call.

Celery reads its configuration live: one ``delay()`` looks up six keys
(``task_always_eager`` twice, ``task_default_queue``, ``task_send_sent_event``,
``task_repr_maxlevels`` twice). With ``config_from_object("django.conf:settings",
namespace="CELERY")`` each lookup tries up to three spellings of the key over three
maps, and most tries miss by raising ``AttributeError`` inside Django's
``LazySettings``. On this project's benchmark that was a third of Celery's share of
an enqueue, more once the caller had just waited for the database.

:class:`MemoizedSettings` keeps what a lookup found until the configuration changes.
It notices every supported way to change it:

* writes through ``app.conf`` (attribute or item assignment, ``update``,
  ``setdefault``, ``pop``, ``del``, ``clear``, ``add_defaults``) and Celery's own
  reload (``config_from_object``);
* Django's ``setting_changed`` signal, which ``override_settings`` and pytest-django's
  ``settings`` fixture send.

What it cannot see is what Django also leaves unsupported: assigning
``settings.CELERY_X = ...`` at runtime, or editing a configuration module's
attributes after the app has read them. Call :func:`forget_celery_config` after such a
change.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import Any

from celery.app.utils import Settings
from django.core.signals import setting_changed

_MEMO = "_outbox_memo"
#: Every memoized configuration, by id (a mapping is not hashable).
_memoized: weakref.WeakValueDictionary[int, MemoizedSettings] = (
    weakref.WeakValueDictionary()
)
_memoized_lock = threading.Lock()


class MemoizedSettings(Settings):
    """Celery's ``Settings`` with a memo of found values, dropped on every change.

    Only found values are kept: a missing key is looked up again each time, and
    raises ``KeyError`` (``AttributeError`` as an attribute) just as before.
    """

    def __getitem__(self, key: str) -> Any:
        memo: dict[str, Any] | None = self.__dict__.get(_MEMO)
        if memo is None:  # a copy's first lookup
            memo = self._fresh_memo()
        try:
            return memo[key]
        except KeyError:
            pass
        value = super().__getitem__(key)
        # Stored in the dict read above: if a change replaced it meanwhile, the value
        # is dropped with the old dict instead of outliving the change.
        memo[key] = value
        return value

    def forget(self) -> None:
        """Drop every remembered value; the next lookups read the configuration again."""
        self._fresh_memo()

    @property
    def version(self) -> object:
        """A token that is replaced whenever the configuration may have changed.

        Compare it by identity: whatever was derived from the configuration while
        the token was current is still valid while it is.
        """
        memo = self.__dict__.get(_MEMO)
        return memo if memo is not None else self._fresh_memo()

    def _fresh_memo(self) -> dict[str, Any]:
        with _memoized_lock:  # from now on Django's changes reach it too
            _memoized[id(self)] = self
        # Replaced, not cleared: a lookup racing with a change stores into the old dict.
        memo: dict[str, Any] = {}
        self.__dict__[_MEMO] = memo
        return memo

    # -- every way Celery's mapping can change -------------------------------------

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.forget()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.forget()

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self.forget()

    def pop(self, key: str, *default: Any) -> Any:
        try:
            return super().pop(key, *default)
        finally:
            self.forget()

    def clear(self) -> None:
        super().clear()
        self.forget()

    def add_defaults(self, d: Mapping[str, Any]) -> None:
        super().add_defaults(d)
        self.forget()

    def swap_with(self, other: Any) -> None:
        super().swap_with(other)
        self.forget()


def memoize(conf: Any) -> None:
    """Give a freshly loaded Celery configuration a memo, unless its class is its own.

    Only Celery's plain ``Settings`` is switched: an application that brought a
    subclass of its own keeps it, with Celery's live lookups.
    """
    if type(conf) is Settings:
        # Same layout, one class further down: every reference to app.conf, taken
        # before or after, sees the memo. (Settings turns plain attribute assignment
        # into a configuration change, hence object.__setattr__.)
        object.__setattr__(conf, "__class__", MemoizedSettings)
    if isinstance(conf, MemoizedSettings):
        conf.forget()


def forget_celery_config() -> None:
    """Make every OutboxCelery app read Celery's configuration again.

    Needed only after a change Django does not announce: assigning
    ``settings.CELERY_X = ...`` outside ``override_settings``, or editing a
    configuration module in place.
    """
    with _memoized_lock:
        confs = list(_memoized.values())
    for conf in confs:
        conf.forget()


def _on_setting_changed(**kwargs: Any) -> None:
    forget_celery_config()


setting_changed.connect(_on_setting_changed, dispatch_uid="celery_outbox.celeryconf")
