"""Settings are validated once, with messages that say what to fix."""

from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from celery_outbox.conf import OutboxSettings, OutsideTransaction, load_settings
from celery_outbox.exceptions import OutboxConfigurationError
from celery_outbox.relay.config import RelayConfig


def settings(**values: Any) -> SimpleNamespace:
    return SimpleNamespace(**{f"CELERY_OUTBOX_{k}": v for k, v in values.items()})


def test_defaults_when_nothing_is_set() -> None:
    assert load_settings(SimpleNamespace()) == OutboxSettings()


def test_values_are_read_and_typed() -> None:
    loaded = load_settings(
        settings(
            APP="proj.celery.app",
            OUTSIDE_TRANSACTION="raise",
            EXCLUDE_TASKS=["metrics.*"],
            BATCH_SIZE=100,
            LEASE_SECONDS=45,
        )
    )
    assert loaded.app == "proj.celery.app"
    assert loaded.outside_transaction is OutsideTransaction.RAISE
    assert loaded.exclude_tasks == ("metrics.*",)
    assert loaded.batch_size == 100
    assert loaded.lease_seconds == 45.0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"OUTSIDE_TRANSACTION": "sometimes"},
            "must be one of 'warn', 'raise', 'allow'",
        ),
        (
            {"EXCLUDE_TASKS": "metrics.*"},
            "must be a list of task names or glob patterns",
        ),
        ({"EXCLUDE_TASKS": ["ok", 3]}, "not non-empty strings"),
        ({"BATCH_SIZE": 0}, "CELERY_OUTBOX_BATCH_SIZE must be a positive int"),
        ({"BATCH_SIZE": 2.5}, "CELERY_OUTBOX_BATCH_SIZE must be a positive int"),
        ({"LEASE_SECONDS": -1}, "CELERY_OUTBOX_LEASE_SECONDS must be a positive float"),
        (
            {"CONFIRM_PUBLISH": "yes"},
            "CELERY_OUTBOX_CONFIRM_PUBLISH must be True or False",
        ),
        ({"APP": ""}, "CELERY_OUTBOX_APP must be a non-empty string"),
        ({"RETRY_BASE_SECONDS": 60, "RETRY_MAX_SECONDS": 10}, "must not be smaller"),
        ({"BATCHSIZE": 10}, "Unknown setting CELERY_OUTBOX_BATCHSIZE"),
        # A setting of 0.1 that 0.2 no longer reads is refused, not ignored.
        ({"FAST_ENQUEUE": True}, "Unknown setting CELERY_OUTBOX_FAST_ENQUEUE: correct"),
    ],
)
def test_bad_settings_are_refused_with_a_clear_message(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(OutboxConfigurationError, match=message):
        load_settings(settings(**values))


def test_a_setting_of_0_1_still_set_fails_the_system_check() -> None:
    from django.test import override_settings

    from celery_outbox.checks import check_settings

    with override_settings(CELERY_OUTBOX_FAST_ENQUEUE=True):
        [error] = check_settings()
    assert error.id == "celery_outbox.E001"
    assert (
        "Unknown setting CELERY_OUTBOX_FAST_ENQUEUE: correct its name, or delete it"
        in (error.msg)
    )


def test_every_wrong_setting_is_reported_at_once_with_a_close_match() -> None:
    with pytest.raises(OutboxConfigurationError) as raised:
        load_settings(settings(BATCH_SIZE=0, NOTIFY="yes", LEASE_SECOND=30))
    message = str(raised.value)
    assert message.startswith("3 celery-outbox settings are wrong:")
    assert "CELERY_OUTBOX_BATCH_SIZE must be a positive int, got 0" in message
    assert "CELERY_OUTBOX_NOTIFY must be True or False, got 'yes'" in message
    assert (
        "Unknown setting CELERY_OUTBOX_LEASE_SECOND: correct its name, or delete it. "
        "Did you mean CELERY_OUTBOX_LEASE_SECONDS?" in message
    )


def test_relay_flags_override_settings() -> None:
    config = RelayConfig.from_settings(
        OutboxSettings(), batch_size=7, max_attempts=None
    )
    assert config.batch_size == 7
    assert config.policy.max_attempts == OutboxSettings().max_attempts


def test_a_lease_shorter_than_the_send_timeout_is_refused() -> None:
    with pytest.raises(
        OutboxConfigurationError, match="must be longer than the send timeout"
    ):
        RelayConfig.from_settings(OutboxSettings(lease_seconds=5.0, send_timeout=10.0))


def test_a_lease_shorter_than_the_send_timeout_is_refused_at_start_up() -> None:
    with pytest.raises(
        OutboxConfigurationError, match=r"LEASE_SECONDS .* must be longer"
    ):
        load_settings(settings(LEASE_SECONDS=5, SEND_TIMEOUT=10))


def test_a_retry_cap_below_the_base_is_refused_from_flags_too() -> None:
    with pytest.raises(OutboxConfigurationError, match="retry cap"):
        RelayConfig.from_settings(
            OutboxSettings(), retry_base_seconds=60, retry_max_seconds=5
        )


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("LEASE_SECONDS", math.inf),
        ("SEND_TIMEOUT", math.nan),
        ("POLL_INTERVAL", math.inf),
        ("RETRY_MAX_SECONDS", math.inf),
        ("BROKER_OUTAGE_COOLDOWN", math.nan),
        ("DEAD_LETTER_RETENTION", math.inf),
        ("DEAD_LETTER_RETENTION", math.nan),
    ],
)
def test_infinite_and_nan_seconds_are_refused(name: str, value: float) -> None:
    with pytest.raises(OutboxConfigurationError, match=f"CELERY_OUTBOX_{name}"):
        load_settings(settings(**{name: value}))


@pytest.mark.parametrize(
    "address",
    ["statsd.internal", "statsd.internal:", ":8125", "localhost:99999", "localhost:0"],
)
def test_a_statsd_address_without_a_usable_port_is_refused_at_start_up(
    address: str,
) -> None:
    with pytest.raises(
        OutboxConfigurationError,
        match=r"CELERY_OUTBOX_STATSD_ADDRESS must be 'host:port'",
    ):
        load_settings(settings(STATSD_ADDRESS=address))


@pytest.mark.parametrize("address", ["statsd.internal:8125", "[::1]:8125"])
def test_a_statsd_address_is_accepted(address: str) -> None:
    assert load_settings(settings(STATSD_ADDRESS=address)).statsd_address == address


#: A process that loads Django with wrong settings (a fresh interpreter: Django is
#: set up once per process).
SETUP = """
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django.contrib.contenttypes", "celery_outbox"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
    CELERY_OUTBOX_BATCH_SIZE=0,
    CELERY_OUTBOX_NOTIFI=True,
)
django.setup()
"""


def test_a_process_that_loads_django_refuses_wrong_settings_at_start() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SETUP],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "OutboxConfigurationError: 2 celery-outbox settings are wrong" in done.stderr
    assert "Did you mean CELERY_OUTBOX_NOTIFY?" in done.stderr
