"""Fixtures of the end-to-end tests: real relay and worker processes on the test database.

``e2e(vendor, broker)`` returns a :class:`Stack`: it points the test process's outbox
at the pytest-django test database of ``vendor`` and starts ``manage.py outbox relay``
and ``celery worker`` subprocesses on that same database and broker. Every process
is stopped in teardown (SIGTERM, then SIGKILL), and its log is printed when the test
did not pass.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.db import connections

from tests.conftest import BROKER_AMQP, BROKER_REDIS

REPO_ROOT = Path(__file__).resolve().parents[2]
#: How long a process may take to come up (Django setup, broker connection).
STARTUP_TIMEOUT = 45.0
#: How long a process may take to exit after SIGTERM before it is killed.
STOP_TIMEOUT = 15.0
#: The worker's AMQP heartbeat (seconds): its event loop wakes every half of it, so
#: it acts on SIGTERM within that time instead of up to 10 s.
WORKER_HEARTBEAT = 4.0

__all__ = ["BROKER_AMQP", "BROKER_REDIS", "Proc", "Stack", "alias_for", "wait_until"]


def alias_for(vendor: str) -> str:
    """The test process's database alias for ``vendor`` (postgresql, mysql or sqlite)."""
    return "default" if vendor == django_settings.DEFAULT_VENDOR else vendor


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    what: str,
    detail: Callable[[], str] = lambda: "",
    interval: float = 0.1,
) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` (and ``detail()``) at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if time.monotonic() >= deadline:
            extra = detail()
            pytest.fail(
                f"timed out after {timeout:.0f} s waiting for {what}"
                + (f": {extra}" if extra else "")
            )
        time.sleep(interval)


@dataclass
class Proc:
    """One subprocess, its command line and its log file (stdout and stderr)."""

    name: str
    args: list[str]
    log: Path
    popen: subprocess.Popen[bytes]
    #: Meant to run until stopped (a relay or worker), not to exit on its own.
    long_running: bool = True
    sigterm_sent: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        """Everything the process wrote so far."""
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_for_output(self, text: str, timeout: float = STARTUP_TIMEOUT) -> None:
        """Wait until the log contains ``text``; fail early if the process exits."""
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if not self.alive():
                pytest.fail(
                    f"{self.name} exited with {self.popen.returncode} before logging "
                    f"{text!r}:\n{self.output()}"
                )
            if time.monotonic() >= deadline:
                pytest.fail(
                    f"timed out after {timeout:.0f} s waiting for {self.name} to log {text!r}:\n"
                    f"{self.output()}"
                )
            time.sleep(0.05)

    def send_sigterm(self) -> None:
        """Ask the process to stop (once), without waiting."""
        if self.alive() and not self.sigterm_sent:
            self.sigterm_sent = True
            self.popen.send_signal(signal.SIGTERM)

    def terminate(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM, wait up to ``timeout`` s, then SIGKILL; returns the exit code."""
        self.send_sigterm()
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
        return self.popen.wait(timeout)


@dataclass
class Stack:
    """Relay and worker processes sharing one test database and one broker."""

    vendor: str
    alias: str
    broker: str
    env: dict[str, str]
    logs: Path
    procs: list[Proc] = field(default_factory=list)

    def _spawn(
        self,
        name: str,
        args: list[str],
        long_running: bool = True,
        env: dict[str, str] | None = None,
    ) -> Proc:
        taken = {p.name for p in self.procs}
        unique, n = name, 1
        while unique in taken:
            n += 1
            unique = f"{name}-{n}"
        log = self.logs / f"{unique}.log"
        with log.open("wb") as handle:
            popen = subprocess.Popen(
                args,
                cwd=REPO_ROOT,
                env=env or self.env,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(unique, args, log, popen, long_running)
        self.procs.append(proc)
        return proc

    def relay_args(self, *options: str) -> list[str]:
        return [sys.executable, "manage.py", "outbox", "relay", *options]

    def start_relay(
        self, *options: str, name: str = "relay", wait: bool = True
    ) -> Proc:
        """Start ``manage.py outbox relay``; by default wait until its loop runs."""
        proc = self._spawn(name, self.relay_args(*options))
        if wait:
            proc.wait_for_output("relay started")
        return proc

    def run_relay(self, *options: str, timeout: float = 60.0) -> tuple[int, str]:
        """Run a relay to completion (e.g. ``--until-empty``); returns (exit code, log)."""
        proc = self._spawn("relay-run", self.relay_args(*options), long_running=False)
        try:
            code = proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            pytest.fail(
                f"relay {options} did not exit within {timeout:.0f} s:\n{proc.output()}"
            )
        return code, proc.output()

    def start_handlers(self, *options: str, name: str = "handlers") -> Proc:
        """Start ``manage.py outbox handlers run`` (the handler processor), not waiting."""
        args = [sys.executable, "manage.py", "outbox", "handlers", "run", *options]
        return self._spawn(name, args)

    def start_worker(self, pool: str = "threads", concurrency: int = 4) -> Proc:
        """Start a Celery worker consuming this run's queue."""
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.project.celery_app",
            "worker",
            "--pool",
            pool,
            "--concurrency",
            str(concurrency),
            "-Q",
            self.env["OUTBOX_TEST_QUEUE"],
            "--hostname",
            f"e2e-{os.getpid()}-{len(self.procs)}@%h",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "warning",
        ]
        env = dict(self.env, OUTBOX_TEST_BROKER_HEARTBEAT=str(WORKER_HEARTBEAT))
        return self._spawn("worker", args, env=env)

    def assert_alive(self) -> None:
        """Every long-running process is still running (nothing crashed)."""
        dead = [p for p in self.procs if p.long_running and not p.alive()]
        assert not dead, "\n".join(
            f"{p.name} exited with {p.popen.returncode}:\n{p.output()}" for p in dead
        )

    def stop_all(self) -> dict[str, int]:
        """Terminate every process still running, all at once; returns exit codes by name."""
        for proc in self.procs:
            proc.send_sigterm()
        return {proc.name: proc.terminate() for proc in self.procs}

    def report(self) -> str:
        parts = []
        for proc in self.procs:
            parts.append(
                f"===== {proc.name} (pid {proc.pid}, exit {proc.popen.returncode}): "
                f"{' '.join(proc.args[1:])}\n{proc.output()}"
            )
        return "\n".join(parts)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, Any]:
    report = yield
    setattr(item, f"_e2e_report_{report.when}", report)
    return report


@pytest.fixture
def e2e(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    transactional_db: None,
    settings: Any,
    test_queue: str,
) -> Iterator[Callable[..., Stack]]:
    """Factory: ``e2e(vendor="postgresql", broker=BROKER_AMQP)`` -> :class:`Stack`."""
    stacks: list[Stack] = []

    def make(vendor: str = "postgresql", broker: str = BROKER_AMQP) -> Stack:
        alias = alias_for(vendor)
        if alias != "default":
            settings.CELERY_OUTBOX_DATABASE = alias
        database = connections[alias].settings_dict["NAME"]
        assert Path(str(database)).name.startswith("test_"), (
            f"refusing to point subprocesses at a non-test database {database!r}"
        )
        env = dict(os.environ)
        env.update(
            DJANGO_SETTINGS_MODULE="tests.project.settings",
            OUTBOX_TEST_DB=vendor,
            OUTBOX_TEST_DB_NAME=str(database),
            OUTBOX_TEST_QUEUE=test_queue,
            OUTBOX_TEST_BROKER=broker,
            PYTHONUNBUFFERED="1",
        )
        # Django 6.1 runs a command's model checks on every database, and MySQL's
        # connect to theirs: the subprocesses' MySQL alias names this run's test one.
        for connection in connections.all():
            if connection.vendor == "mysql":
                env["OUTBOX_MYSQL_NAME"] = str(connection.settings_dict["NAME"])
        logs = tmp_path / f"stack{len(stacks)}"
        logs.mkdir()
        stack = Stack(vendor, alias, broker, env, logs)
        stacks.append(stack)
        return stack

    yield make

    for stack in stacks:
        stack.stop_all()
    if any(stack.broker.startswith("redis://") for stack in stacks):
        _forget_redis_queue(test_queue)
    passed = all(
        getattr(request.node, f"_e2e_report_{when}", None) is None
        or getattr(request.node, f"_e2e_report_{when}").passed
        for when in ("setup", "call")
    )
    if not passed:
        for stack in stacks:
            print(f"\n##### {stack.vendor} / {stack.broker}\n{stack.report()}")


def _forget_redis_queue(queue: str) -> None:
    """Drop what kombu's Redis transport keeps for this run's queue (the list and bindings)."""
    import redis

    client = redis.Redis.from_url(BROKER_REDIS)
    try:
        client.delete(
            queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}"
        )
    finally:
        client.close()
