"""``python -m bench`` (``make bench``): how fast celery-outbox enqueues, drains and relays.

Not part of the test suite. It uses its own PostgreSQL database (``outbox_bench``,
created and migrated when missing), its own RabbitMQ queue and Redis list (named after
the run, deleted at the end) and only services on loopback.
"""
