"""Django's PostgreSQL backend, writing outbox rows in the ``COMMIT``'s round trip."""
