"""The inbox's pure decisions: which tasks use it, which key a delivery has, settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from celery.app.task import Context

from celery_outbox.conf import OutboxSettings, load_settings
from celery_outbox.exceptions import OutboxConfigurationError, OutboxValueError
from celery_outbox.inbox.checks import relay_horizon, retry_horizon
from celery_outbox.inbox.task import checked_key, message_key, uses_inbox


@pytest.mark.parametrize(
    ("option", "name", "every", "expected"),
    [
        (True, "shop.a", False, True),
        (False, "shop.a", True, False),
        (None, "shop.a", False, False),
        (None, "shop.a", True, True),
        (None, "celery.chord_unlock", True, False),
        (True, "celery.chord_unlock", False, True),
    ],
)
def test_the_task_option_wins_over_the_setting(
    option: bool | None, name: str, every: bool, expected: bool
) -> None:
    assert uses_inbox(option, name, every) is expected


def test_the_key_is_the_task_id_unless_the_caller_gave_one() -> None:
    assert message_key(Context(id="t1")) == "t1"
    assert message_key(Context(id="t1", headers={"inbox_key": "k"})) == "k"
    # From a broker, custom headers are top-level: Celery also sets them as attributes.
    assert message_key(Context({"id": "t1", "inbox_key": "k"})) == "k"


def test_keys_are_checked() -> None:
    assert checked_key("t", "invoice:1") == "invoice:1"
    for bad in ("", None, 5, "x" * 256):
        with pytest.raises(OutboxValueError):
            checked_key("t", bad)


def test_settings_have_defaults_and_are_validated() -> None:
    settings = load_settings(SimpleNamespace())
    assert (settings.inbox, settings.inbox_database) == (False, None)
    assert settings.inbox_retention == 7 * 86400
    parsed = load_settings(
        SimpleNamespace(CELERY_OUTBOX_INBOX=True, CELERY_OUTBOX_INBOX_RETENTION="2d")
    )
    assert (parsed.inbox, parsed.inbox_retention) == (True, 172800.0)
    for name, value in [
        ("INBOX", "yes"),
        ("INBOX_RETENTION", None),
        ("INBOX_RETENTION", float("inf")),
        ("INBOX_RETENTION", "soon"),
        ("INBOX_DATABASE", ""),
    ]:
        with pytest.raises(OutboxConfigurationError, match=f"CELERY_OUTBOX_{name}"):
            load_settings(SimpleNamespace(**{f"CELERY_OUTBOX_{name}": value}))


def test_the_redelivery_horizon() -> None:
    settings = OutboxSettings(
        lease_seconds=60, max_attempts=3, retry_base_seconds=2, retry_max_seconds=3
    )
    assert relay_horizon(settings) == 60 + 2 + 3 + 3
    task = SimpleNamespace(max_retries=3, default_retry_delay=180, retry_backoff=False)
    assert retry_horizon(task) == 540
    backoff = SimpleNamespace(
        max_retries=5, default_retry_delay=1, retry_backoff=True, retry_backoff_max=600
    )
    assert retry_horizon(backoff) == 3000
