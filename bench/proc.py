"""Subprocesses of the benchmark: a relay that starts on cue, and a queue consumer.

``python -m bench.proc relay``
    Builds a relay exactly as ``manage.py outbox relay --until-empty`` does, connects
    to the database and the broker, prints ``ready``, waits for ``go`` on stdin, runs
    until no row is due and prints ``done {"start": .., "end": ..}`` (monotonic
    clock). Process start-up and connecting are thus left out of the drain time.
    With ``OUTBOX_BENCH_LIBRARY_ONLY=1`` it publishes through the libraries alone
    (py-amqp encodes every publish; kombu's ``Producer`` sends to Redis).

``python -m bench.proc consume SECONDS``
    Consumes the run's RabbitMQ queue (no ack) and prints ``<task id> <monotonic>``
    for every message as it arrives, until stdin closes or SECONDS have passed.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time

#: Set to "1" in a relay's environment, the relay publishes through the libraries
#: alone: py-amqp encodes every publish, kombu's ``Producer`` sends to Redis.
LIBRARY_ONLY = "OUTBOX_BENCH_LIBRARY_ONLY"


def relay() -> int:
    from bench import env

    env.setup_django()
    from celery_outbox.app import resolve_app
    from celery_outbox.broker import build_publisher
    from celery_outbox.broker.amqp import AmqpPublisher
    from celery_outbox.broker.amqpframes import PublishEncoder
    from celery_outbox.broker.redis import RedisPublisher
    from celery_outbox.cli.runner import build_relay
    from celery_outbox.conf import get_settings

    settings = get_settings()
    publisher = build_publisher(resolve_app(settings), settings)
    if os.environ.get(LIBRARY_ONLY) == "1":
        if isinstance(publisher, AmqpPublisher):
            publisher.encoder = PublishEncoder(None)
        elif isinstance(publisher, RedisPublisher):
            publisher.direct = False
    runner = build_relay(settings, publisher=publisher, until_empty=True)
    runner.publisher.ping()
    print("ready", flush=True)
    line = sys.stdin.readline().strip()
    if line != "go":
        return 1
    start = time.monotonic()
    reason = runner.run()
    end = time.monotonic()
    print("done " + json.dumps({"start": start, "end": end, "reason": reason.value}))
    sys.stdout.flush()
    return 0


def consume(seconds: float) -> int:
    from kombu import Connection

    from bench import env

    env.setup_django()
    from django.conf import settings

    deadline = time.monotonic() + seconds
    with Connection(env.AMQP_URL) as conn:
        conn.ensure_connection(max_retries=3)
        channel = conn.channel()
        settings.CELERY_TASK_QUEUES[0](channel).declare()
        out = sys.stdout

        def on_message(message: object) -> None:
            received = time.monotonic()
            headers = getattr(message, "headers", None) or {}
            out.write(f"{headers.get('id', '')} {received:.6f}\n")
            out.flush()

        channel.basic_consume(env.QUEUE, callback=on_message, no_ack=True)
        print("ready", flush=True)
        while time.monotonic() < deadline:
            # stdin closing (EOF) is the parent's "stop".
            readable, _, _ = select.select([sys.stdin], [], [], 0)
            if readable and not sys.stdin.readline():
                break
            try:
                conn.connection.drain_events(timeout=0.2)
            except TimeoutError:
                continue
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["relay"]:
        return relay()
    if argv[:1] == ["consume"] and len(argv) == 2:
        return consume(float(argv[1]))
    print("usage: python -m bench.proc relay | consume SECONDS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
