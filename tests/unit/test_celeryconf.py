"""Celery's configuration is looked up once per key, and every supported change is seen."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
from celery import Celery
from celery.app.utils import Settings
from django.test import override_settings

from celery_outbox import OutboxCelery
from celery_outbox.celeryconf import MemoizedSettings, forget_celery_config


@pytest.fixture
def source() -> SimpleNamespace:
    """A configuration object whose attributes Celery reads (like a celeryconfig module)."""
    return SimpleNamespace(task_default_queue="first", task_repr_maxlevels=3)


@pytest.fixture
def app(source: SimpleNamespace) -> Iterator[OutboxCelery]:
    app = OutboxCelery("memo-test", set_as_current=False)
    app.config_from_object(source)
    assert app.conf.task_default_queue == "first"  # loaded
    yield app
    app.close()


def test_a_loaded_configuration_is_memoized(
    app: OutboxCelery, source: SimpleNamespace
) -> None:
    assert isinstance(app.conf, MemoizedSettings)
    # Editing the source in place is the one change nobody announces: the memo keeps
    # the value Celery read, until told to forget.
    source.task_default_queue = "edited in place"
    assert app.conf.task_default_queue == "first"
    forget_celery_config()
    assert app.conf.task_default_queue == "edited in place"


CHANGES: dict[str, Callable[[Settings], None]] = {
    "attribute": lambda conf: setattr(conf, "task_default_queue", "changed"),
    "item": lambda conf: conf.__setitem__("task_default_queue", "changed"),
    "update": lambda conf: conf.update(task_default_queue="changed"),
    "update with a mapping": lambda conf: conf.update(
        {"task_default_queue": "changed"}
    ),
    "add_defaults": lambda conf: conf.add_defaults({"task_default_queue": "changed"}),
}


@pytest.mark.parametrize("change", CHANGES.values(), ids=CHANGES.keys())
def test_a_change_through_app_conf_is_seen(
    change: Callable[[Settings], None], source: SimpleNamespace
) -> None:
    # add_defaults only matters for keys no source sets.
    del source.task_default_queue
    app = OutboxCelery("memo-test", set_as_current=False)
    app.config_from_object(source)
    assert app.conf.task_default_queue == "celery"  # Celery's default, now memoized
    change(app.conf)
    assert app.conf.task_default_queue == "changed"
    app.close()


REMOVALS: dict[str, Callable[[Settings], None]] = {
    "del": lambda conf: conf.__delitem__("task_default_queue"),
    "pop": lambda conf: conf.pop("task_default_queue"),
    "clear": lambda conf: conf.clear(),
}


@pytest.mark.parametrize("remove", REMOVALS.values(), ids=REMOVALS.keys())
def test_removing_a_change_is_seen(
    remove: Callable[[Settings], None], app: OutboxCelery
) -> None:
    app.conf.task_default_queue = "changed"
    assert app.conf.task_default_queue == "changed"
    remove(app.conf)
    assert app.conf.task_default_queue == "first"


def test_override_settings_is_seen_on_entry_and_on_exit() -> None:
    app = OutboxCelery("memo-test", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    with override_settings(CELERY_TASK_DEFAULT_QUEUE="outer"):
        assert app.conf.task_default_queue == "outer"
        with override_settings(CELERY_TASK_DEFAULT_QUEUE="inner"):
            assert app.conf.task_default_queue == "inner"
        assert app.conf.task_default_queue == "outer"
    with override_settings(CELERY_TASK_ALWAYS_EAGER=True):
        assert app.conf.task_always_eager is True
    assert app.conf.task_always_eager is False
    copy = app.conf.copy()
    assert copy.task_default_queue == app.conf.task_default_queue
    with override_settings(CELERY_TASK_DEFAULT_QUEUE="seen by the copy"):
        assert copy.task_default_queue == "seen by the copy"
    app.close()


def test_reloading_the_configuration_reads_the_new_source(app: OutboxCelery) -> None:
    app.config_from_object(SimpleNamespace(task_default_queue="second"))
    assert isinstance(app.conf, MemoizedSettings)
    assert app.conf.task_default_queue == "second"


def test_a_missing_key_is_not_remembered(
    app: OutboxCelery, source: SimpleNamespace
) -> None:
    for _ in range(2):
        with pytest.raises(AttributeError, match="no_such_setting"):
            app.conf.no_such_setting  # noqa: B018
    source.no_such_setting = 1  # unannounced, yet seen: the miss was not kept
    assert app.conf.no_such_setting == 1


def test_a_plain_celery_app_is_not_touched() -> None:
    plain = Celery("plain", set_as_current=False)
    plain.conf.task_default_queue = "plain"
    assert plain.conf.task_default_queue == "plain"
    assert type(plain.conf) is Settings
    plain.close()
