"""Every spelling of 0.1 still works for the 0.x line, and warns naming the new one.

One test per old spelling: it does its work (asserted on what a user sees) and
raises a DeprecationWarning, with the same sentence on stderr, naming the
``outbox <lane> <verb>`` that replaces it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import override_settings

from celery_outbox.handlers.models import HandlerDeadLetter
from celery_outbox.handlers.registry import Category, Registry, registry
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.store import Stores

from .builders import keyed
from .test_events import delete_topology
from .test_handler_operations import dead_letter
from .test_operations import age_dead_letters, kill
from .test_ordering_admin import block_heads, write

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

ALIAS = "default"
APP = "tests.project.celery_app.app"


def old(*args: str, new: str) -> str:
    """Run an old spelling; check it warns and says ``new`` on stderr; its stdout."""
    out, err = StringIO(), StringIO()
    with pytest.warns(DeprecationWarning, match=re.escape(f"use '{new}'")):
        call_command(*args, stdout=out, stderr=err)
    assert f"is deprecated: use '{new}'." in err.getvalue()
    return out.getvalue()


# -- tasks ------------------------------------------------------------------------


def test_outbox_stats() -> None:
    kill(Stores(ALIAS).operator(), "a")
    out = old("outbox", "stats", "--format", "json", new="outbox tasks stats")
    assert json.loads(out)["dead"] == 1


def test_outbox_inspect() -> None:
    [task_id] = kill(Stores(ALIAS).operator(), "a")
    out = old("outbox", "inspect", task_id, new="outbox tasks inspect")
    assert "dead letter" in out and task_id in out


def test_outbox_replay() -> None:
    kill(Stores(ALIAS).operator(), "a", "b")
    out = old("outbox", "replay", "--task", "shop.*", new="outbox tasks replay")
    assert "replayed 2 dead letter(s)" in out
    assert OutboxMessage.objects.using(ALIAS).count() == 2


def test_outbox_purge_with_no_selector_applies_the_retention() -> None:
    old_ones = kill(Stores(ALIAS).operator(), "a")
    kill(Stores(ALIAS).operator(), "fresh")
    age_dead_letters(ALIAS, 1, *old_ones)
    with override_settings(CELERY_OUTBOX_DEAD_LETTER_RETENTION=3600):
        out = old(
            "outbox",
            "purge",
            new="outbox tasks purge --until 7d (or --name GLOB, or --all)",
        )
    assert out.strip() == "deleted 1 dead letter(s) older than 1h"
    assert DeadLetter.objects.using(ALIAS).count() == 1


# -- handler outboxes -------------------------------------------------------------


@pytest.fixture
def name() -> str:
    return f"test.{uuid.uuid4().hex[:8]}"


def test_outbox_handler_stats() -> None:
    out = old(
        "outbox", "handler-stats", "--database", ALIAS, new="outbox handlers stats"
    )
    assert f"database {ALIAS}:" in out and "dead letters: 0" in out


def test_outbox_handler_replay(name: str) -> None:
    dead_letter(ALIAS, name, Registry(), "p")
    out = old(
        "outbox",
        "handler-replay",
        "--category",
        name,
        "--database",
        ALIAS,
        new="outbox handlers replay",
    )
    assert f"{ALIAS}: 1 dead letter(s) replayed" in out
    assert not HandlerDeadLetter.objects.using(ALIAS).exists()


@pytest.fixture
def registered(name: str) -> Iterator[str]:
    """``name`` registered in this process (a pause refuses a name no one knows)."""
    registry.add(Category(name, lambda **kw: None))
    yield name
    registry.remove(name)


@pytest.mark.parametrize("verb", ["pause", "resume"])
def test_outbox_pause_and_resume(name: str, verb: str, registered: str) -> None:
    if verb == "resume":
        call_command("outbox", "handlers", "pause", "--name", name, stdout=StringIO())
    out = old(
        "outbox",
        verb,
        "--category",
        name,
        "--database",
        ALIAS,
        new=f"outbox handlers {verb}",
    )
    assert f"category {name!r} on {ALIAS}: {verb}d" in out


def test_outbox_handlers_without_a_verb_runs_the_processor() -> None:
    out = old(
        "outbox",
        "handlers",
        "--until-empty",
        "--database",
        ALIAS,
        new="outbox handlers run",
    )
    assert "handler processor stopped" in out


# -- ordered keys -----------------------------------------------------------------


@pytest.fixture
def blocked() -> None:
    """Key A's head blocked by a refusal; a second row of A waits behind it."""
    store = Stores(ALIAS).ordering()
    write(store, keyed("a0", "A"), keyed("a1", "A"))
    block_heads(store, 1, "refused")


def test_outbox_ordering_stats(blocked: None) -> None:
    out = old("outbox_ordering", "stats", new="outbox ordering stats")
    assert "blocked A: shop.record" in out


def test_outbox_ordering_retry(blocked: None) -> None:
    out = old("outbox_ordering", "retry", "A", new="outbox ordering retry --key KEY")
    assert "retry: the head of 'A'" in out
    assert not Stores(ALIAS).ordering().blocked_heads()


@pytest.mark.parametrize("verb", ["skip", "dead-letter"])
def test_outbox_ordering_skip_and_dead_letter(blocked: None, verb: str) -> None:
    out = old("outbox_ordering", verb, "A", new="outbox ordering skip --key KEY")
    assert "skip: the head of 'A'" in out
    assert DeadLetter.objects.using(ALIAS).get().ordering_key == "A"


# -- events -----------------------------------------------------------------------


@pytest.fixture
def billing() -> Iterator[None]:
    """Service ``billing``'s topology, declared on its own exchange, then deleted."""
    exchange = f"test-old-{uuid.uuid4().hex[:8]}"
    with override_settings(
        CELERY_OUTBOX_EVENTS_EXCHANGE=exchange, CELERY_OUTBOX_EVENTS_MAX_RETRIES=1
    ):
        call_command(
            "outbox", "events", "--app", APP, "--service", "billing", "declare",
            stdout=StringIO(),
        )  # fmt: skip
        yield
    delete_topology(exchange, ["billing"], 1, ())


@pytest.mark.parametrize(
    ("action", "new", "said"),
    [
        (("count",), "outbox events stats", "0"),
        (("list",), "outbox events inspect", ""),
        (("replay", "--all"), "outbox events replay", "replayed 0, left 0"),
        (("purge",), "outbox events purge --all", "purged 0"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, tuple) else None,
)
def test_outbox_events_archive(
    billing: None, action: tuple[str, ...], new: str, said: str
) -> None:
    out = old(
        "outbox", "events", "--app", APP, "--service", "billing", "archive", *action,
        new=new,
    )  # fmt: skip
    assert said in out if said else out.strip() == ""
