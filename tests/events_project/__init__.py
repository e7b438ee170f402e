"""Services of the events tests: ``shop`` fires events; ``billing``, ``shipping`` and
``audit`` handle them (each its own Celery app, as separate services would be)."""
