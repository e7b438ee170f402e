"""A runnable example of celery-outbox: ``python -m demo`` (or ``make demo``).

A tiny Django project (``demo.settings``, ``demo.celery``, the ``demo.shop`` app) and
a driver (``demo.run``) that starts a real relay and a real Celery worker, places
orders in transactions, rolls some of them back and checks what the worker ran.
"""
