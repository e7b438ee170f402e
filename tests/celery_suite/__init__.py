"""Celery's own integration suite, run stock and through ``OutboxCelery`` (``run.py``)."""
