"""Tracing and log context with the real libraries: sentry-sdk, OpenTelemetry, structlog.

Tasks are enqueued through the test project's OutboxCelery into the real database; a
relay built by ``build_relay`` publishes them through the in-memory publisher. Each
library is set up for one test and torn down after it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celery.app.trace as celery_trace
import pytest
import sentry_sdk
import sentry_sdk.integrations as sentry_integrations
import structlog
from billiard.pool import Worker as PoolWorker
from celery import Celery
from celery.app.task import Task
from django.db import transaction
from kombu import Producer
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from sentry_sdk.envelope import Envelope as SentryEnvelope
from sentry_sdk.integrations.celery import CeleryIntegration
from sentry_sdk.transport import Transport

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.cli.runner import build_relay
from celery_outbox.conf import get_settings
from celery_outbox.contrib.logcontext import bound_log_context, structlog_available
from celery_outbox.contrib.otel import OtelRelayTracing
from celery_outbox.contrib.sentry import SentryRelayTracing
from celery_outbox.envelope import EMPTY_LOG_CONTEXT, StoredMessage, load_json
from celery_outbox.exceptions import OutboxDatabaseError
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.outcomes import (
    Action,
    Decision,
    Outcome,
    PublishResult,
    Settlement,
)
from celery_outbox.propagation import capture_log_context
from celery_outbox.relay.logs import FailureLog
from celery_outbox.relay.loop import Relay
from celery_outbox.relay.observations import BreakerOpened, LoopError
from celery_outbox.store import Claim, DeadLetterFilter, Stores
from celery_outbox.store.store import RelayQueries
from tests.project.shop.tasks import record

from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


@pytest.fixture(autouse=True)
def _relay_publishes(settings: Any) -> None:
    """Rows wait for the test's relay; no LISTEN connection is opened."""
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False
    settings.CELERY_OUTBOX_NOTIFY = False


def only_row() -> OutboxMessage:
    [row] = OutboxMessage.objects.all()
    return row


def relay(**overrides: Any) -> tuple[Relay, InMemoryPublisher]:
    publisher = InMemoryPublisher()
    return build_relay(get_settings(), publisher=publisher, **overrides), publisher


# -- Sentry --------------------------------------------------------------------------


class MemoryTransport(Transport):
    """Keeps what the SDK would send."""

    envelopes: list[SentryEnvelope] = []

    def capture_envelope(self, envelope: SentryEnvelope) -> None:
        MemoryTransport.envelopes.append(envelope)


def sentry_items(kind: str) -> list[dict[str, Any]]:
    sentry_sdk.flush()
    found = []
    for sent in MemoryTransport.envelopes:
        for item in sent.items:
            if item.type == kind and item.payload.json is not None:
                found.append(item.payload.json)
    return found


@contextlib.contextmanager
def sentry_started() -> Iterator[None]:
    """``sentry_sdk.init`` with the Celery integration, undone at the end.

    The integration replaces Celery's and kombu's functions once per process; they
    are put back, so that the tests after these run against Celery as it ships.
    """
    replaced = [
        (owner, name, owner.__dict__[name])
        for owner, name in (
            (Task, "apply_async"),
            (Celery, "send_task"),
            (Producer, "publish"),
            (PoolWorker, "workloop"),
            (celery_trace, "build_tracer"),
        )
    ]
    MemoryTransport.envelopes = []
    sentry_sdk.init(
        dsn="https://public@sentry.invalid/1",
        integrations=[CeleryIntegration()],
        default_integrations=False,
        auto_enabling_integrations=False,
        traces_sample_rate=1.0,
        transport=MemoryTransport,
    )
    try:
        yield
    finally:
        sentry_sdk.get_client().close()
        sentry_sdk.get_global_scope().set_client(None)
        for owner, name, original in replaced:
            setattr(owner, name, original)
        # So that the next init installs the integration again.
        sentry_integrations._installed_integrations.discard("celery")
        sentry_integrations._processed_integrations.discard("celery")


@pytest.fixture
def sentry() -> Iterator[None]:
    with sentry_started():
        yield


#: sentry-sdk 3 has spans and attributes only; 2 has transactions and tags. Both lines
#: of the ``sentry`` extra run these tests (noxfile.py: the newest session has 3, the
#: oldest 2.0, ``SENTRY_2`` the newest 2.x).
SPANS_ONLY = not hasattr(sentry_sdk, "start_transaction")


@contextlib.contextmanager
def request_span(name: str) -> Iterator[Any]:
    """What a web framework's integration starts per request: a root span, its own trace."""
    if SPANS_ONLY:
        with sentry_sdk.isolation_scope():
            sentry_sdk.new_trace()
            with sentry_sdk.start_span(
                name=name, attributes={"sentry.op": "http.server"}, parent_span=None
            ) as span:
                yield span
    else:
        with sentry_sdk.start_transaction(op="http.server", name=name) as span:
            yield span


def continued_trace_id(headers: dict[str, Any]) -> str:
    """The trace a worker's span joins, given the headers of the message it runs."""
    if SPANS_ONLY:
        with sentry_sdk.isolation_scope():
            sentry_sdk.continue_trace(headers)
            with sentry_sdk.start_span(name="queue.task.celery") as span:
                return str(span.trace_id)
    return str(sentry_sdk.continue_trace(headers, op="queue.task.celery").trace_id)


def relay_batches() -> list[dict[str, Any]]:
    """Every relay batch Sentry was sent, in one shape for both SDK lines: its name,
    its status and its figures (tags on 2, attributes on 3), figures as text."""
    if not SPANS_ONLY:
        return [
            {
                "name": t["transaction"],
                "status": t["contexts"]["trace"]["status"],
                "origin": t["contexts"]["trace"]["origin"],
                "figures": dict(t["tags"]),
            }
            for t in sentry_items("transaction")
            if t["contexts"]["trace"]["op"] == "queue.publish"
        ]
    batches = []
    for payload in sentry_items("span"):
        for span in payload["items"]:
            attributes = {k: v["value"] for k, v in span["attributes"].items()}
            if attributes.get("sentry.op") == "queue.publish":
                batches.append(
                    {
                        "name": span["name"],
                        "status": span["status"],
                        "origin": attributes["sentry.origin"],
                        "figures": {k: str(v) for k, v in attributes.items()},
                        "segment": span["is_segment"],
                        "trace_id": span["trace_id"],
                    }
                )
    return batches


@pytest.mark.usefixtures("sentry")
def test_sentry_trace_headers_are_stored_and_published_unchanged() -> None:
    with request_span("POST /orders") as txn, transaction.atomic():
        result = record.delay("traced")
    headers = load_json(only_row().headers)
    assert headers["sentry-trace"].startswith(f"{txn.trace_id}-")
    assert f"sentry-trace_id={txn.trace_id}" in headers["baggage"]

    relay_, publisher = relay()
    relay_.run_once()
    [sent] = publisher.published
    assert sent.task_id == result.id
    assert sent.headers["sentry-trace"] == headers["sentry-trace"]
    assert sent.headers["baggage"] == headers["baggage"]
    # What the worker does with them: it continues the caller's trace.
    assert continued_trace_id(dict(sent.headers)) == txn.trace_id


def sentry_trace_ids() -> list[str]:
    return [
        load_json(row.headers)["sentry-trace"].split("-")[0]
        for row in OutboxMessage.objects.order_by("id")
    ]


@pytest.mark.usefixtures("sentry")
def test_every_call_carries_its_own_trace_however_often_the_task_is_sent() -> None:
    # Plain calls repeat: none may reuse what an earlier call was built with.
    traces = []
    for request in range(3):
        with request_span(f"request {request}") as txn, transaction.atomic():
            record.delay("plain")
            record.apply_async(("with options",), countdown=0)
            record.delay("plain again")
        traces += [txn.trace_id] * 3
    assert sentry_trace_ids() == traces
    assert len(set(traces)) == 3


def test_calls_learned_before_sentry_started_carry_its_trace_after() -> None:
    for _ in range(3):  # an enqueue at start-up, before sentry_sdk.init
        with transaction.atomic():
            record.delay("before")
    OutboxMessage.objects.all().delete()
    with (
        sentry_started(),
        request_span("POST /orders") as txn,
        transaction.atomic(),
    ):
        record.delay("after")
    assert sentry_trace_ids() == [txn.trace_id]


@pytest.mark.usefixtures("sentry")
def test_sentry_wraps_each_relay_batch_in_a_transaction() -> None:
    with transaction.atomic():
        record.delay("a")
        record.delay("b")
    relay_, _ = relay()
    assert any(isinstance(h, SentryRelayTracing) for h in relay_.batch_hooks)
    relay_.run_once()
    [batch] = relay_batches()
    assert batch["name"] == "celery_outbox relay batch"
    assert batch["origin"] == "auto.queue.celery_outbox"
    assert batch["status"] == "ok"
    figures = batch["figures"]
    assert figures["celery_outbox.batch_size"] == "2"
    assert figures["celery_outbox.broker"] == "InMemoryPublisher"
    assert figures["celery_outbox.published"] == "2"
    assert figures["celery_outbox.retried"] == "0"
    assert figures["celery_outbox.dead_lettered"] == "0"
    if SPANS_ONLY:
        assert batch["segment"] is True


@pytest.mark.usefixtures("sentry")
def test_each_relay_batch_is_a_root_of_its_own_and_no_batch_logs_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    relay_, _ = relay()
    for batch in range(4):
        with transaction.atomic():
            record.delay(f"batch {batch}")
        relay_.run_once()
    batches = relay_batches()
    assert len(batches) == 4
    if SPANS_ONLY:  # sentry-sdk 2 starts every transaction in a trace of its own
        assert len({b["trace_id"] for b in batches}) == 4
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.usefixtures("sentry")
def test_a_batch_the_broker_refused_is_an_error_span() -> None:
    with transaction.atomic():
        record.delay("refused")
    refusing = InMemoryPublisher(
        lambda m: PublishResult(m.id, Outcome.FAILED, "NOT_FOUND - no exchange")
    )
    relay_ = build_relay(get_settings(), publisher=refusing)
    relay_.run_once()
    [batch] = relay_batches()
    assert batch["status"] in {"internal_error", "error"}
    assert batch["figures"]["celery_outbox.published"] == "0"
    assert batch["figures"]["celery_outbox.retried"] == "1"


class FailingClaimStore(RelayQueries):
    def claim(self, limit: int, lease_seconds: float, *, task_ids: Any = ()) -> Claim:
        raise OutboxDatabaseError("outbox database 'default': OperationalError: gone")


@pytest.mark.usefixtures("sentry")
def test_sentry_captures_relay_loop_errors() -> None:
    relay_, _ = relay()
    relay_.store = FailingClaimStore("default")
    relay_.run_once()
    [event] = sentry_items("event")
    assert event["level"] == "error"
    assert "relay claim failed" in event["message"]
    assert event["tags"]["celery_outbox.stage"] == "claim"
    assert event["fingerprint"] == ["celery_outbox", "loop_error", "claim"]


@pytest.mark.usefixtures("sentry")
def test_a_broker_outage_is_a_breadcrumb_on_the_next_event() -> None:
    tracing = SentryRelayTracing("amqp")
    tracing(BreakerOpened(seconds=5.0))
    tracing(LoopError("claim", "gone"))
    [event] = sentry_items("event")
    [crumb] = event["breadcrumbs"]["values"]
    assert crumb["category"] == "celery_outbox"
    assert crumb["level"] == "warning"
    assert crumb["message"] == "broker unreachable: relay pauses for 5.0 s"


def test_no_sentry_hook_when_sentry_is_not_initialised() -> None:
    relay_, _ = relay()
    assert not any(isinstance(h, SentryRelayTracing) for h in relay_.batch_hooks)


# -- OpenTelemetry -------------------------------------------------------------------


_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="session")
def global_tracer_provider() -> TracerProvider:
    """A real SDK TracerProvider, installed through the public API once per session.

    OpenTelemetry allows one global provider per process; spans outside these tests
    are recorded in memory and never looked at.
    """
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)
    return provider


@pytest.fixture
def spans(global_tracer_provider: TracerProvider) -> Iterator[InMemorySpanExporter]:
    """The spans recorded during this test."""
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def traceparent_ids(value: str) -> tuple[int, int]:
    _, trace_id, span_id, _ = value.split("-")
    return int(trace_id, 16), int(span_id, 16)


def test_otel_context_is_injected_when_celery_is_not_instrumented(
    spans: InMemorySpanExporter,
) -> None:
    tracer = trace.get_tracer("tests")
    with (
        tracer.start_as_current_span("POST /orders") as request_span,
        transaction.atomic(),
    ):
        record.delay("traced")
    request = request_span.get_span_context()
    headers = load_json(only_row().headers)
    assert traceparent_ids(headers["traceparent"]) == (
        request.trace_id,
        request.span_id,
    )

    relay_, publisher = relay()
    assert any(isinstance(h, OtelRelayTracing) for h in relay_.batch_hooks)
    relay_.run_once()
    assert publisher.published[0].headers["traceparent"] == headers["traceparent"]
    [batch] = [
        s for s in spans.get_finished_spans() if s.name == "celery_outbox publish"
    ]
    assert batch.kind is trace.SpanKind.PRODUCER
    assert batch.attributes is not None
    assert batch.attributes["messaging.batch.message_count"] == 1
    assert batch.attributes["celery_outbox.published"] == 1
    [link] = batch.links
    assert (link.context.trace_id, link.context.span_id) == (
        request.trace_id,
        request.span_id,
    )
    # The batch is its own trace: it links to the request, it is not its child.
    assert batch.context is not None
    assert batch.context.trace_id != request.trace_id


@pytest.mark.usefixtures("spans")
def test_otel_adds_nothing_without_an_active_span() -> None:
    with transaction.atomic():
        record.delay("untraced")
    headers = load_json(only_row().headers)
    assert not {"traceparent", "tracestate", "baggage"} & set(headers)


def test_otel_celery_instrumentation_header_is_kept_as_is(
    spans: InMemorySpanExporter,
) -> None:
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=trace.get_tracer_provider())
    try:
        tracer = trace.get_tracer("tests")
        with (
            tracer.start_as_current_span("POST /orders") as request_span,
            transaction.atomic(),
        ):
            result = record.delay("traced")
    finally:
        instrumentor.uninstrument()
    [producer] = [
        s for s in spans.get_finished_spans() if s.name == "apply_async/shop.record"
    ]
    assert producer.context is not None
    headers = load_json(only_row().headers)
    # The instrumentation injected its producer span in the caller; we added nothing.
    assert traceparent_ids(headers["traceparent"]) == (
        producer.context.trace_id,
        producer.context.span_id,
    )
    assert producer.context.trace_id == request_span.get_span_context().trace_id
    assert headers["id"] == result.id

    relay_, _ = relay()
    relay_.run_once()
    [batch] = [
        s for s in spans.get_finished_spans() if s.name == "celery_outbox publish"
    ]
    [link] = batch.links
    assert link.context.span_id == producer.context.span_id


def test_no_otel_hook_without_a_tracer_provider(tmp_path: Path) -> None:
    # OpenTelemetry's global provider can be set once per process, and this session
    # may have set it: ask a fresh process.
    code = (
        "import django; django.setup()\n"
        "from django.core.management import call_command\n"
        "call_command('migrate', verbosity=0)\n"
        "from celery_outbox.conf import get_settings\n"
        "from celery_outbox.contrib.otel import OtelRelayTracing\n"
        "from celery_outbox.cli.runner import build_relay\n"
        "relay = build_relay(get_settings())\n"
        "print(any(isinstance(h, OtelRelayTracing) for h in relay.batch_hooks))\n"
    )
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.project.settings",
        OUTBOX_TEST_DB="sqlite",
        OUTBOX_TEST_SQLITE_DIR=str(tmp_path),
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


# -- structlog -----------------------------------------------------------------------


@pytest.fixture
def log_context() -> Iterator[None]:
    structlog.contextvars.clear_contextvars()
    yield
    structlog.contextvars.clear_contextvars()


class Unencodable:
    def __str__(self) -> str:
        return "<unencodable>"


@pytest.mark.usefixtures("log_context")
def test_structlog_context_is_stored_and_never_sent() -> None:
    structlog.contextvars.bind_contextvars(request_id="req-1", user=Unencodable())
    with transaction.atomic():
        record.delay("logged")
    row = only_row()
    assert json.loads(row.log_context or "") == {
        "request_id": "req-1",
        "user": "<unencodable>",
    }
    relay_, publisher = relay()
    relay_.run_once()
    [sent] = publisher.published
    assert "request_id" not in sent.headers
    assert "req-1" not in sent.body.decode()


@pytest.mark.usefixtures("log_context")
def test_empty_context_is_stored_as_a_constant() -> None:
    with transaction.atomic():
        record.delay("quiet")
    assert only_row().log_context == "{}"


@pytest.mark.usefixtures("log_context")
def test_log_context_keys_allowlist_and_switch(settings: Any) -> None:
    structlog.contextvars.bind_contextvars(request_id="req-2", secret="s3cr3t")
    settings.CELERY_OUTBOX_LOG_CONTEXT_KEYS = ["request_id"]
    with transaction.atomic():
        record.delay("allowed")
    assert json.loads(only_row().log_context or "") == {"request_id": "req-2"}
    OutboxMessage.objects.all().delete()
    settings.CELERY_OUTBOX_LOG_CONTEXT = False
    with transaction.atomic():
        record.delay("off")
    assert only_row().log_context == "{}"


class ContextHandler(logging.Handler):
    """Renders records the way a structlog ``ProcessorFormatter`` setup does."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                processor=structlog.processors.JSONRenderer(),
                foreign_pre_chain=[structlog.contextvars.merge_contextvars],
            )
        )
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.mark.usefixtures("log_context")
def test_relay_logs_failures_in_the_enqueue_context(settings: Any) -> None:
    settings.CELERY_OUTBOX_MAX_ATTEMPTS = 2
    structlog.contextvars.bind_contextvars(request_id="req-3")
    with transaction.atomic():
        record.delay("refused")
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(relay="r1")

    def refuse(message: StoredMessage) -> PublishResult:
        return PublishResult(message.id, Outcome.FAILED, "NotFound: no exchange 'x'")

    publisher = InMemoryPublisher(refuse)
    relay_ = build_relay(get_settings(), publisher=publisher)
    [failures_log] = [h for h in relay_.observers if isinstance(h, FailureLog)]
    assert failures_log.context is bound_log_context
    handler = ContextHandler()
    logger = logging.getLogger("celery_outbox.relay")
    logger.addHandler(handler)
    try:
        relay_.run_once()
        OutboxMessage.objects.update(
            available_at=OutboxMessage.objects.get().created_at
        )
        relay_.run_once()
    finally:
        logger.removeHandler(handler)
    failures = [line for line in handler.lines if "shop.record" in line["event"]]
    assert [
        ("refused" in f["event"], "dead-lettered" in f["event"]) for f in failures
    ] == [
        (True, False),
        (False, True),
    ]
    for line in failures:
        assert line["request_id"] == "req-3"
        assert line["relay"] == "r1"  # the relay's own context stays bound
    assert structlog.contextvars.get_contextvars() == {"relay": "r1"}
    [dead] = DeadLetter.objects.all()
    assert json.loads(dead.log_context or "") == {"request_id": "req-3"}


def test_log_context_round_trips_on_every_database(alias: str) -> None:
    store = Stores(alias).relay()
    with transaction.atomic(using=alias):
        Stores(alias).writer().insert(
            [
                envelope("ctx", log_context={"request_id": "req-4", "n": 1}),
                envelope("plain"),
            ]
        )
    claim = store.claim(10, 30.0)
    by_tag = {m.envelope.task_id.split("-")[0]: m for m in claim.messages}
    assert by_tag["ctx"].envelope.log_context == {"request_id": "req-4", "n": 1}
    assert by_tag["plain"].envelope.log_context is EMPTY_LOG_CONTEXT
    store.settle(
        claim.token,
        Settlement(
            dead_letter=(
                Decision(by_tag["ctx"].id, Action.DEAD_LETTER, 0.0, "refused"),
            ),
            delete=(by_tag["plain"].id,),
        ),
    )
    [dead] = DeadLetter.objects.using(alias).all()
    assert json.loads(dead.log_context or "") == {"request_id": "req-4", "n": 1}
    Stores(alias).operator().replay_dead_letters(DeadLetterFilter(ids=(dead.id,)))
    [replayed] = store.claim(10, 30.0).messages
    assert replayed.envelope.log_context == {"request_id": "req-4", "n": 1}


def test_rows_without_a_log_context_read_as_empty(alias: str) -> None:
    """A row written by an older version (no log_context value) still relays."""
    store = Stores(alias).relay()
    with transaction.atomic(using=alias):
        Stores(alias).writer().insert([envelope("old")])
    OutboxMessage.objects.using(alias).update(log_context=None)
    [message] = store.claim(10, 30.0).messages
    assert message.envelope.log_context is EMPTY_LOG_CONTEXT


# -- optional ------------------------------------------------------------------------


def test_without_structlog_nothing_is_captured_and_no_listener_is_added(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "structlog", None)
    monkeypatch.setitem(sys.modules, "structlog.contextvars", None)
    assert not structlog_available()
    assert capture_log_context(get_settings()) is EMPTY_LOG_CONTEXT
    relay_, _ = relay()
    [failures_log] = [h for h in relay_.observers if isinstance(h, FailureLog)]
    assert failures_log.context is not bound_log_context  # failures logged, no context


def test_core_works_without_the_optional_libraries() -> None:
    """In a process where they cannot be imported, nothing of ours imports them."""
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class Missing(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {"sentry_sdk", "opentelemetry", "structlog"}:
                    raise ImportError(f"{name} is not installed")
                return None

        sys.meta_path.insert(0, Missing())
        import django
        django.setup()
        import celery_outbox.app, celery_outbox.enqueue, celery_outbox.cli.runner
        from celery_outbox.conf import get_settings
        from celery_outbox.contrib.logcontext import structlog_available
        from celery_outbox.propagation import capture_log_context
        from celery_outbox.cli.runner import tracing_hooks
        assert tracing_hooks("amqp") == []
        assert not structlog_available()
        assert not capture_log_context(get_settings())
        loaded = [m for m in sys.modules if m.split(".")[0] in
                  {"sentry_sdk", "opentelemetry", "structlog"}]
        assert not loaded, loaded
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.project.settings"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_log_context_settings_are_validated() -> None:
    from types import SimpleNamespace

    from celery_outbox.conf import load_settings
    from celery_outbox.exceptions import OutboxConfigurationError

    loaded = load_settings(
        SimpleNamespace(CELERY_OUTBOX_LOG_CONTEXT_KEYS=["request_id"])
    )
    assert loaded.log_context is True
    assert loaded.log_context_keys == ("request_id",)
    assert load_settings(SimpleNamespace()).log_context_keys is None
    with pytest.raises(OutboxConfigurationError, match="LOG_CONTEXT_KEYS"):
        load_settings(SimpleNamespace(CELERY_OUTBOX_LOG_CONTEXT_KEYS="request_id"))
    with pytest.raises(OutboxConfigurationError, match="LOG_CONTEXT must be True"):
        load_settings(SimpleNamespace(CELERY_OUTBOX_LOG_CONTEXT="yes"))
