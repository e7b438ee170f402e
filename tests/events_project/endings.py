"""The endings service: subscribers that end each event the way its argument says.

Every way Celery can end a request, from a subscriber: ``on_trial`` (a soft time
limit of 1 s, a hard one of 2 s) returns, raises, raises ``Ignore`` or ``Reject``, or
overruns a time limit; ``on_other`` (no time limit) kills its own worker process.
Each run records its start (with its process id) and, if it got that far, its end.
"""

from __future__ import annotations

import os
import signal
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.events_project.settings")

from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded

from celery_outbox import OutboxCelery
from tests.events_project.record import record

app = OutboxCelery("endings")
app.config_from_object("django.conf:settings", namespace="CELERY")

#: Retry steps of the subscriber (1 s, then 2 s), fewer than the settings' three.
STEPS = 2


@app.subscriber("trial.*", max_retries=STEPS, soft_time_limit=1, time_limit=2)
def on_trial(number: int, how: str) -> None:
    record("endings", how, number, phase="start", pid=os.getpid())
    if how == "fail":
        raise RuntimeError("failing on purpose")
    if how == "ignore":
        raise Ignore()
    if how == "reject":
        raise Reject("rejected on purpose", requeue=False)
    if how == "requeue":
        raise Reject("requeued on purpose", requeue=True)
    if how == "soft":
        time.sleep(30)  # the soft time limit raises SoftTimeLimitExceeded in here
    if how == "hard":
        try:
            time.sleep(30)
        except SoftTimeLimitExceeded:
            time.sleep(30)  # ignores it: the hard time limit kills the process
    record("endings", how, number, phase="done")


@app.subscriber("other.*", max_retries=STEPS)
def on_other(number: int, how: str) -> None:
    """No time limit: ``lost`` kills its own process (no time limit ends it first)."""
    record("endings", how, number, phase="start", pid=os.getpid())
    if how == "lost":
        os.kill(os.getpid(), signal.SIGKILL)
    record("endings", how, number, phase="done")
