"""Fixtures of the end-to-end tests: real relay and worker processes on the test database.

``e2e(vendor, broker)`` returns a :class:`Stack`: it points the test process's outbox
at the pytest-django test database of ``vendor`` and starts ``manage.py outbox relay``
and ``celery worker`` subprocesses on that same database and broker. Every process
is stopped in teardown (SIGTERM, then SIGKILL), and its log is printed when the test
did not pass.

A stack some tests can share is a :class:`StackSpec`: a module-scoped ``shared_stack``
fixture starts it once, parametrized by the spec (``on_stack(spec)``), so pytest runs
the tests of one spec one after the other and stops that stack before it starts the
next (one queue, one stack at a time); the ``stack`` fixture hands it to each test.
Under pytest-xdist each worker process has its own queue and databases: it starts
the stack for the tests of it that it gets (``load`` hands them out in runs of
consecutive tests), so nothing depends on which worker runs which test.
(``--dist loadgroup`` would keep them together, but pytest-xdist 3.8's groups are
lost on pytest 9, whose node ids it can no longer rename.)
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

__all__ = [
    "BROKER_AMQP",
    "BROKER_REDIS",
    "Proc",
    "SharedStack",
    "Stack",
    "StackSpec",
    "alias_for",
    "on_stack",
    "wait_until",
]


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


def new_stack(vendor: str, broker: str, queue: str, logs: Path) -> Stack:
    """A stack (no process started yet) on ``vendor``'s test database and ``broker``."""
    alias = alias_for(vendor)
    database = connections[alias].settings_dict["NAME"]
    assert Path(str(database)).name.startswith("test_"), (
        f"refusing to point subprocesses at a non-test database {database!r}"
    )
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.project.settings",
        OUTBOX_TEST_DB=vendor,
        OUTBOX_TEST_DB_NAME=str(database),
        OUTBOX_TEST_QUEUE=queue,
        OUTBOX_TEST_BROKER=broker,
        PYTHONUNBUFFERED="1",
    )
    # Django 6.1 runs a command's model checks on every database, and MySQL's
    # connect to theirs: the subprocesses' MySQL alias names this run's test one.
    for connection in connections.all():
        if connection.vendor == "mysql":
            env["OUTBOX_MYSQL_NAME"] = str(connection.settings_dict["NAME"])
    logs.mkdir()
    return Stack(vendor, alias, broker, env, logs)


def point_outbox_at(stack: Stack, settings: Any) -> None:
    """The test process's outbox writes to ``stack``'s database."""
    if stack.alias != "default":
        settings.CELERY_OUTBOX_DATABASE = stack.alias


def test_passed(item: pytest.Item) -> bool:
    """The test's setup and call passed (or have not run)."""
    reports = (getattr(item, f"_e2e_report_{when}", None) for when in ("setup", "call"))
    return all(report is None or report.passed for report in reports)


@pytest.fixture
def e2e(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    transactional_db: None,
    settings: Any,
    test_queue: str,
) -> Iterator[Callable[..., Stack]]:
    """Factory: ``e2e(vendor="postgresql", broker=BROKER_AMQP)`` -> :class:`Stack`,
    the test's own: stopped at the end of the test."""
    stacks: list[Stack] = []

    def make(vendor: str = "postgresql", broker: str = BROKER_AMQP) -> Stack:
        stop_shared()  # its worker would consume this stack's queue too
        stack = new_stack(vendor, broker, test_queue, tmp_path / f"stack{len(stacks)}")
        point_outbox_at(stack, settings)
        stacks.append(stack)
        return stack

    yield make

    for stack in stacks:
        stack.stop_all()
    if any(stack.broker.startswith("redis://") for stack in stacks):
        _forget_redis_queue(test_queue)
    if not test_passed(request.node):
        for stack in stacks:
            print(f"\n##### {stack.vendor} / {stack.broker}\n{stack.report()}")


# -- stacks that tests share --------------------------------------------------------


@dataclass(frozen=True)
class StackSpec:
    """A stack tests can share: one worker and ``relays`` relays, started once.

    ``env`` adds to the subprocesses' environment (their settings); a test that
    needs a setting of its own, a stopped broker or a killed process has a stack of
    its own (the ``e2e`` fixture) instead.
    """

    vendor: str = "postgresql"
    broker: str = BROKER_AMQP
    pool: str = "threads"
    concurrency: int = 4
    relays: int = 1
    relay_options: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    #: Says what ``env`` sets, in the test id.
    label: str = ""

    @property
    def name(self) -> str:
        """The test id of the spec."""
        broker = "redis" if self.broker.startswith("redis://") else "rabbitmq"
        parts = [self.vendor, broker, f"{self.pool}{self.concurrency}", self.label]
        return "-".join(part for part in parts if part)

    def start(self, stack: Stack) -> None:
        """Start the worker, then the relays, and wait until each relay's loop runs."""
        stack.env.update(self.env)
        stack.start_worker(pool=self.pool, concurrency=self.concurrency)
        for n in range(self.relays):
            stack.start_relay(*self.relay_options, name=f"relay-{n + 1}")


def on_stack(*specs: StackSpec) -> pytest.MarkDecorator:
    """Run the test on the shared stack of each of ``specs``."""
    return pytest.mark.parametrize(
        "shared_stack", specs, indirect=True, ids=[spec.name for spec in specs]
    )


@dataclass
class SharedStack:
    """The stack of a :class:`StackSpec`, started when a test needs it.

    Every stack of a run consumes the run's queue, so one runs at a time: a test
    with a stack of its own stops the shared one first (:func:`stop_shared`), and
    the next test on it starts it again.
    """

    spec: StackSpec
    queue: str
    logs: Path
    current: Stack | None = None
    starts: int = 0

    def running(self) -> Stack:
        """The stack, started (again) if it is not running."""
        if self.current is None:
            stop_shared()
            self.starts += 1
            stack = new_stack(
                self.spec.vendor,
                self.spec.broker,
                self.queue,
                self.logs / f"{self.spec.name}-{self.starts}",
            )
            _RUNNING.append(self)
            self.current = stack
            self.spec.start(stack)
        return self.current

    def stop(self) -> None:
        if self.current is None:
            return
        stack, self.current = self.current, None
        _RUNNING.remove(self)
        stack.stop_all()
        if stack.broker.startswith("redis://"):
            _forget_redis_queue(self.queue)


#: The shared stacks running in this process (at most one).
_RUNNING: list[SharedStack] = []


def stop_shared() -> None:
    """Stop every shared stack of this process (before a stack that is not one)."""
    for shared in list(_RUNNING):
        shared.stop()


@pytest.fixture(scope="module")
def shared_stack(
    request: pytest.FixtureRequest,
    django_db_setup: None,
    tmp_path_factory: pytest.TempPathFactory,
    test_queue: str,
) -> Iterator[SharedStack]:
    """The stack of ``request.param`` (a :class:`StackSpec`), for the module's tests
    on it: pytest runs those one after the other, and stops this stack (this
    fixture's teardown) before it starts another's."""
    spec = getattr(request, "param", None)
    assert isinstance(spec, StackSpec), "parametrize shared_stack with on_stack(...)"
    shared = SharedStack(spec, test_queue, tmp_path_factory.mktemp("shared"))
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture
def stack(
    request: pytest.FixtureRequest,
    shared_stack: SharedStack,
    transactional_db: None,
    settings: Any,
) -> Iterator[Stack]:
    """The shared stack, for one test: every process of it still running when the
    test begins, the test's outbox on its database, and what the processes logged
    during the test printed if it did not pass."""
    current = shared_stack.running()
    current.assert_alive()
    point_outbox_at(current, settings)
    seen = {proc.name: len(proc.output()) for proc in current.procs}
    yield current
    if not test_passed(request.node):
        print(f"\n##### shared {current.vendor} / {current.broker}")
        for proc in current.procs:
            since = seen.get(proc.name, 0)
            print(
                f"===== {proc.name} (pid {proc.pid}, exit {proc.popen.returncode}), "
                f"from this test on:\n{proc.output()[since:]}"
            )


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
