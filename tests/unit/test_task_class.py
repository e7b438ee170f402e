"""The app's task class: composed in one place from parts that know nothing of each other."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from celery import Celery, Task
from celery.contrib.django.task import DjangoTask

from celery_outbox import OutboxCelery
from celery_outbox.inbox.task import KEY_HEADER, InboxMixin
from celery_outbox.ordering.task import OrderingMixin
from celery_outbox.task import OutboxTask


def test_the_app_runs_its_tasks_on_the_composed_class() -> None:
    app = OutboxCelery("composed", set_as_current=False)

    @app.task(name="composed.noop")
    def noop() -> None: ...

    assert isinstance(noop, OutboxTask)
    assert isinstance(noop, InboxMixin) and isinstance(noop, OrderingMixin)
    assert isinstance(noop, DjangoTask)


def test_the_parts_are_independent_of_each_other_and_of_celery() -> None:
    for part in (InboxMixin, OrderingMixin):
        assert part.__bases__ == (object,)
    assert not issubclass(InboxMixin, OrderingMixin)
    assert not issubclass(OrderingMixin, InboxMixin)
    assert OutboxTask.__bases__[:2] == (OrderingMixin, InboxMixin)


class _Sent(Task):  # type: ignore[type-arg]
    """Celery's Task whose ``apply_async`` returns the options it was given."""

    def apply_async(self, *args: Any, **options: Any) -> Any:
        return options


@pytest.mark.parametrize(
    "bases",
    [(OrderingMixin, InboxMixin, _Sent), (InboxMixin, OrderingMixin, _Sent)],
    ids=["ordering-then-inbox", "inbox-then-ordering"],
)
def test_each_part_adds_its_options_whatever_the_order_of_the_parts(
    bases: tuple[type, ...],
) -> None:
    app = Celery("parts", set_as_current=False)
    base = type("Probe", bases, {})

    @app.task(
        name="parts.probe", base=base, ordering="strict", inbox=True, shared=False
    )
    def probe(order_id: int) -> None: ...

    options = probe.apply_async((1,), ordering_key="order:1", inbox_key="pay:1")
    assert options["ordering"] == "strict"  # the ordering part's default
    assert options["headers"] == {KEY_HEADER: "pay:1"}  # the inbox part's header
    # A call's own option wins over the task's default.
    assert probe.apply_async((1,), ordering_key="k", ordering="publish")[
        "ordering"
    ] == ("publish")


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("celery_outbox.inbox", "InboxTask"),
        ("celery_outbox.inbox.task", "InboxTask"),
        ("celery_outbox.ordering.task", "OrderedTask"),
    ],
)
def test_the_0_1_names_of_the_task_class_are_gone(module: str, name: str) -> None:
    # 0.2 removed them: celery_outbox.task.OutboxTask is the one task class.
    with pytest.raises(AttributeError, match=name):
        getattr(importlib.import_module(module), name)
