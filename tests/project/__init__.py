"""A small Django project the tests (and their relay and worker subprocesses) run.

As in any Django + Celery project, the package imports its Celery app so that
``shared_task`` binds to it.
"""

from __future__ import annotations

from .celery_app import app

__all__ = ["app"]
