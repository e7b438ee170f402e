"""Which broker errors are outages (no attempt used) and what the log says about them."""

from __future__ import annotations

import ssl

import amqp.exceptions as amqp_errors
import pytest
import redis.exceptions as redis_errors
from kombu.exceptions import OperationalError

from celery_outbox.broker.base import (
    ResourceAlarm,
    broker_condition,
    explain,
    is_outage,
)


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (
            amqp_errors.AccessRefused(403, "ACCESS_REFUSED - Login was refused"),
            "credentials",
        ),
        (
            amqp_errors.NotAllowed(530, "NOT_ALLOWED - access to vhost 'x' refused"),
            "virtual host",
        ),
        (
            amqp_errors.ConnectionForced(320, "CONNECTION_FORCED - shutdown"),
            "closed the connection",
        ),
        (ResourceAlarm("connection blocked, see broker logs"), "resource alarm"),
        (ssl.SSLError(1, "CERTIFICATE_VERIFY_FAILED"), "TLS"),
        (
            redis_errors.AuthenticationError(
                "WRONGPASS invalid username-password pair"
            ),
            "credentials",
        ),
        (
            redis_errors.NoPermissionError("NOPERM this user has no permissions"),
            "permission",
        ),
        (redis_errors.BusyLoadingError("LOADING Redis is loading"), "loading"),
        (
            redis_errors.ReadOnlyError("READONLY You can't write against a replica"),
            "replica",
        ),
        (redis_errors.ResponseError("NOAUTH Authentication required."), "credentials"),
        # A primary left without the replicas its min-replicas-to-write asks for (a
        # Sentinel failover under way): the relay reconnects and finds the new one.
        (
            redis_errors.ResponseError("NOREPLICAS Not enough good replicas to write."),
            "replicas",
        ),
        # redis-py 8 raises these as classes of their own, 4.5 as a ResponseError.
        (
            redis_errors.MasterDownError(
                "Link with MASTER is down and replica-serve-stale-data is set to 'no'."
            ),
            "lost its primary",
        ),
        (
            redis_errors.ResponseError(
                "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is "
                "set to 'no'."
            ),
            "lost its primary",
        ),
        (
            redis_errors.ResponseError(
                "OOM command not allowed when used memory > 'maxmemory'."
            ),
            "maxmemory",
        ),
        (
            redis_errors.ResponseError(
                "BUSY Redis is busy running a script. You can only call SCRIPT KILL "
                "or SHUTDOWN NOSAVE."
            ),
            "script",
        ),
    ],
)
def test_connection_problems_are_outages_with_a_reason(
    error: BaseException, says: str
) -> None:
    assert is_outage(error)
    reason = broker_condition(error)
    assert reason is not None and says in reason
    assert type(error).__name__ in reason


@pytest.mark.skipif(
    not hasattr(redis_errors, "OutOfMemoryError"),
    reason="this redis-py raises OOM as a ResponseError (tested above)",
)
def test_redis_out_of_memory_is_an_outage() -> None:
    error = redis_errors.OutOfMemoryError(
        "command not allowed when used memory > 'maxmemory'."
    )
    reason = broker_condition(error)
    assert is_outage(error) and reason is not None and "maxmemory" in reason


def test_a_message_refusal_is_no_outage() -> None:
    refused = amqp_errors.PreconditionFailed(406, "PRECONDITION_FAILED - too big")
    assert not is_outage(refused)
    assert broker_condition(refused) is None
    assert broker_condition(redis_errors.ResponseError("WRONGTYPE")) is None


def test_a_frame_error_is_an_outage_but_no_broker_condition() -> None:
    # It may be one message's fault: the relay finds out by sending it alone.
    frame = amqp_errors.FrameError(501, "FRAME_ERROR - frame_too_large")
    assert is_outage(frame)
    assert broker_condition(frame) is None


def test_the_brokers_reason_is_found_behind_a_socket_error() -> None:
    try:
        try:
            raise amqp_errors.FrameError(501, "FRAME_ERROR - frame_too_large")
        except amqp_errors.FrameError:
            raise OSError(9, "Bad file descriptor") from None
    except OSError as exc:
        hidden = exc
    assert "frame_too_large" in explain(hidden)


def test_kombus_wrapper_is_looked_through() -> None:
    try:
        try:
            raise redis_errors.AuthenticationError("invalid username-password pair")
        except redis_errors.AuthenticationError as inner:
            raise OperationalError(str(inner)) from inner
    except OperationalError as exc:
        wrapped = exc
    reason = broker_condition(wrapped)
    assert reason is not None and reason.startswith("Redis refused the credentials")
