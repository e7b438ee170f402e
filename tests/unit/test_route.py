"""Where a send_task call goes: the outbox or straight to the broker."""

from __future__ import annotations

import pytest

from celery_outbox.conf import OutboxSettings
from celery_outbox.enqueue import CallContext, Route, choose_route, is_excluded


def call(**overrides: object) -> CallContext:
    values: dict[str, object] = {
        "task_name": "shop.record",
        "task_id": None,
        "running_task_id": None,
        "outbox_in_atomic": False,
    }
    values.update(overrides)
    return CallContext(**values)  # type: ignore[arg-type]


def test_a_web_request_goes_through_the_outbox() -> None:
    assert choose_route(call(), OutboxSettings()) is Route.OUTBOX
    assert choose_route(call(outbox_in_atomic=True), OutboxSettings()) is Route.OUTBOX


@pytest.mark.parametrize(
    ("name", "patterns", "excluded"),
    [
        ("metrics.ping", ("metrics.ping",), True),
        ("metrics.ping", ("metrics.*",), True),
        ("metrics.ping", ("metrics",), False),
        ("shop.record", ("metrics.*", "*.ping"), False),
        ("shop.ping", ("metrics.*", "*.ping"), True),
        ("Shop.Ping", ("shop.*",), False),
    ],
)
def test_exclusions_match_exact_names_and_globs(
    name: str, patterns: tuple[str, ...], excluded: bool
) -> None:
    assert is_excluded(name, patterns) is excluded
    expected = Route.DIRECT if excluded else Route.OUTBOX
    assert (
        choose_route(call(task_name=name), OutboxSettings(exclude_tasks=patterns))
        is expected
    )


def test_task_retry_goes_direct() -> None:
    retry = call(task_id="abc", running_task_id="abc", outbox_in_atomic=True)
    assert choose_route(retry, OutboxSettings()) is Route.DIRECT


def test_a_worker_outside_a_transaction_publishes_directly() -> None:
    child = call(task_id="child", running_task_id="parent")
    assert choose_route(child, OutboxSettings()) is Route.DIRECT
    assert choose_route(child, OutboxSettings(direct_from_worker=False)) is Route.OUTBOX


def test_a_worker_inside_a_transaction_keeps_the_outbox_guarantee() -> None:
    child = call(task_id="child", running_task_id="parent", outbox_in_atomic=True)
    assert choose_route(child, OutboxSettings()) is Route.OUTBOX


def test_a_worker_writing_to_another_database_is_refused_like_a_web_request() -> None:
    # Routed to the outbox, where the transaction guard raises its clear error.
    child = call(task_id="child", running_task_id="parent", other_alias_in_atomic=True)
    assert choose_route(child, OutboxSettings()) is Route.OUTBOX
