"""System checks: each problem gives its stable id, a healthy project gives none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.db import connections, transaction
from django.db.migrations.recorder import MigrationRecorder
from django.test import override_settings

from celery_outbox.checks import (
    check_app,
    check_migrations,
    check_redactor,
    check_routing,
    check_settings,
)

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

APP = "tests.project.celery_app.app"
#: Aliases whose DDL is transactional, so a test can drop a table and roll it back.
TRANSACTIONAL_DDL = [
    alias
    for alias, config in settings.DATABASES.items()
    if "mysql" not in config["ENGINE"]
]


class Rollback(Exception):
    pass


def ids(messages: list[object]) -> list[str]:
    return [str(getattr(m, "id", "")) for m in messages]


def test_a_healthy_project_has_no_outbox_findings(alias: str) -> None:
    with override_settings(CELERY_OUTBOX_APP=APP):
        found = run_checks(tags=["celery_outbox"], databases=[alias])
    assert ids(found) == []  # W001 (SQLite) is silenced in the test settings


def test_existing_ids_are_unchanged() -> None:
    with override_settings(CELERY_OUTBOX_BATCH_SIZE=0):
        assert ids(check_settings()) == ["celery_outbox.E001"]
    with override_settings(CELERY_OUTBOX_DATABASE="nowhere"):
        assert ids(check_settings()) == ["celery_outbox.E002"]
    with override_settings(CELERY_OUTBOX_CONFIRM_PUBLISH=False):
        assert "celery_outbox.W002" in ids(check_settings())


def test_the_celery_app_must_be_an_outbox_celery() -> None:
    with override_settings(CELERY_OUTBOX_APP=APP):
        assert check_app() == []
    with override_settings(CELERY_OUTBOX_APP="tests.project.shop.tasks.record"):
        (error,) = check_app()
    assert error.id == "celery_outbox.E004"
    assert "not an OutboxCelery" in error.msg
    with override_settings(CELERY_OUTBOX_APP="tests.project.nowhere.app"):
        assert ids(check_app()) == ["celery_outbox.E004"]


def test_the_redactor_must_import_and_be_callable() -> None:
    assert check_redactor() == []
    with override_settings(
        CELERY_OUTBOX_REDACTOR="tests.integration.redactors.hide_passwords"
    ):
        assert check_redactor() == []
    with override_settings(
        CELERY_OUTBOX_REDACTOR="tests.integration.redactors.not_callable"
    ):
        (error,) = check_redactor()
    assert (error.id, "not a callable" in error.msg) == ("celery_outbox.E005", True)
    with override_settings(CELERY_OUTBOX_REDACTOR="tests.integration.redactors.gone"):
        assert ids(check_redactor()) == ["celery_outbox.E005"]
    with override_settings(CELERY_OUTBOX_REDACTOR=42):
        assert ids(check_settings()) == ["celery_outbox.E001"]


@pytest.mark.parametrize("alias", TRANSACTIONAL_DDL)
def test_missing_tables_are_reported(alias: str) -> None:
    with override_settings(CELERY_OUTBOX_DATABASE=alias):
        assert check_migrations(databases=[alias]) == []
        with pytest.raises(Rollback), transaction.atomic(using=alias):
            with connections[alias].cursor() as cursor:
                cursor.execute("DROP TABLE celery_outbox_deadletter")
            (warning,) = check_migrations(databases=[alias])
            raise Rollback
    assert warning.id == "celery_outbox.W003"
    assert "celery_outbox_deadletter" in warning.msg
    assert f"--database {alias}" in str(warning.hint)


def test_unapplied_migrations_are_reported(alias: str) -> None:
    with override_settings(CELERY_OUTBOX_DATABASE=alias):
        # Another database asked for (manage.py check --database other): not ours.
        assert check_migrations(databases=["elsewhere"]) == []
        with pytest.raises(Rollback), transaction.atomic(using=alias):
            MigrationRecorder(connections[alias]).migration_qs.filter(
                app="celery_outbox"
            ).delete()
            (warning,) = check_migrations(databases=[alias])
            # A plain `manage.py check` (no --database) says so too.
            assert check_migrations(databases=None) == [warning]
            raise Rollback
    assert warning.id == "celery_outbox.W004"
    assert "0001_initial" in warning.msg


def manage(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``manage.py ARGS`` of the test project, its default database a new SQLite file."""
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.project.settings",
        OUTBOX_TEST_DB="sqlite",
        OUTBOX_TEST_SQLITE_DIR=str(folder),
        PYTHONUNBUFFERED="1",
    )
    env.pop("OUTBOX_TEST_DB_NAME", None)
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_migrate_does_not_warn_about_the_tables_it_creates(tmp_path: Path) -> None:
    # Before the tables exist, `check` says so, and names the command to run.
    checked = manage(tmp_path, "check", "--database", "default")
    assert checked.returncode == 0, checked.stderr
    assert "celery_outbox.W003" in checked.stderr
    assert "Run: python manage.py migrate" in checked.stderr

    # `migrate` on that new database creates them: it does not tell the user to
    # run the command they are running.
    migrated = manage(tmp_path, "migrate", "--database", "default")
    assert migrated.returncode == 0, migrated.stderr
    assert "Applying celery_outbox.0001_initial... OK" in migrated.stdout
    assert "celery_outbox.W003" not in migrated.stderr + migrated.stdout
    assert "celery_outbox.W004" not in migrated.stderr + migrated.stdout

    # Afterwards, nothing to say.
    checked = manage(tmp_path, "check", "--database", "default")
    assert "celery_outbox.W00" not in checked.stderr, checked.stderr


def test_business_models_on_another_alias_are_reported() -> None:
    assert check_routing() == []
    other = next(alias for alias in settings.DATABASES if alias != "default")
    with override_settings(CELERY_OUTBOX_DATABASE=other):
        (warning,) = check_routing()
    assert warning.id == "celery_outbox.W005"
    assert "shop.Order" in warning.msg
    assert "'default'" in warning.msg
    assert "auth.User" not in warning.msg  # contrib apps are not business models


@pytest.mark.parametrize("alias", ["default", "mysql"])
def test_skip_locked_support_is_checked_on_the_real_server(alias: str) -> None:
    from celery_outbox.checks import check_skip_locked

    with override_settings(CELERY_OUTBOX_DATABASE=alias):
        assert check_skip_locked(databases=[alias]) == []
        features = connections[alias].features
        # A server too old to skip locked rows: Django reports it through this feature.
        features.has_select_for_update_skip_locked = False
        try:
            [error] = check_skip_locked(databases=[alias])
        finally:
            del features.has_select_for_update_skip_locked
    assert error.id == "celery_outbox.E006"
    assert connections[alias].features.has_select_for_update_skip_locked is True
