"""Progress bars drawn by tqdm on a command's stream, and none without tqdm."""

from __future__ import annotations

import sys
from io import StringIO

import pytest
from django.core.management.base import OutputWrapper

from celery_outbox.progress import ProgressBar


def final_state(text: str) -> str:
    """What a terminal shows at the end: the last redraw of the line."""
    return text.rstrip("\n").split("\r")[-1]


def test_the_bar_counts_up_to_the_total_and_ends_its_line() -> None:
    out = StringIO()
    bar = ProgressBar(out, "replaying", unit=" dead letters")
    for done in (2, 4, 5):
        bar.update(done, 5)
    bar.close()
    text = out.getvalue()
    assert text.startswith("\rreplaying:")
    assert text.endswith("\n")
    last = final_state(text)
    assert "100%" in last
    assert "5/5" in last
    assert "dead letters/s" in last


def test_small_jobs_draw_no_bar() -> None:
    out = StringIO()
    bar = ProgressBar(out, "replaying", threshold=10)
    bar.update(5, 10)
    bar.close()
    assert out.getvalue() == ""
    assert not bar.drawn


def test_redraws_on_a_django_stream_stay_on_one_line() -> None:
    raw = StringIO()
    bar = ProgressBar(OutputWrapper(raw), "replaying")
    bar.update(1, 3)
    bar.update(3, 3)
    bar.close()
    # OutputWrapper would end each write with a newline: one line, one newline.
    assert raw.getvalue().count("\n") == 1
    assert "3/3" in final_state(raw.getvalue())


def test_without_tqdm_the_job_runs_and_draws_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if the extra were not installed
    out = StringIO()
    bar = ProgressBar(out, "replaying")
    bar.update(1, 2)
    bar.update(2, 2)
    bar.close()
    assert out.getvalue() == ""
