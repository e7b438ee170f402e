"""Subscribers record what they ran in Redis (one list per test run and service), and
read their behaviour (fail, sleep) from Redis keys the test sets."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

URL = "redis://127.0.0.1:6379/13"


def client() -> redis.Redis:
    return redis.Redis.from_url(URL)


def key(service: str) -> str:
    return (
        f"{os.environ.get('OUTBOX_TEST_EVENTS_EXCHANGE', 'events')}:{service}:handled"
    )


def record(service: str, event: str, payload: Any, **extra: Any) -> None:
    row = {"event": event, "payload": payload, "at": time.time(), **extra}
    client().rpush(key(service), json.dumps(row))


def flag(service: str, name: str) -> bool:
    return bool(client().exists(f"{key(service)}:{name}"))


def fail_now(service: str) -> bool:
    """Whether to fail this call: True while the service's ``failures`` count, set by
    the test, has calls left (each call takes one)."""
    return int(client().decr(f"{key(service)}:failures")) >= 0
