"""What Celery's worker reads from a message the outbox holds, for the installed Celery.

No fakes: the real ``OutboxCelery.send_task`` builds the message (Celery's own
``as_task_v2``) into the outbox's capturing producer, and Celery's own worker
``Request`` reads it back.

* The ETA: the outbox must hold the task until the moment that worker would run it,
  whatever the app's timezone and however the ETA was given.
* The request: a revoke before publish stores ``REVOKED`` with the request the
  worker would have built from the message (``celery_outbox.revoke.worker_request``),
  which a chord needs to return the member's part.

Both are the worker's reading, which Celery has changed between releases, so this
file is one of the contract tests every Celery line of the matrix runs
(``noxfile.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from kombu import Message

from celery_outbox import OutboxCelery
from celery_outbox.enqueue import CapturingProducer
from celery_outbox.envelope import Envelope
from celery_outbox.revoke import worker_request
from celery_outbox.scheduling import moment

#: The app's timezones: far ahead of UTC, behind it, and UTC itself.
ZONES = ("Asia/Tokyo", "America/New_York", "UTC")
HOUR = 3600.0


@pytest.fixture(
    params=[(zone, utc) for zone in ZONES for utc in (True, False)],
    ids=lambda param: f"{param[0]}-enable_utc={param[1]}",
)
def app(request: pytest.FixtureRequest) -> Iterator[OutboxCelery]:
    zone, enable_utc = request.param
    app = OutboxCelery(f"eta-{zone}", set_as_current=False)
    app.conf.update(timezone=zone, enable_utc=enable_utc, task_serializer="json")

    @app.task(name="eta.probe", shared=False)
    def probe() -> None:
        """Never runs: its messages are only built and read."""

    yield app
    app.close()


def send(app: OutboxCelery, **options: Any) -> Envelope:
    """What ``probe.apply_async(**options)`` writes to the outbox (nothing stored)."""
    captured: list[Envelope] = []

    def sink(envelopes: Sequence[Envelope]) -> Mapping[str, str]:
        captured.extend(envelopes)
        return {}

    producer = CapturingProducer(
        connection=app.connection_for_write(),
        default_serializer=app.conf.task_serializer,
        default_compression=None,
        sink=sink,
        zone=app.timezone,
    )
    app.tasks["eta.probe"].apply_async(producer=producer, **options)
    (envelope,) = captured
    return envelope


def worker_reading(app: OutboxCelery, envelope: Envelope) -> Any:
    """The message as Celery's worker takes it in: its own ``Request``."""
    from celery.worker.request import Request

    message = Message(
        body=envelope.body,
        content_type=envelope.content_type,
        content_encoding=envelope.content_encoding,
        headers=dict(envelope.headers),
        properties=dict(envelope.properties),
        delivery_info={
            "exchange": envelope.exchange,
            "routing_key": envelope.routing_key,
        },
    )
    return Request(
        message, app=app, task=app.tasks["eta.probe"], utc=app.uses_utc_timezone()
    )


def naive_utc(seconds: float) -> datetime:
    return (datetime.now(timezone.utc) + timedelta(seconds=seconds)).replace(
        tzinfo=None
    )


@pytest.mark.parametrize(
    "given",
    [
        pytest.param(lambda: {"eta": naive_utc(2 * HOUR)}, id="naive-datetime"),
        pytest.param(lambda: {"eta": naive_utc(2 * HOUR).isoformat()}, id="naive-text"),
        pytest.param(
            lambda: {"eta": datetime.now(timezone.utc) + timedelta(hours=2)},
            id="aware",
        ),
        pytest.param(lambda: {"countdown": 2 * HOUR}, id="countdown"),
    ],
)
def test_the_outbox_holds_a_task_until_the_moment_the_worker_runs_it(
    app: OutboxCelery, given: Any
) -> None:
    envelope = send(app, **given())
    request = worker_reading(app, envelope)
    now = datetime.now(timezone.utc)
    worker_due_in = (request.eta - now).total_seconds()
    assert envelope.due_in is not None, (
        f"not scheduled, but the worker would hold it {worker_due_in:.0f} s"
    )
    # The outbox counted from the call, a moment before `now`.
    assert envelope.due_in == pytest.approx(worker_due_in, abs=2.0)
    assert moment(envelope.headers["eta"], app.timezone) == request.eta


def test_a_naive_eta_the_worker_sees_as_past_is_published_at_once(
    app: OutboxCelery,
) -> None:
    # Naive "now - 1 h": if read in Tokyo or New York it would be hours away.
    envelope = send(app, eta=naive_utc(-HOUR))
    request = worker_reading(app, envelope)
    assert request.eta < datetime.now(timezone.utc)
    assert envelope.due_in is None


def test_expires_is_read_as_the_worker_reads_it(app: OutboxCelery) -> None:
    # Expiring (naive, UTC) before its ETA: no worker would run it.
    envelope = send(app, eta=naive_utc(2 * HOUR), expires=naive_utc(HOUR))
    request = worker_reading(app, envelope)
    assert request.expires < request.eta
    assert moment(envelope.headers["expires"], app.timezone) == request.expires
    assert envelope.dead_reason.startswith("expired before due")
    kept = send(app, eta=naive_utc(2 * HOUR), expires=naive_utc(3 * HOUR))
    assert kept.dead_reason == ""


def test_a_revoke_before_publish_stores_the_request_the_worker_would_build(
    app: OutboxCelery,
) -> None:
    """Every field of the worker's request context, for a chord member with an
    errback, a parent and a reply queue (``Request._context``, Celery's own)."""
    body = app.signature("eta.body", args=("tag",))
    envelope = send(
        app,
        args=(),
        chord=body,
        group_id="the-group",
        group_index=1,
        link_error=[app.signature("eta.errback")],
        parent_id="the-parent",
        root_id="the-root",
        reply_to="the-reply-queue",
        priority=3,
    )
    theirs = worker_reading(app, envelope)._context
    ours = worker_request(app, envelope)
    wanted = set(vars(theirs)) - {"hostname"}  # the worker's own name
    assert {key: getattr(ours, key, None) for key in wanted} == {
        key: getattr(theirs, key) for key in wanted
    }
    # What the result backend reads to return the chord's part:
    assert (ours.group, ours.group_index, ours.chord["task"]) == (
        "the-group",
        1,
        "eta.body",
    )
