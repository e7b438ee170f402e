"""A broker URL kombu cannot read is a clear configuration error, not kombu's KeyError."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_outbox.broker import broker_driver
from celery_outbox.exceptions import OutboxConfigurationError


def test_an_unknown_scheme_names_the_setting_and_the_close_match() -> None:
    app = Celery(
        "bad-url", broker="amqpp://guest:secret@127.0.0.1//", set_as_current=False
    )
    with pytest.raises(OutboxConfigurationError) as raised:
        broker_driver(app)
    message = str(raised.value)
    assert "CELERY_BROKER_URL" in message
    assert "Did you mean amqp?" in message
    assert "secret" not in message  # the password is masked


@pytest.mark.parametrize(
    ("url", "driver"),
    [("amqp://127.0.0.1//", "amqp"), ("redis://127.0.0.1:6379/0", "redis")],
)
def test_a_known_scheme_gives_its_driver(url: str, driver: str) -> None:
    assert broker_driver(Celery("ok-url", broker=url, set_as_current=False)) == driver
