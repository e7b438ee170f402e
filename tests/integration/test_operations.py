"""Operator methods of the store (summary, retry, dead letters), on every database."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections, transaction
from django.test import override_settings

from celery_outbox.durations import parse_duration, parse_moment
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.store import DeadLetterFilter, Stores
from celery_outbox.store.operator import OperatorQueries
from celery_outbox.tasks import purge_dead_letters

from .builders import dead_letter_due, envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


def add(store: OperatorQueries, *tags: str, **overrides: object) -> list[str]:
    """Commit one row per tag; returns their task ids."""
    envelopes = [envelope(tag, **overrides) for tag in tags]
    with transaction.atomic(using=store.alias):
        Stores(store.alias).writer().insert(envelopes)
    return [e.task_id for e in envelopes]


def row_id(store: OperatorQueries, task_id: str) -> int:
    return int(
        OutboxMessage.objects.using(store.alias)
        .values_list("id", flat=True)
        .get(task_id=task_id)
    )


def fail_once(store: OperatorQueries, delay: float = 600.0) -> int:
    """Claim the oldest due row and refuse it once: it waits ``delay`` for its retry."""
    claim = Stores(store.alias).relay().claim(1, 30)
    row = claim.messages[0]
    Stores(store.alias).relay().settle(
        claim.token,
        Settlement(retry=(Decision(row.id, Action.RETRY, delay, "NotFound: q"),)),
    )
    return row.id


def kill(
    store: OperatorQueries, *tags: str, task_name: str = "shop.record"
) -> list[str]:
    """Commit rows and dead-letter them the way the relay does; returns their task ids.

    The relay claims the oldest due rows: call this before adding rows that must stay.
    """
    ids = add(
        store,
        *tags,
        task_name=task_name,
        headers={"task": task_name, "compression": None},
    )
    dead_letter_due(Stores(store.alias).relay(), len(tags), "PreconditionFailed: big")
    return ids


def dead_id(alias: str, task_id: str) -> int:
    return int(
        DeadLetter.objects.using(alias)
        .values_list("id", flat=True)
        .get(task_id=task_id)
    )


def age_dead_letters(alias: str, days: float, *task_ids: str) -> None:
    """Pretend these dead letters died ``days`` ago."""
    DeadLetter.objects.using(alias).filter(task_id__in=task_ids).update(
        dead_at=datetime.now(timezone.utc) - timedelta(days=days)
    )


def test_summary_splits_the_backlog(alias: str) -> None:
    store = Stores(alias).operator()
    kill(store, "d")
    add(store, "a", "b")
    add(store, "c", task_name="shop.add", queue="other")
    fail_once(store)  # a: waiting for its retry
    assert (
        len(Stores(alias).relay().claim(1, 30).messages) == 1
    )  # b: leased, in flight; c is due

    summary = store.summary()

    assert (
        summary.pending,
        summary.due,
        summary.retrying,
        summary.in_flight,
        summary.dead,
    ) == (3, 1, 1, 1, 1)
    assert summary.oldest_pending_seconds is not None
    assert summary.oldest_pending_seconds >= 0
    groups = [(g.task_name, g.queue, g.pending, g.due) for g in summary.backlog]
    assert groups == [("shop.record", "celery", 2, 0), ("shop.add", "other", 1, 1)]
    assert all(g.oldest_seconds is not None for g in summary.backlog)


def test_summary_of_an_empty_outbox(alias: str) -> None:
    summary = Stores(alias).operator().summary()
    assert (summary.pending, summary.dead, summary.backlog) == (0, 0, ())
    assert summary.oldest_pending_seconds is None


def test_retry_now_makes_rows_due_but_leaves_leased_rows_alone(alias: str) -> None:
    store = Stores(alias).operator()
    add(store, "waiting", "leased")
    waiting = fail_once(store)
    leased = Stores(alias).relay().claim(1, 30).messages[0].id
    assert Stores(alias).relay().claim(10, 30).messages == ()

    assert store.retry_now([waiting, leased, 999_999]) == [waiting]

    again = Stores(alias).relay().claim(10, 30).messages
    assert [(m.id, m.attempts) for m in again] == [(waiting, 1)]
    assert store.summary().due == 0  # both are leased now


def test_move_to_dead_letters_keeps_the_message_and_the_reason(alias: str) -> None:
    store = Stores(alias).operator()
    leased_task, free_task = add(store, "leased", "free")
    leased, free = row_id(store, leased_task), row_id(store, free_task)
    assert [m.id for m in Stores(alias).relay().claim(1, 30).messages] == [leased]

    moved = store.move_to_dead_letters([free, leased], "moved by ada from the admin")

    assert moved == [free]
    dead = DeadLetter.objects.using(alias).get()
    assert (dead.task_id, dead.original_id, dead.last_error, dead.attempts) == (
        free_task,
        free,
        "moved by ada from the admin",
        0,
    )
    assert bytes(dead.body) == envelope("free").body
    assert store.stats().pending == 1
    assert store.stats().in_flight == 1


def test_replay_by_id_puts_the_same_message_back_due_now(alias: str) -> None:
    store = Stores(alias).operator()
    (task_id,) = kill(store, "poison")
    other = kill(store, "other")
    before = DeadLetter.objects.using(alias).get(task_id=task_id)

    report = store.replay_dead_letters(DeadLetterFilter(ids=(dead_id(alias, task_id),)))

    assert (report.matched, report.replayed, report.dry_run) == (1, 1, False)
    assert dict(report.by_task) == {"shop.record": 1}
    assert (
        list(DeadLetter.objects.using(alias).values_list("task_id", flat=True)) == other
    )
    (message,) = Stores(alias).relay().claim(10, 30).messages
    assert message.attempts == 0
    assert message.envelope.task_id == task_id
    assert message.envelope.body == bytes(before.body)
    assert message.envelope.headers["task"] == "shop.record"


def test_replay_dry_run_changes_nothing(alias: str) -> None:
    store = Stores(alias).operator()
    kill(store, "a", "b", task_name="billing.charge")
    kill(store, "c", task_name="shop.add")

    report = store.replay_dead_letters(DeadLetterFilter(task="billing.*"), dry_run=True)

    assert (report.matched, report.replayed, report.dry_run) == (2, 0, True)
    assert dict(report.by_task) == {"billing.charge": 2}
    assert store.stats().dead == 3
    assert store.stats().pending == 0


def test_replay_by_glob_and_time_window(alias: str) -> None:
    store = Stores(alias).operator()
    old = kill(store, "old", task_name="billing.charge")
    recent = kill(store, "recent", task_name="billing.refund")
    kill(store, "elsewhere", task_name="shop.add")
    age_dead_letters(alias, 3, *old)
    now = datetime.now(timezone.utc)

    in_window = store.replay_dead_letters(
        DeadLetterFilter(task="billing.*", since=now - timedelta(hours=1))
    )
    assert (in_window.replayed, dict(in_window.by_task)) == (1, {"billing.refund": 1})
    assert [
        m.envelope.task_id for m in Stores(alias).relay().claim(10, 30).messages
    ] == recent

    older = store.replay_dead_letters(
        DeadLetterFilter(until=now - timedelta(days=1), since=now - timedelta(days=4))
    )
    assert older.replayed == 1
    assert [
        m.envelope.task_id for m in Stores(alias).relay().claim(10, 30).messages
    ] == old
    assert store.replay_dead_letters(DeadLetterFilter(task="nothing.*")).matched == 0
    assert store.stats().dead == 1


def test_replay_in_chunks_reports_progress(alias: str) -> None:
    store = Stores(alias).operator()
    task_ids = kill(store, "a", "b", "c", "d", "e")
    seen: list[tuple[int, int]] = []

    report = store.replay_dead_letters(
        DeadLetterFilter(),
        chunk_size=2,
        progress=lambda done, total: seen.append((done, total)),
    )

    assert report.replayed == 5
    assert seen == [(2, 5), (4, 5), (5, 5)]
    assert sorted(
        m.envelope.task_id for m in Stores(alias).relay().claim(10, 30).messages
    ) == sorted(task_ids)
    assert store.stats().dead == 0


def test_replay_takes_only_what_matched_when_it_started(alias: str) -> None:
    # The relay may refuse the replayed rows again while the replay runs (the queue
    # is still missing, say): their new dead letters must not be replayed too, or
    # the two chase each other for ever.
    store = Stores(alias).operator()
    kill(store, "a", "b", "c", "d")
    seen: list[tuple[int, int]] = []

    def relay_refuses_meanwhile(done: int, total: int) -> None:
        seen.append((done, total))
        dead_letter_due(Stores(alias).relay(), 10)
        assert len(seen) <= 2, f"replay still running: {seen}"

    report = store.replay_dead_letters(
        DeadLetterFilter(), chunk_size=2, progress=relay_refuses_meanwhile
    )

    assert (report.matched, report.replayed) == (4, 4)
    assert seen == [(2, 4), (4, 4)]
    assert store.stats().dead == 4  # all refused again, none replayed twice


def test_an_empty_id_list_matches_no_dead_letter(alias: str) -> None:
    # The admin passes the ids it found; a selection already replayed or deleted
    # by someone else leaves none, which must not mean "every dead letter".
    store = Stores(alias).operator()
    kill(store, "a", "b")
    report = store.replay_dead_letters(DeadLetterFilter(ids=()))
    assert (report.matched, report.replayed) == (0, 0)
    assert store.stats().dead == 2


def test_task_globs_tell_capitals_apart(alias: str) -> None:
    # MySQL's default collation folds case: "shop.Export" must still not select
    # "shop.export", in a replay or in a purge.
    store = Stores(alias).operator()
    kill(store, "upper", task_name="shop.Export")
    kill(store, "lower", task_name="shop.export")
    report = store.replay_dead_letters(DeadLetterFilter(task="shop.export"))
    assert (report.replayed, report.by_task) == (1, {"shop.export": 1})
    left = DeadLetter.objects.using(alias).values_list("task_name", flat=True)
    assert list(left) == ["shop.Export"]

    kill(store, "lower-again", task_name="shop.export")
    DeadLetter.objects.using(alias).update(
        dead_at=datetime.now(timezone.utc) - timedelta(days=2)
    )
    purged = store.purge_dead_letters(86400, task="shop.Export")
    left = DeadLetter.objects.using(alias).values_list("task_name", flat=True)
    assert (purged.deleted, list(left)) == (1, ["shop.export"])


def test_purge_deletes_old_dead_letters_in_chunks(alias: str) -> None:
    store = Stores(alias).operator()
    old = kill(store, "a", "b", "c", task_name="billing.charge")
    old_other = kill(store, "d", task_name="shop.add")
    kill(store, "fresh", task_name="billing.charge")
    age_dead_letters(alias, 10, *old, *old_other)

    dry = store.purge_dead_letters(7 * 86400, dry_run=True)
    assert (dry.matched, dry.deleted, dry.dry_run) == (4, 0, True)
    assert store.stats().dead == 5

    only_billing = store.purge_dead_letters(7 * 86400, task="billing.*", chunk_size=2)
    assert (only_billing.matched, only_billing.deleted) == (3, 3)
    assert sorted(
        DeadLetter.objects.using(alias).values_list("task_name", flat=True)
    ) == ["billing.charge", "shop.add"]
    assert store.purge_dead_letters(7 * 86400).deleted == 1
    assert store.purge_dead_letters(7 * 86400).deleted == 0
    assert store.stats().dead == 1


def test_delete_dead_letters(alias: str) -> None:
    store = Stores(alias).operator()
    first, second = kill(store, "a", "b")
    target = dead_id(alias, first)
    assert store.delete_dead_letters([target, 999_999]) == [target]
    assert list(DeadLetter.objects.using(alias).values_list("task_id", flat=True)) == [
        second
    ]


def test_the_retention_task_applies_the_setting(alias: str) -> None:
    store = Stores(alias).operator()
    old = kill(store, "old")
    kill(store, "fresh")
    age_dead_letters(alias, 40, *old)
    with override_settings(CELERY_OUTBOX_DATABASE=alias):
        assert purge_dead_letters.apply().get() == {
            "deleted": 0,
            "retention_seconds": None,
        }
        assert store.stats().dead == 2
        with override_settings(CELERY_OUTBOX_DEAD_LETTER_RETENTION="30d"):
            assert purge_dead_letters.apply().get() == {
                "deleted": 1,
                "retention_seconds": 30 * 86400.0,
                # The handler outboxes' dead letters expire by the same setting.
                "handler_deleted": 0,
            }
    assert store.stats().dead == 1


# -- the commands ----------------------------------------------------------------


@pytest.fixture
def on_alias(alias: str) -> Iterator[str]:
    """Point the outbox (and so the commands) at each database in turn."""
    with override_settings(CELERY_OUTBOX_DATABASE=alias):
        yield alias


def outbox(*args: str) -> tuple[str, str]:
    """Run ``manage.py outbox ...``; returns (stdout, stderr)."""
    out, err = StringIO(), StringIO()
    call_command("outbox", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_durations_and_moments() -> None:
    assert parse_duration("90") == 90.0
    assert parse_duration("30m") == 1800.0
    assert parse_duration("2h") == 7200.0
    assert parse_duration("7d") == 7 * 86400.0
    assert parse_duration(45) == 45.0
    for bad in ("", "7 days", "-3h", "0", "h"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    now = datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)
    assert parse_moment("2h", now) == datetime(2024, 5, 1, 10, 0, tzinfo=timezone.utc)
    assert parse_moment("2024-04-30T08:00:00", now) == datetime(
        2024, 4, 30, 8, 0, tzinfo=timezone.utc
    )
    with pytest.raises(ValueError, match="neither an ISO datetime"):
        parse_moment("yesterday", now)


def test_ambiguous_durations_and_moments_are_refused_with_the_ways_to_say_them() -> (
    None
):
    assert parse_duration("2H") == 7200.0  # capitals are fine where they say one thing
    with pytest.raises(ValueError, match=r"ambiguous: write 6m for minutes"):
        parse_duration("6M")
    now = datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)
    # A compact date is a date to its writer and 232 days of seconds to the parser.
    with pytest.raises(ValueError, match=r"2024-05-01.*20240501s"):
        parse_moment("20240501", now)
    assert parse_moment("20240501s", now) == now - timedelta(seconds=20240501)
    assert parse_moment("3600", now) == datetime(2024, 5, 1, 11, 0, tzinfo=timezone.utc)


def test_the_since_option_refuses_a_compact_date_before_touching_anything() -> None:
    with pytest.raises(CommandError, match="ambiguous"):
        outbox("tasks", "replay", "--since", "20240501", "--dry-run")


def test_stats_json_keeps_its_keys_and_adds_the_breakdown(on_alias: str) -> None:
    store = Stores(on_alias).operator()
    kill(store, "x", task_name="shop.add")
    add(store, "a", "b")
    fail_once(store)

    data = json.loads(outbox("tasks", "stats", "--format", "json", "--top", "3")[0])

    assert {"pending", "due", "dead", "oldest_pending_seconds", "in_flight"} <= set(
        data
    )
    assert (data["pending"], data["due"], data["dead"], data["retrying"]) == (
        2,
        1,
        1,
        1,
    )
    assert data["backlog"][0]["task_name"] == "shop.record"
    assert data["backlog"][0]["pending"] == 2
    assert data["top_failures"]["retrying"][0]["task_name"] == "shop.record"
    assert data["top_failures"]["dead"] == [{"task_name": "shop.add", "dead": 1}]


def test_stats_text_and_prometheus(on_alias: str) -> None:
    store = Stores(on_alias).operator()
    kill(store, "x", task_name='odd"name')
    add(store, "a")

    text = outbox("tasks", "stats", "--top", "2")[0]
    assert "pending   1" in text
    assert "dead      1" in text
    assert 'odd"name  1' in text

    prom = outbox("tasks", "stats", "--format", "prometheus", "--top", "2")[0]
    assert "# TYPE celery_outbox_pending gauge" in prom
    assert "\ncelery_outbox_pending 1\n" in prom
    assert "celery_outbox_dead 1" in prom
    assert 'celery_outbox_backlog{task_name="shop.record",queue="celery"} 1' in prom
    assert 'celery_outbox_dead_by_task{task_name="odd\\"name"} 1' in prom


def test_stats_watch_refreshes(on_alias: str) -> None:
    out = outbox(
        "tasks", "stats", "--format", "json", "--watch", "0.01", "--iterations", "3"
    )[0]
    assert [json.loads(line)["pending"] for line in out.splitlines()] == [0, 0, 0]


def test_replay_command_window_without_use_tz(on_alias: str) -> None:
    # MySQL and SQLite take only naive datetimes when USE_TZ is off.
    kill(Stores(on_alias).operator(), "a")
    with override_settings(USE_TZ=False):
        out = outbox(
            "tasks", "replay", "--since", "1h", "--until", "2999-01-01T00:00:00"
        )[0]
    assert "replayed 1" in out


def test_command_values_that_only_look_like_numbers_are_refused(
    on_alias: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(CommandError, match="positive integers, got '²'"):
        outbox("tasks", "replay", "²")
    for value in ("nan", "inf"):
        with pytest.raises(SystemExit):  # argparse's usage error, as for any bad value
            outbox("tasks", "stats", "--watch", value, "--iterations", "1")
        assert "must be a positive, finite number" in capsys.readouterr().err


def test_replay_command_dry_run_then_real(on_alias: str) -> None:
    store = Stores(on_alias).operator()
    kill(store, "a", "b", task_name="billing.charge")
    kill(store, "c", task_name="shop.add")

    out = outbox("tasks", "replay", "--name", "billing.*", "--dry-run")[0]
    assert out.strip() == "would replay 2 dead letter(s): billing.charge 2 (dry run)"
    assert store.stats().dead == 3

    out = outbox("tasks", "replay", "--name", "billing.*", "--since", "1h")[0]
    assert out.strip() == "replayed 2 dead letter(s) into the outbox: billing.charge 2"
    assert (store.stats().dead, store.stats().pending) == (1, 2)


def test_replay_command_by_id_with_a_progress_bar(on_alias: str) -> None:
    store = Stores(on_alias).operator()
    task_ids = kill(store, "a", "b", "c", "d", "e")
    ids = [str(dead_id(on_alias, t)) for t in task_ids]

    out, err = outbox("tasks", "replay", *ids, "--chunk-size", "2")

    assert "replayed 5 dead letter(s)" in out
    assert err.startswith("\rreplaying:")  # tqdm, redrawn in place on stderr
    last = err.rstrip().split("\r")[-1]
    assert "100%" in last
    assert "5/5" in last
    assert store.stats().pending == 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("replay",), "say which dead letters to replay"),
        (("replay", "abc"), "dead-letter ids are positive integers, got 'abc'"),
        (("replay", "--since", "yesterday"), "--since: 'yesterday' is neither"),
        (("replay", "--since", "1h", "--until", "2h"), "must be before --until"),
        (("replay", "--all", "--name", "x"), "--all cannot be combined"),
        (("purge",), "tasks purge: say which: --until WHEN, --name GLOB, or --all"),
        (("purge", "--all", "--until", "1d"), "--all cannot be combined"),
        (("purge", "--until", "soon"), "--until: 'soon' is neither"),
    ],
)
def test_bad_arguments_name_the_problem(args: tuple[str, ...], message: str) -> None:
    with pytest.raises(CommandError, match=message.replace("(", r"\(")):
        outbox("tasks", *args)


def test_purge_command(on_alias: str) -> None:
    store = Stores(on_alias).operator()
    old = kill(store, "a", "b")
    kill(store, "fresh")
    age_dead_letters(on_alias, 10, *old)

    out = outbox("tasks", "purge", "--until", "7d", "--dry-run")[0]
    assert out.strip() == "would delete 2 dead letter(s) older than 7d (dry run)"
    assert outbox("tasks", "purge", "--until", "7d", "--name", "other.*")[
        0
    ].strip() == ("deleted 0 dead letter(s) of other.* older than 7d")
    assert outbox("tasks", "purge", "--until", "7d", "--chunk-size", "1")[
        0
    ].strip() == ("deleted 2 dead letter(s) older than 7d")
    assert store.stats().dead == 1


def test_replaying_ids_that_match_no_dead_letter_fails_after_replaying_the_rest(
    on_alias: str,
) -> None:
    store = Stores(on_alias).operator()
    [task_id] = kill(store, "a")
    real = str(dead_id(on_alias, task_id))
    with pytest.raises(CommandError) as raised:
        outbox("tasks", "replay", real, "999999998", "999999999")
    assert "replayed 1 dead letter(s)" in str(raised.value)
    assert "2 of the 3 id(s) given match no dead letter" in str(raised.value)
    assert (store.stats().dead, store.stats().pending) == (0, 1)


def test_purge_all_deletes_every_dead_letter_whatever_its_age(on_alias: str) -> None:
    store = Stores(on_alias).operator()
    kill(store, "just", "died")
    assert outbox("tasks", "purge", "--all", "--dry-run")[0].strip() == (
        "would delete 2 dead letter(s) of any age (dry run)"
    )
    assert (
        outbox("tasks", "purge", "--all")[0].strip()
        == "deleted 2 dead letter(s) of any age"
    )
    assert store.stats().dead == 0


@pytest.mark.parametrize("when", ["99999999d", "20240501w", "1" + "0" * 20 + "s"])
def test_a_moment_too_far_back_is_refused_with_a_clear_error(when: str) -> None:
    with pytest.raises(CommandError, match=r"--since: .* too far back"):
        outbox("tasks", "replay", "--since", when, "--dry-run")


@pytest.fixture
def unmigrated_sqlite() -> Iterator[str]:
    """The SQLite alias with its outbox table moved away (autocommit DDL), then back.

    The app is named: other tests of a session make apps of their own, and a relay
    that cannot tell which app to use says so before it looks at any table.
    """
    with connections["sqlite"].cursor() as cursor:
        cursor.execute("ALTER TABLE celery_outbox_message RENAME TO hidden_outbox")
    try:
        with override_settings(
            CELERY_OUTBOX_DATABASE="sqlite",
            CELERY_OUTBOX_APP="tests.project.celery_app.app",
        ):
            yield "sqlite"
    finally:
        with connections["sqlite"].cursor() as cursor:
            cursor.execute("ALTER TABLE hidden_outbox RENAME TO celery_outbox_message")


@pytest.mark.parametrize(
    "command", [("tasks", "stats"), ("health",), ("relay", "--until-empty")]
)
def test_commands_on_a_database_without_the_tables_say_to_migrate(
    unmigrated_sqlite: str, command: tuple[str, ...]
) -> None:
    with pytest.raises(CommandError) as raised:
        outbox(*command)
    message = str(raised.value)
    assert "table missing on outbox database 'sqlite': celery_outbox_message" in message
    assert "python manage.py migrate celery_outbox --database sqlite" in message
