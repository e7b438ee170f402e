"""Old import paths of the 0.x line: each still imports, warns once, and names the new one."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

from celery_outbox.deprecation import PROMISE, deprecated, deprecation_message

MOVED = [
    ("celery_outbox.relay.events", "celery_outbox.relay.observations", "RelayEvent"),
    ("celery_outbox.relay.waiter", "celery_outbox.engine.waiter", "Waiter"),
    ("celery_outbox.relay.heartbeat", "celery_outbox.engine.heartbeat", "Heartbeat"),
    (
        "celery_outbox.handlers.events",
        "celery_outbox.handlers.observations",
        "HandlerEvent",
    ),
    ("celery_outbox.handlers.store", "celery_outbox.store.handlers", "HandlerStore"),
]


@pytest.mark.parametrize(("old", "new", "name"), MOVED)
def test_a_moved_module_still_imports_and_names_its_new_place(
    old: str, new: str, name: str
) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning) as caught:
        module = importlib.import_module(old)
    [warning] = [w for w in caught if w.category is DeprecationWarning]
    text = str(warning.message)
    assert text.startswith(f"{old} is deprecated: use {new}")
    assert text.endswith(PROMISE)
    assert getattr(module, name) is not None


def test_the_warning_points_at_the_line_that_used_the_old_name() -> None:
    def old_api() -> None:
        deprecated("old_api()", "new_api()")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old_api()
        line = sys._getframe().f_lineno - 1
    [warning] = caught
    assert warning.filename == __file__
    assert warning.lineno == line


def test_one_wording_with_an_optional_note() -> None:
    assert deprecation_message("a", "b") == f"a is deprecated: use b. {PROMISE}"
    assert (
        deprecation_message("a", "b", "Why.")
        == f"a is deprecated: use b. Why. {PROMISE}"
    )
