"""The operator's kit in ``deploy/``, held to the package and to the tools that read it.

* Kubernetes manifests: valid against the Kubernetes schemas (``kubernetes-validate``,
  strict: an unknown field fails), their commands parsed by the real ``manage.py
  outbox`` parser, their probes run against a fresh, a stale and a missing file.
* Prometheus alert rules: ``promtool check rules`` and ``promtool test rules``.
* The Grafana dashboard: every query parsed by promtool.
* Every metric the rules and the dashboard name is one the package exports, read
  from a Prometheus registry that a real relay and a real handler-metrics observer
  filled; the dashboard shows every one, and docs/observability.md lists every one.

promtool comes from Debian's ``prometheus`` package (``scripts/tools.sh``): without
it these tests skip, except in CI (``CI=true``), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
import yaml

from celery_outbox.broker import InMemoryPublisher
from celery_outbox.conf import OutboxSettings
from celery_outbox.envelope import StoredMessage
from celery_outbox.handlers.metrics import HandlerMetrics
from celery_outbox.handlers.observations import MessageHandled, PassDone
from celery_outbox.metrics import RelayMetrics
from celery_outbox.outcomes import Action, Outcome, PublishResult
from celery_outbox.relay.config import RelayConfig
from celery_outbox.relay.loop import Relay
from celery_outbox.sinks import PrometheusSink
from celery_outbox.store.handlers import HandlerStats
from celery_outbox.store.memory import InMemoryStore
from celery_outbox.store.memory_operator import InMemoryOperatorQueries
from tests import servers

from ..integration.builders import envelope
from .fakes import FakeClock, FakeWaiter

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
RULES = DEPLOY / "prometheus" / "celery-outbox-alerts.yaml"
RULE_TESTS = DEPLOY / "prometheus" / "celery-outbox-alerts.test.yaml"
DASHBOARD = DEPLOY / "grafana" / "celery-outbox.json"
METRIC = re.compile(r"\bcelery_outbox_[a-z0-9_]+\b")
#: The oldest and the newest Kubernetes the manifests are checked against (the
#: schemas of kubernetes-validate 1.37, the lower bound of the test extra).
KUBERNETES = ("1.25.0", "1.37.0")
#: What the processes under the manifests run: (Deployment, the command's verb).
COMMANDS = {"outbox-relay": ["relay"], "outbox-handlers": ["handlers", "run"]}


def tool(name: str) -> str:
    """The path of a Debian program the kit's checks run; skip or fail without it."""
    found = shutil.which(name)
    if found:
        return found
    message = f"{name} is missing: run `bash scripts/tools.sh` (make tools)"
    if servers.in_ci():
        pytest.fail(message)
    pytest.skip(message)


# -- the metrics the package exports ----------------------------------------------


def refuse_some(message: StoredMessage) -> PublishResult | None:
    if message.envelope.task_id.startswith("refused"):
        return PublishResult(message.id, Outcome.FAILED, "NotFound: no queue")
    return None


def fill(registry: Any) -> None:
    """Let a real relay and the handler metrics report into ``registry``."""
    sink = PrometheusSink(registry)
    clock = FakeClock()
    store = InMemoryStore(clock)
    store.add([envelope("published"), envelope("refused")])
    relay = Relay(
        store,
        InMemoryPublisher(refuse_some),
        RelayConfig.from_settings(OutboxSettings()),
        clock=clock,
        waiter=FakeWaiter(clock),
        observers=[RelayMetrics(sink, InMemoryOperatorQueries(store.tables))],
    )
    relay.run_once()

    def stats(alias: str) -> HandlerStats:
        return HandlerStats(
            database=alias,
            messages=1,
            shards=1,
            blocked=0,
            paused_shards=0,
            paused_categories=(),
            paused_shard_keys=(),
            oldest_age=2.0,
            lag=2.0,
            dead_letters=0,
        )

    handlers = HandlerMetrics(sink, ["default"], stats=stats)
    handlers(MessageHandled("default", "s", "c", Action.DELETE, 1, 0.1, 1.0))
    handlers(PassDone(1))


@pytest.fixture(scope="module")
def exported() -> dict[str, str]:
    """Every sample name the package exports, mapped to its family's documented name
    (``published_total``, ``batch_duration_seconds``, ``pending``)."""
    registry = prometheus_client.CollectorRegistry()
    fill(registry)
    found: dict[str, str] = {}
    for family in registry.collect():
        documented = family.name + ("_total" if family.type == "counter" else "")
        for sample in family.samples:
            if not sample.name.endswith("_created"):  # prometheus_client's own
                found[sample.name] = documented.removeprefix("celery_outbox_")
    return found


def named_in(text: str) -> set[str]:
    return set(METRIC.findall(text))


def dashboard_panels() -> Iterator[dict[str, Any]]:
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries() -> list[str]:
    return [
        target["expr"]
        for panel in dashboard_panels()
        for target in panel.get("targets", [])
    ]


def test_the_registry_holds_the_metrics_of_both_processes(
    exported: dict[str, str],
) -> None:
    families = set(exported.values())
    assert {"published_total", "commit_to_publish_seconds", "blocked_keys"} <= families
    assert {"handler_processed_total", "handler_shards_paused"} <= families


def test_the_metrics_page_lists_every_exported_metric(
    exported: dict[str, str],
) -> None:
    page = (ROOT / "docs" / "observability.md").read_text()
    listed = set(re.findall(r"`([a-z_]+)`", page))
    assert set(exported.values()) - listed == set()


def test_the_alert_rules_name_only_exported_metrics(exported: dict[str, str]) -> None:
    used = named_in(RULES.read_text())
    assert used, "no metric found in the rules"
    assert used - set(exported) == set()


def test_every_dashboard_query_names_exported_metrics_and_every_metric_is_shown(
    exported: dict[str, str],
) -> None:
    queries = dashboard_queries()
    for panel in dashboard_panels():
        if panel["type"] != "row":
            assert panel.get("targets"), f"panel {panel['title']!r} has no query"
    used = set().union(*(named_in(q) for q in queries))
    assert used - set(exported) == set()
    assert set(exported.values()) - {exported[name] for name in used} == set()


def test_the_dashboard_panels_have_unique_ids_and_use_the_datasource_variable() -> None:
    panels = list(dashboard_panels())
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


# -- promtool ----------------------------------------------------------------------


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("promtool"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_promtool_checks_the_alert_rules() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


def test_promtool_runs_the_alert_rules_unit_tests() -> None:
    tested = promtool("test", "rules", str(RULE_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Every alert has a test that makes it fire.
    alerts = {
        rule["alert"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    }
    firing = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts - firing == set()


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    # promtool parses PromQL in rule files: each query becomes a recording rule,
    # Grafana's $__rate_interval the range it stands for.
    rules = [
        {"record": f"celery_outbox:dashboard_query_{n}", "expr": query}
        for n, query in enumerate(dashboard_queries())
    ]
    text = yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(text.replace("$__rate_interval", "5m"))
    checked = promtool("check", "rules", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr


# -- Kubernetes ----------------------------------------------------------------------


def resources() -> list[dict[str, Any]]:
    return [
        document
        for path in MANIFESTS
        for document in yaml.safe_load_all(path.read_text())
        if document
    ]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [r for r in resources() if r["kind"] == kind]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(only)


def flag(command: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in command if a.startswith(f"--{name}=")]
    return value


def validator() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        if servers.in_ci():
            raise
        pytest.skip("kubernetes-validate is missing: pip install -e '.[test]'")
    return kubernetes_validate


def test_the_manifests_hold_a_deployment_and_a_disruption_budget_per_process() -> None:
    assert [p.name for p in MANIFESTS] == ["handlers.yaml", "relay.yaml"]
    names = {d["metadata"]["name"] for d in of_kind("Deployment")}
    assert names == set(COMMANDS)
    assert {p["metadata"]["name"] for p in of_kind("PodDisruptionBudget")} == names


@pytest.mark.parametrize("version", KUBERNETES)
def test_the_manifests_are_valid_kubernetes(version: str) -> None:
    kubernetes_validate = validator()
    for resource in resources():
        kubernetes_validate.validate(resource, version, strict=True)


def test_the_schema_check_refuses_a_misspelt_field() -> None:
    kubernetes_validate = validator()
    (deployment,) = [
        d for d in of_kind("Deployment") if d["metadata"]["name"] == "outbox-relay"
    ]
    spec = deployment["spec"]["template"]["spec"]["containers"][0]
    spec["livenesProbe"] = spec.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES[-1], strict=True)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_is_one_the_outbox_command_accepts(name: str) -> None:
    from django.core.management import load_command_class

    (deployment,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == name]
    command = container(deployment)["command"]
    assert command[:3] == ["python", "manage.py", "outbox"]
    assert command[3 : 3 + len(COMMANDS[name])] == COMMANDS[name]
    outbox = load_command_class("celery_outbox", "outbox")
    parser = outbox.create_parser("manage.py", "outbox")
    options = vars(parser.parse_args(command[3:]))  # exits on an unknown flag
    assert options["liveness_file"] and options["metrics_port"]


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_deployment_keeps_serving_through_rollouts_and_drains(name: str) -> None:
    (deployment,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == name]
    (budget,) = [
        p for p in of_kind("PodDisruptionBudget") if p["metadata"]["name"] == name
    ]
    spec = deployment["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # A budget that lets no pod go would block every node drain.
    assert budget["spec"]["maxUnavailable"] >= 1
    process = container(deployment)
    assert process["resources"]["requests"].keys() == {"cpu", "memory"}
    assert "memory" in process["resources"]["limits"]
    assert process["readinessProbe"]["exec"]["command"][:3] == [
        "python",
        "manage.py",
        "outbox",
    ]
    port = int(flag(process["command"], "metrics-port"))
    annotations = spec["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    assert [p["containerPort"] for p in process["ports"]] == [port]


def test_the_relay_stops_within_its_grace_period() -> None:
    (deployment,) = [
        d for d in of_kind("Deployment") if d["metadata"]["name"] == "outbox-relay"
    ]
    command = container(deployment)["command"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    shutdown = float(flag(command, "shutdown-timeout"))
    send = float(flag(command, "send-timeout"))
    # A batch in flight ends by the earlier of its send timeout and SIGTERM plus the
    # shutdown timeout; then one settlement's transaction and the exit.
    assert grace >= min(shutdown, send) + 10
    assert grace >= shutdown + 5


def run_probe(command: list[str]) -> int:
    return subprocess.run(command, capture_output=True, timeout=30).returncode


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_liveness_probes_read_the_file_the_process_touches(
    name: str, tmp_path: Path
) -> None:
    (deployment,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == name]
    process = container(deployment)
    path = flag(process["command"], "liveness-file")
    volumes = {m["mountPath"] for m in process["volumeMounts"]}
    assert str(Path(path).parent) in volumes  # writable under a read-only root
    alive = tmp_path / "alive"
    for probe in ("startupProbe", "livenessProbe"):
        command = process[probe]["exec"]["command"]
        assert path in " ".join(command), probe
        assert command[0] == "python"
        here = [sys.executable, *(a.replace(path, str(alive)) for a in command[1:])]
        assert run_probe(here) != 0, f"{probe} passes before the file exists"
        alive.touch()
        assert run_probe(here) == 0, (
            f"{probe} fails on a fresh file: {shlex.join(here)}"
        )
        old = time.time() - 120
        os.utime(alive, (old, old))
        assert run_probe(here) != 0, f"{probe} passes on a file two minutes old"
        alive.unlink()
    liveness = process["livenessProbe"]
    # Long enough that one slow publish (the send timeout) or receiver between two
    # touches never restarts a working process; short enough to catch a stuck one.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] <= 60
