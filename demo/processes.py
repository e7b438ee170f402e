"""The demo's processes: the relay and the Celery workers, each logging to ``demo/var``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from demo.config import PACKAGE_DIR

REPO_ROOT = PACKAGE_DIR.parent
SETTINGS_MODULE = "demo.settings"


class DemoFailed(Exception):
    """The demo could not run (a process died, something timed out)."""


class Child:
    """A subprocess with its output in a log file under ``demo/var``."""

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name = name
        self.log = log
        env = dict(
            os.environ, DJANGO_SETTINGS_MODULE=SETTINGS_MODULE, PYTHONUNBUFFERED="1"
        )
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        self._log_file = log.open("wb")
        # A session of its own: Ctrl-C reaches only the driver, which then stops the
        # children in order (relay first, then the worker).
        self.process = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise DemoFailed(f"the {self.name} exited with code {code}:\n{self.tail()}")

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM); :meth:`stop` waits for it."""
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> None:
        self.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"  {self.name} did not stop within {timeout:.0f} s; killing it")
            self.process.kill()
            self.process.wait()
        if not self._log_file.closed:
            self._log_file.close()

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "    (no log)"
        return "\n".join(f"    | {line}" for line in text) or "    (empty log)"


def stop_all(children: list[Child]) -> None:
    """The relay first (nothing new reaches the broker), then every worker at once."""
    quiet = not any(child.running for child in children)
    started = time.monotonic()
    if not quiet:
        print("Stopping the relay and the workers ...", end=" ", flush=True)
    relays = [child for child in children if child.name == "relay"]
    workers = [child for child in children if child.name != "relay"]
    for child in relays:
        child.stop()
    for child in workers:  # warm shutdowns, side by side
        child.terminate()
    for child in workers:
        child.stop()
    if not quiet:
        print(f"done ({time.monotonic() - started:.1f} s).")


def start_relay(var: Path) -> Child:
    argv = [sys.executable, "-m", "django", "outbox", "relay"]
    argv += ["--liveness-file", str(var / "relay.alive")]
    return Child("relay", argv, var / "relay.log")


def start_worker(var: Path, app: str, queue: str, name: str = "worker") -> Child:
    """A solo worker of ``app`` (a module); ``name`` also names its log."""
    argv = [sys.executable, "-m", "celery", "-A", app, "worker"]
    argv += [
        "--pool",
        "solo",
        "--loglevel",
        "warning",
        "--hostname",
        f"{name}-{queue}@%h",
    ]
    argv += ["--without-mingle", "--without-gossip", "--without-heartbeat"]
    if app != "demo.celery":
        # A service's worker consumes its event queues only, not the tasks' queue.
        argv += ["--exclude-queues", queue]
    return Child(name, argv, var / f"{name}.log")


def wait_until_ready(children: list[Child], files: list[Path], timeout: float) -> float:
    """Wait for the relay's liveness file and the worker's ready file."""
    started = time.monotonic()
    while not all(path.exists() for path in files):
        for child in children:
            child.check_alive()
        if time.monotonic() - started > timeout:
            missing = ", ".join(p.name for p in files if not p.exists())
            logs = "\n".join(f"  {c.name} log:\n{c.tail()}" for c in children)
            raise DemoFailed(
                f"not ready after {timeout:.0f} s (missing {missing}).\n{logs}"
            )
        time.sleep(0.05)
    return time.monotonic() - started
