"""The plugin as a user gets it: loaded through the ``pytest11`` entry point.

Each test runs a small inner test suite in a subprocess. Nothing in the inner suite
imports or registers the plugin: the fixtures come from the entry point.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

INNER_DJANGO_SUITE = """
import pytest
from django.db import transaction

from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import add, record, spawn


def test_enqueued(outbox):
    with transaction.atomic():
        add.delay(1, 2)
    outbox.assert_enqueued(add, args=(1, 2), count=1)
    outbox.assert_not_enqueued("shop.record")


def test_drain(outbox, outbox_drain, outbox_broker):
    with transaction.atomic():
        sent = record.delay("x")
    published = outbox_drain()
    assert [e.task_id for e in published] == [sent.id]
    assert outbox_broker.published == published
    assert outbox.messages == []


@pytest.mark.django_db(transaction=True)
def test_run(outbox_run):
    with transaction.atomic():
        spawn.delay("s")
    runs = outbox_run()
    assert [r.message.task_name for r in runs] == ["shop.spawn", "shop.record"]
    assert sorted(TaskRun.objects.values_list("tag", flat=True)) == ["s", "s-child"]


def test_expectation_is_wrong(outbox):
    with transaction.atomic():
        record.delay("y")
    outbox.assert_enqueued("shop.add", args=(7, 8))
"""


@pytest.fixture
def inner_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inner run uses the test project, with its own databases and queue."""
    run = f"p{uuid.uuid4().hex[:7]}"
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "tests.project.settings")
    monkeypatch.setenv("OUTBOX_TEST_RUN", run)
    monkeypatch.setenv("OUTBOX_TEST_QUEUE", f"celery-outbox-tests-{run}")
    monkeypatch.delenv("OUTBOX_TEST_DB_NAME", raising=False)


def run_inner_suite(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    """Run ``source`` as a test module of its own, in a pytest subprocess."""
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(test_inner=source)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=300)


@pytest.mark.usefixtures("inner_env")
def test_the_fixtures_are_loaded_through_the_entry_point(
    pytester: pytest.Pytester,
) -> None:
    result = run_inner_suite(pytester, INNER_DJANGO_SUITE)
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*Expected shop.add(7, 8, [*][*]) to be enqueued at least once, found it 0 time(s).",
            "*Everything in the outbox (1):",
            "*- shop.record('y')  [[]id=*",
        ]
    )


INNER_PLAIN_SUITE = """
def test_plain():
    assert 1 + 1 == 2


def test_uses_outbox(outbox):
    pass
"""


def test_a_suite_without_django_is_not_affected(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makepyfile(test_plain=INNER_PLAIN_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=120)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*celery-outbox's outbox fixtures need Django settings*"]
    )


def test_without_pytest_django_the_fixtures_say_what_is_missing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    pytester.makepyfile(test_plain=INNER_PLAIN_SUITE)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:django", timeout=120
    )
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        ["*celery-outbox's outbox fixtures need pytest-django*"]
    )


INNER_UNMARKED_SUITE = """
from django.db import connection, transaction

from tests.project.shop.tasks import add


def test_enqueued_without_a_mark(outbox):
    assert connection.settings_dict["NAME"].startswith("test_")
    with transaction.atomic():
        add.delay(1, 2)
    outbox.assert_enqueued(add, args=(1, 2), count=1)
"""


@pytest.mark.usefixtures("inner_env")
def test_a_suite_of_unmarked_tests_gets_the_test_database(
    pytester: pytest.Pytester,
) -> None:
    result = run_inner_suite(pytester, INNER_UNMARKED_SUITE)
    result.assert_outcomes(passed=1)
