"""The commands and probes of ``deploy/kubernetes``, run as Kubernetes would run them.

Each Deployment's container command starts as a real process on the test database
(its liveness file and metrics port moved to this test's; the processor and its
probe told ``--database`` the test's, as the test project's other aliases name
databases this test does not create); its startup, liveness
and readiness probes pass against it; and SIGTERM stops it within the manifest's
``terminationGracePeriodSeconds``, with its work handed back or finished: the relay
mid-backlog (no row left leased), the processor mid-receiver (the receiver in hand
commits once).
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.db import transaction
from django.utils import timezone
from kombu import Connection

from celery_outbox.handlers import emit
from celery_outbox.handlers.models import HandlerMessage
from celery_outbox.models import OutboxMessage
from celery_outbox.store import Stores
from tests.e2e.conftest import BROKER_AMQP, Proc, Stack, wait_until
from tests.integration.builders import envelope
from tests.project.shop.models import TaskRun
from tests.project.shop.receivers import STALLED
from tests.topologies import free_port

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(240),
]

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
#: Rows waiting when the relay is told to stop: more than it publishes in a moment.
BACKLOG = 5000


def deployment(file: str) -> dict[str, Any]:
    (found,) = [
        d
        for d in yaml.safe_load_all((KUBERNETES / file).read_text())
        if d and d["kind"] == "Deployment"
    ]
    return dict(found)


class Pod:
    """One Deployment's container as a local process: its command, probes and grace."""

    def __init__(self, file: str, folder: Path, *extra: str) -> None:
        spec = deployment(file)["spec"]["template"]["spec"]
        (self.container,) = spec["containers"]
        self.grace = float(spec["terminationGracePeriodSeconds"])
        command = self.container["command"]
        self.liveness = self.flag(command, "liveness-file")
        self.alive = folder / "alive"
        self.metrics_port = free_port()
        self.extra = list(extra)
        self.command = [self.local(arg) for arg in command] + self.extra

    @staticmethod
    def flag(command: list[str], name: str) -> str:
        (value,) = [a.split("=", 1)[1] for a in command if a.startswith(f"--{name}=")]
        return value

    def local(self, arg: str) -> str:
        """The argument with this test's file, port and Python."""
        if arg == "python":
            return sys.executable
        if arg.startswith("--metrics-port="):
            return f"--metrics-port={self.metrics_port}"
        return arg.replace(self.liveness, str(self.alive))

    def probe(self, name: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        command = [self.local(a) for a in self.container[name]["exec"]["command"]]
        if command[1:5] == ["manage.py", "outbox", "handlers", "stats"]:
            command += self.extra
        timeout = self.container[name].get("timeoutSeconds", 1)
        return subprocess.run(
            command,
            cwd=KUBERNETES.parents[1],
            env=env,
            capture_output=True,
            text=True,
            timeout=max(timeout, 30),
            check=False,
        )

    def metrics(self) -> str:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as answer:
            return str(answer.read().decode())


def start(stack: Stack, pod: Pod) -> Proc:
    """Start the pod's command (``python manage.py outbox ...`` and its flags)."""
    command = pod.command
    assert command[:3] == [sys.executable, "manage.py", "outbox"]
    if command[3] == "relay":
        return stack.start_relay(*command[4:], wait=False)
    assert command[3:5] == ["handlers", "run"]
    return stack.start_handlers(*command[5:])


def stop_within_grace(proc: Proc, pod: Pod) -> float:
    """SIGTERM; the process must exit 0 before the grace period ends. Returns seconds."""
    began = time.monotonic()
    proc.send_sigterm()
    try:
        code = proc.popen.wait(pod.grace)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"{proc.name} still running {pod.grace:.0f} s after SIGTERM "
            f"(Kubernetes would kill it now):\n{proc.output()}"
        )
    took = time.monotonic() - began
    assert code == 0, proc.output()
    return took


def assert_probes_pass(pod: Pod, stack: Stack, proc: Proc) -> None:
    wait_until(pod.alive.exists, 45, "the liveness file", proc.output)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        answer = pod.probe(probe, stack.env)
        assert answer.returncode == 0, f"{probe}: {answer.stdout}{answer.stderr}"


@pytest.fixture
def own_queue() -> Iterator[str]:
    """A queue of this test's on the shared RabbitMQ, deleted afterwards."""
    name = f"outbox-deploy-{uuid.uuid4().hex[:10]}"
    yield name
    with Connection(BROKER_AMQP, connect_timeout=5) as connection:
        channel = connection.channel()
        try:
            channel.queue_delete(name)
            channel.exchange_delete(name)
        finally:
            channel.close()


def test_the_relay_deployment(
    e2e: Callable[..., Stack], tmp_path: Path, own_queue: str
) -> None:
    stack = e2e("postgresql")
    pod = Pod("relay.yaml", tmp_path)
    relay = start(stack, pod)
    relay.wait_for_output("relay started")
    assert_probes_pass(pod, stack, relay)
    exported = pod.metrics()
    assert "celery_outbox_breaker_open 0.0" in exported
    assert "celery_outbox_dead_lettered_total 0.0" in exported

    with transaction.atomic():
        Stores("default").writer().insert(
            [
                envelope(
                    f"deploy-{n}",
                    routing_key=own_queue,
                    declare=(own_queue,),
                    queue=own_queue,
                )
                for n in range(BACKLOG)
            ],
            notify=True,
        )
    wait_until(
        lambda: OutboxMessage.objects.count() < BACKLOG,
        30,
        "the relay to start on the backlog",
        relay.output,
        interval=0.01,
    )
    took = stop_within_grace(relay, pod)
    left = OutboxMessage.objects.filter(available_at__gt=timezone.now()).count()
    print(
        f"relay: {BACKLOG - OutboxMessage.objects.count()} of {BACKLOG} published, "
        f"stopped {took:.2f} s after SIGTERM (grace {pod.grace:.0f} s)"
    )
    # What it had not published went back at once, for the next relay: none waits
    # out a lease.
    assert left == 0, f"{left} rows still leased to the stopped relay"


def test_the_handler_processor_deployment(
    e2e: Callable[..., Stack], tmp_path: Path
) -> None:
    stack = e2e("postgresql")
    pod = Pod("handlers.yaml", tmp_path, f"--database={stack.alias}")
    processor = start(stack, pod)
    assert_probes_pass(pod, stack, processor)
    assert "celery_outbox_handler_dead_lettered_total 0.0" in pod.metrics()

    started = tmp_path / "started"
    tag = uuid.uuid4().hex
    with transaction.atomic():
        emit(
            STALLED,
            shard=("org", 1),
            object_id=1,
            payload={"tag": tag, "started": str(started), "stall": 3},
        )
    wait_until(started.exists, 45, "the receiver to start", processor.output)
    took = stop_within_grace(processor, pod)
    print(f"processor stopped {took:.2f} s after SIGTERM (grace {pod.grace:.0f} s)")
    # The receiver in hand finished and committed with its message, once.
    assert took >= 2.0, "the processor did not wait for the receiver in hand"
    assert TaskRun.objects.filter(tag=tag).count() == 1
    assert not HandlerMessage.objects.filter(category=STALLED).exists()
