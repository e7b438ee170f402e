"""A worker that runs a flow key's task and cannot report it says so, once.

Its slot stays taken until the flow's lease, and nothing else would tell. The
worker here is a real process: Django started as a worker's fix-up starts it, a
Celery app, and Celery's own tracer running two tasks whose messages name a slot.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from celery_outbox.flow.worker import unreported
from celery_outbox.flow_limits import FLOW_HEADER, KEY_HEADER

REPO_ROOT = Path(__file__).resolve().parents[2]

#: A worker process: ``argv[1]`` its app's class (``Celery`` or ``OutboxCelery``),
#: ``argv[2]`` whether its settings have the flow.
WORKER = """
import logging, sys
import django
from django.conf import settings

flows = {"partner": {"tasks": ["plain.work"], "running": 1}}
settings.configure(
    INSTALLED_APPS=["celery_outbox"],
    CELERY_OUTBOX_FLOWS=flows if sys.argv[2] == "flows" else {},
    USE_TZ=True,
)
django.setup()
logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")

from celery import Celery
from celery.app.trace import build_tracer
from celery_outbox import OutboxCelery

app = (OutboxCelery if sys.argv[1] == "OutboxCelery" else Celery)("plain")

@app.task(name="plain.work")
def work():
    return "done"

trace = build_tracer(work.name, work, store_errors=False, app=app)
for n in range(2):
    headers = {"id": f"t{n}", "task": work.name, "outbox_flow": "partner",
               "outbox_flow_key": "tenant-1"}
    trace(f"t{n}", (), {}, {"id": f"t{n}", "headers": headers, "delivery_info": {}})
print("ran 2")
"""


def worker_log(app: str, flows: str) -> str:
    """What a worker of ``app`` logged running two tasks of a slot."""
    done = subprocess.run(
        [sys.executable, "-c", WORKER, app, flows],
        cwd=REPO_ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran 2"
    return done.stderr


def test_a_worker_of_a_plain_celery_app_warns_once_naming_the_fix() -> None:
    log = worker_log("Celery", "flows")
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, log
    assert "flow 'partner' (key 'tenant-1')" in warnings[0]
    assert "until the flow's lease" in warnings[0]
    assert "celery_outbox.OutboxCelery(...)" in warnings[0]


def test_a_worker_whose_settings_lack_the_flow_warns_once_naming_the_fix() -> None:
    log = worker_log("OutboxCelery", "none")
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, log
    assert "has no flow 'partner'" in warnings[0]
    assert "CELERY_OUTBOX_FLOWS" in warnings[0]


FLOWS = {"partner": {"tasks": ["shop.call_partner"], "running": 1}}
SLOT = {FLOW_HEADER: "partner", KEY_HEADER: "tenant-1"}


@pytest.mark.parametrize(
    ("headers", "connected"),
    [
        (SLOT, True),  # it reports
        ({KEY_HEADER: "tenant-1"}, False),  # no slot taken: nothing to report
        ({}, False),
        (None, False),
    ],
)
def test_a_task_the_worker_reports_or_that_took_no_slot_is_no_problem(
    headers: Any, connected: bool
) -> None:
    with override_settings(CELERY_OUTBOX_FLOWS=FLOWS):
        assert unreported(headers, connected) is None


def test_a_flow_with_no_limits_per_key_in_the_workers_settings_is_a_problem() -> None:
    rate_only = {"partner": {"tasks": ["shop.call_partner"], "rate": "5/s"}}
    with override_settings(CELERY_OUTBOX_FLOWS=rate_only):
        assert "has no flow 'partner'" in str(unreported(SLOT, True))
