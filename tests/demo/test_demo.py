"""``python -m demo`` shows every lane, and its checks hold, on its embedded defaults.

The demo needs no server (SQLite and kombu's filesystem transport), so this runs in
``make check``; the events lane needs RabbitMQ or Redis, so that run is marked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TITLES = ("tasks:", "strict order:", "handler outbox:", "inbox:", "events:")


def run_demo(var: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in {"DATABASE_URL", "CELERY_BROKER_URL", "DJANGO_SETTINGS_MODULE"}
    }
    return subprocess.run(
        [sys.executable, "-m", "demo", "--grace", "1"],
        cwd=ROOT,
        env={**environment, "DEMO_VAR_DIR": str(var), **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def table_row(output: str, label: str) -> list[str]:
    """The result and the expected value of the table row ``label``."""
    [line] = [line for line in output.splitlines() if line.strip().startswith(label)]
    return line.strip().removeprefix(label).split()


def test_the_demo_shows_every_lane_on_its_embedded_defaults(tmp_path: Path) -> None:
    done = run_demo(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for title in TITLES:
        assert f"\n  {title}" in out, title
    assert table_row(out, "receipts run (of committed)") == ["15", "/", "15", "all"]
    assert table_row(out, "receipts run for a rolled-back order") == ["0", "0"]
    assert table_row(out, "parcels whose steps ran once each, in order") == [
        "2",
        "/",
        "2",
        "all",
    ]
    assert table_row(out, "later steps still in the outbox as each ran") == [
        "3",
        "2",
        "1",
        "0",
        "3",
        "2",
        "1",
        "0",
    ]
    assert table_row(out, "notes run when the block returned") == ["6", "/", "6", "all"]
    assert table_row(out, "notes run for a rolled-back block") == ["0", "0"]
    assert table_row(out, "deliveries of the message") == ["2", "2"]
    assert table_row(out, "bodies run and committed") == ["1", "1"]
    # The embedded broker cannot route events: the demo says what shows them.
    assert "not on this broker: it needs RabbitMQ or Redis" in out
    assert "CELERY_BROKER_URL=redis://127.0.0.1:6379/0 .venv/bin/python -m demo" in out
    assert "Every promise held" in out


@pytest.mark.servers
def test_on_redis_the_demo_sends_events_to_two_services(tmp_path: Path) -> None:
    import redis

    url = "redis://127.0.0.1:6379/12"
    exchange = f"celery-outbox-demo-events-{uuid.uuid4().hex[:8]}"
    try:
        done = run_demo(tmp_path, CELERY_BROKER_URL=url, DEMO_EVENTS_EXCHANGE=exchange)
    finally:
        client = redis.Redis.from_url(url)
        for key in client.scan_iter(match=f"*{exchange}*"):
            client.delete(key)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert table_row(out, "events committed / rolled back") == ["3", "/", "1"]
    for service in ("billing", "shipping"):
        assert table_row(out, f"{service}: committed events handled once") == [
            "3",
            "/",
            "3",
            "all",
        ]
    assert table_row(out, "copies of a rolled-back event") == ["0", "0"]
    assert "Every promise held" in out
