"""The ordering decisions and options, as pure values."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import (
    Ignore,
    Reject,
    Retry,
    TimeLimitExceeded,
    WorkerLostError,
)

from celery_outbox.engine.endings import (
    Ending,
    Replaced,
    ending_after_run,
    ending_of_failure,
    ending_of_revoke,
)
from celery_outbox.envelope import StoredMessage
from celery_outbox.exceptions import OutboxValueError
from celery_outbox.ordering.core import Report, ordered_settlement, report_for
from celery_outbox.ordering_options import HEADER, Ordering, Policy, pop_options
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.store.ordering import Follower, run_length, superseded
from tests.integration.builders import envelope


def message(row_id: int, key: str | None, flags: str = "") -> StoredMessage:
    headers: dict[str, Any] = {"id": f"t{row_id}"}
    if flags:
        headers[HEADER] = flags
    return StoredMessage(row_id, 0, envelope(ordering_key=key, headers=headers))


def test_unkeyed_rows_settle_exactly_as_before() -> None:
    settlement = Settlement(
        delete=(1,), dead_letter=(Decision(2, Action.DEAD_LETTER, 0, "x"),)
    )
    assert ordered_settlement(settlement, [message(1, None), message(2, None)], 9) is (
        settlement
    )


def test_a_published_strict_head_is_held_and_a_failed_block_head_blocked() -> None:
    messages = [message(1, "A", "strict"), message(2, "B"), message(3, "C", "skip")]
    settlement = Settlement(
        delete=(1,),
        dead_letter=(
            Decision(2, Action.DEAD_LETTER, 0, "refused"),
            Decision(3, Action.DEAD_LETTER, 0, "refused"),
        ),
    )
    result = ordered_settlement(settlement, messages, 120.0)
    assert result.delete == ()
    assert result.hold == (Decision(1, Action.HOLD, 120.0),)
    assert result.block == (Decision(2, Action.BLOCK, 0.0, "refused"),)
    assert [d.message_id for d in result.dead_letter] == [3]  # skip: as before


def test_a_run_stops_at_a_row_not_ready_and_after_a_strict_row() -> None:
    ready, strict, waiting = (
        Follower(True, False),
        Follower(True, True),
        Follower(False, False),
    )
    assert run_length([ready, ready, waiting, ready], 10) == 2
    assert run_length([ready, strict, ready], 10) == 2
    assert run_length([ready, ready, ready], 2) == 2


def test_only_rows_with_a_newer_row_of_their_group_are_superseded() -> None:
    claimed = [(1, "k", "t"), (5, "k", "t"), (2, "k", "u")]
    assert superseded(claimed, {("k", "t"): 5, ("k", "u"): 2}) == frozenset({1})


def test_every_ending_has_one_report() -> None:
    assert {ending: report_for(ending) for ending in Ending} == {
        Ending.SUCCEEDED: Report.DONE,
        Ending.IGNORED: Report.DONE,
        # A revoke is the caller's decision, as before publish: the key moves on.
        Ending.REVOKED: Report.DONE,
        Ending.EXPIRED: Report.DONE,
        Ending.TERMINATED: Report.DONE,
        Ending.FAILED: Report.FAILED,
        Ending.REJECTED: Report.FAILED,
        Ending.TIMED_OUT: Report.FAILED,
        Ending.REFUSED: Report.FAILED,
        Ending.RETRIED: Report.HELD,
        Ending.REQUEUED: Report.HELD,
        Ending.NOT_REQUEUED: Report.HELD,
        Ending.REPLACED: Report.HELD,
        Ending.LOST: Report.AGAIN,
    }


@pytest.mark.parametrize(
    ("state", "retval", "ending"),
    [
        ("SUCCESS", 7, Ending.SUCCEEDED),
        ("FAILURE", ValueError("x"), Ending.FAILED),
        ("REJECTED", Reject("no", requeue=False), Ending.REJECTED),
        ("REJECTED", Reject("later", requeue=True), Ending.REQUEUED),
        ("IGNORED", Ignore(), Ending.IGNORED),
        ("IGNORED", Replaced("Replaced by new task"), Ending.REPLACED),
        ("RETRY", Retry(when=5), None),  # task_retry tells it
        (None, None, None),  # cut short before a state
    ],
)
def test_task_postrun_tells_the_ending_by_its_state_and_value(
    state: str | None, retval: Any, ending: Ending | None
) -> None:
    assert ending_after_run(state, retval) is ending


def test_a_requeue_of_a_message_acknowledged_as_its_run_began_is_no_requeue() -> None:
    # No acks_late: Celery acknowledged the message before the body ran, and its
    # reject of it does nothing. The task never runs again by Celery's hand.
    requeue = Reject("later", requeue=True)
    assert ending_after_run("REJECTED", requeue, acks_late=False) is Ending.NOT_REQUEUED
    assert ending_after_run("REJECTED", requeue, acks_late=True) is Ending.REQUEUED


class Late:
    """A task's acknowledgement options, as Celery 5.7 binds them."""

    def __init__(self, acks_late: bool, acks_on_timeout: bool | None) -> None:
        self.acks_late = acks_late
        if acks_on_timeout is not None:
            self.acks_on_timeout = acks_on_timeout


@pytest.mark.parametrize(
    ("exception", "task", "ending"),
    [
        (TimeLimitExceeded(2.0), Late(False, None), Ending.TIMED_OUT),
        (TimeLimitExceeded(2.0), Late(True, True), Ending.TIMED_OUT),
        # 5.7 requeues it after the signal; 5.4-5.6 (no acks_on_timeout) do not
        # signal a requeue at all.
        (TimeLimitExceeded(2.0), Late(True, False), Ending.REQUEUED),
        (TimeLimitExceeded(2.0), Late(True, None), Ending.TIMED_OUT),
        (WorkerLostError("signal 9"), Late(False, None), Ending.LOST),
        (ValueError("its own"), Late(False, None), None),  # told by task_postrun
    ],
)
def test_a_failure_in_the_workers_main_process_tells_its_ending(
    exception: BaseException, task: Late, ending: Ending | None
) -> None:
    assert ending_of_failure(exception, task) is ending


def test_a_revoke_tells_how_it_was_revoked() -> None:
    assert ending_of_revoke(terminated=False, expired=False) is Ending.REVOKED
    assert ending_of_revoke(terminated=False, expired=True) is Ending.EXPIRED
    assert ending_of_revoke(terminated=True, expired=False) is Ending.TERMINATED


def test_options_become_a_key_and_a_header_that_reads_back() -> None:
    options = {
        "ordering_key": 42,
        "ordering": "strict",
        "ordering_policy": "skip",
        "x": 1,
    }
    ordering = pop_options(options, "t")
    assert options == {"x": 1}
    assert ordering == Ordering("42", strict=True, policy=Policy.SKIP)
    assert ordering.header == f"strict,skip,row={ordering.row_token}"
    read = Ordering.read("42", {HEADER: ordering.header})
    assert (read, read.row_token) == (ordering, ordering.row_token)
    assert pop_options({"ordering_key": "k"}, "t").header is None
    assert pop_options({}, "t") == Ordering()


def test_each_strict_call_gets_a_row_token_of_its_own() -> None:
    tokens = {
        pop_options({"ordering_key": "k", "ordering": "strict"}, "t").row_token
        for _ in range(3)
    }
    assert len(tokens) == 3 and all(t and len(t) == 32 for t in tokens)
    assert pop_options({"ordering_key": "k"}, "t").row_token is None
    # A header written before tokens, or edited by hand, names no row: the worker's
    # reports fall back to the task id.
    assert Ordering.read("k", {HEADER: "strict"}).row_token is None
    assert Ordering.read("k", {HEADER: "strict,row=%"}).row_token is None


def test_a_coalesce_key_is_the_ordering_key() -> None:
    assert pop_options({"coalesce_key": "obj:1"}, "t") == Ordering(
        "obj:1", coalesce=True
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ordering": "strict"}, "need an ordering_key"),
        ({"ordering_key": "k", "ordering": "fifo"}, "'publish' or 'strict'"),
        ({"ordering_key": "k", "ordering_policy": "drop"}, "'block' or 'skip'"),
        ({"ordering_key": "k", "coalesce_key": "j"}, "differs from ordering_key"),
        ({"ordering_key": "k", "coalesce": "yes"}, "True or False"),
    ],
)
def test_a_mistaken_option_is_refused_by_name(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(OutboxValueError, match=message):
        pop_options(options, "t")
