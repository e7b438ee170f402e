"""The bench's Django app: declares the receiver of the handler latency part."""

from __future__ import annotations

import os

from django.apps import AppConfig

from bench import env


class BenchConfig(AppConfig):
    """``bench``: its models, the ``bench.latency`` handler receiver, and in the
    strict part's relay the record of each publish."""

    name = "bench"

    def ready(self) -> None:
        # Every bench process declares it, so the processor subprocess has it too.
        from bench.handlers_latency import register

        register()
        if os.environ.get(env.PUBLISHED_ENV):
            from bench.celery import record_publishes

            record_publishes()
