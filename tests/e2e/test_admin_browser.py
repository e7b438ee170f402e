"""The outbox admin in a real headless browser (Debian's chromium through Selenium).

A live Django server (pytest-django's ``live_server``) serves the admin on the
test database; the test logs in through the login form, reads the rendered summary
and rows, runs "retry now" through the action form and opens a dead letter. It
screenshots the outbox changelist (into ``docs/admin-outbox.png`` when
``OUTBOX_UPDATE_SCREENSHOT`` is set, else into the test's temporary folder).

Chromium and chromedriver come from Debian (``scripts/tools.sh`` installs them);
selenium-manager is never asked to download anything. A browser that cannot start
fails the test: it is not skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import django.contrib.admin
import pytest
from django.contrib.auth import get_user_model
from django.db import transaction
from django.test import override_settings
from django.utils import timezone
from pytest_django.live_server_helper import LiveServer
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.select import Select
from selenium.webdriver.support.wait import WebDriverWait

from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.store import RelayStore, Stores
from tests.integration.builders import dead_letter_due, envelope

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(120),
    pytest.mark.django_db(databases=["default"], transaction=True),
]

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The copy in docs/ is refreshed only on request, so a test run leaves the tree clean:
#: OUTBOX_UPDATE_SCREENSHOT=1 make test
DOCS_SCREENSHOT = REPO_ROOT / "docs" / "admin-outbox.png"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,900",
)
OUTBOX = "/admin/celery_outbox/outboxmessage/"
DEAD = "/admin/celery_outbox/deadletter/"
USER, PASSWORD = "operator", "correct horse battery staple"


@pytest.fixture(scope="session")
def admin_static_files() -> Iterator[None]:
    """Serve the admin's CSS and JavaScript from the live server (no staticfiles app here)."""
    root = Path(django.contrib.admin.__file__).parent / "static"
    with override_settings(STATIC_URL="/static/", STATIC_ROOT=str(root)):
        yield


@pytest.fixture(scope="session")
def live_server(admin_static_files: None, live_server: LiveServer) -> LiveServer:
    """pytest-django's live server, started once the static settings are in place."""
    return live_server


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    """Headless Debian chromium, 1400x900, with a throwaway profile; always quit."""
    missing = [
        path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)
    ]
    if missing:
        pytest.fail(
            f"{' and '.join(missing)} not found: run `bash scripts/tools.sh` "
            "(apt-get install chromium chromium-driver)",
            pytrace=False,
        )
    profile = tempfile.mkdtemp(prefix="outbox-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    offline = os.environ.get("SE_OFFLINE")
    os.environ["SE_OFFLINE"] = "true"  # selenium-manager must never download
    driver: WebDriver | None = None
    try:
        failure = ""
        try:
            driver = webdriver.Chrome(
                service=Service(executable_path=CHROMEDRIVER), options=options
            )
        except WebDriverException as exc:
            failure = str(exc.msg or exc)
        if driver is None:
            pytest.fail(
                f"headless chromium did not start ({CHROMIUM} via {CHROMEDRIVER}): "
                f"{failure}",
                pytrace=False,
            )
        driver.set_page_load_timeout(30)
        # Make the viewport (what the screenshot shows) 1400x900, not the window.
        width, height = driver.execute_script(
            "return [window.innerWidth, window.innerHeight]"
        )
        driver.set_window_size(1400 + 1400 - width, 900 + 900 - height)
        yield driver
    finally:
        if driver is not None:
            driver.quit()
        if offline is None:
            os.environ.pop("SE_OFFLINE", None)
        else:
            os.environ["SE_OFFLINE"] = offline
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(autouse=True)
def fast_passwords(settings: Any) -> None:
    """A cheap hasher: the login is what is tested, not PBKDF2's cost."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@dataclass(frozen=True)
class Rows:
    """What :func:`outbox_rows` wrote."""

    due: list[int]
    retrying: list[int]
    dead: list[int]


def insert(store: RelayStore, *tags: str, **overrides: object) -> list[int]:
    envelopes = [envelope(tag, **overrides) for tag in tags]
    with transaction.atomic(using=store.alias):
        Stores(store.alias).writer().insert(envelopes)
    return [OutboxMessage.objects.get(task_id=e.task_id).id for e in envelopes]


def message(
    task_name: str, queue: str, args: list[object], kwargs: dict[str, object]
) -> dict[str, object]:
    """Overrides for :func:`envelope`: another task name, queue and body."""
    return {
        "task_name": task_name,
        "queue": queue,
        "routing_key": queue,
        "declare": (queue,),
        "body": json.dumps([args, kwargs, {}]).encode(),
        "headers": {"task": task_name, "argsrepr": repr(tuple(args))},
    }


@pytest.fixture
def outbox_rows() -> Rows:
    """Two dead letters, two rows waiting for retry (refused once), three due rows."""
    store = Stores("default").relay()
    invoice = message(
        "billing.send_invoice", "billing", ["INV-2024-0042"], {"amount": "19.99"}
    )
    insert(store, "invoice-1", **invoice)
    insert(store, "invoice-2", **invoice)
    dead_letter_due(store, 10, "PreconditionFailed: too big")
    retrying = insert(
        store,
        "mail-1",
        "mail-2",
        **message("mail.send_welcome", "emails", ["alice@example.com"], {}),
    )
    claim = store.claim(10, 30)
    store.settle(
        claim.token,
        Settlement(
            retry=tuple(
                Decision(m.id, Action.RETRY, 900, "NotFound: no queue 'emails'")
                for m in claim.messages
            )
        ),
    )
    due = insert(store, "order-1", "order-2", "order-3")
    dead = sorted(DeadLetter.objects.values_list("id", flat=True))
    return Rows(due=due, retrying=retrying, dead=dead)


def login(browser: WebDriver, live_server: LiveServer, next_path: str) -> None:
    get_user_model().objects.create_superuser(USER, "ops@example.com", PASSWORD)
    browser.delete_all_cookies()
    browser.get(f"{live_server.url}/admin/login/?next={next_path}")
    # Fold the admin's navigation sidebar: the list gets the whole width.
    browser.execute_script(
        "localStorage.setItem('django.admin.navSidebarIsOpen', 'false')"
    )
    browser.find_element(By.ID, "id_username").send_keys(USER)
    browser.find_element(By.ID, "id_password").send_keys(PASSWORD)
    submit(browser, browser.find_element(By.CSS_SELECTOR, "#login-form [type=submit]"))
    assert browser.current_url == f"{live_server.url}{next_path}", (
        f"login did not reach {next_path}: {page_text(browser)[:500]}"
    )


def submit(browser: WebDriver, button: WebElement) -> None:
    """Click a submit button and wait until the next page has loaded."""
    old_page = browser.find_element(By.TAG_NAME, "html")
    button.click()
    WebDriverWait(browser, 15).until(expected_conditions.staleness_of(old_page))
    WebDriverWait(browser, 15).until(
        lambda driver: driver.execute_script("return document.readyState") == "complete"
    )


def page_text(browser: WebDriver) -> str:
    return browser.find_element(By.TAG_NAME, "body").text


def cells(row: WebElement) -> list[str]:
    return [cell.text for cell in row.find_elements(By.CSS_SELECTOR, "th, td")]


def summary(browser: WebDriver) -> dict[str, str]:
    return {
        cell_id: browser.find_element(By.ID, f"outbox-{cell_id}").text
        for cell_id in ("pending", "due", "retrying", "in-flight", "dead")
    }


def changelist_rows(browser: WebDriver) -> dict[str, list[str]]:
    """Changelist rows by task id: the visible cells after the checkbox."""
    rows = browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    return {cells(row)[2]: cells(row)[1:] for row in rows}


def test_outbox_changelist_in_a_browser(
    browser: WebDriver, live_server: LiveServer, outbox_rows: Rows, tmp_path: Path
) -> None:
    login(browser, live_server, OUTBOX)

    assert browser.title.startswith("Select outbox message to view"), browser.title
    assert summary(browser) == {
        "pending": "5",
        "due": "3",
        "retrying": "2",
        "in-flight": "0",
        "dead": "2",
    }
    oldest = browser.find_element(By.ID, "outbox-oldest").text
    assert oldest.endswith(" s"), oldest
    backlog = [
        cells(row)[:4]
        for row in browser.find_elements(By.CSS_SELECTOR, "#outbox-backlog tbody tr")
    ]
    assert backlog == [
        ["shop.record", "celery", "3", "3"],
        ["mail.send_welcome", "emails", "2", "0"],
    ]
    rows = changelist_rows(browser)
    assert len(rows) == 5
    retrying = [r for r in rows.values() if r[0] == "mail.send_welcome"]
    assert len(retrying) == 2
    for row in retrying:
        assert row[2] == "emails"  # queue
        assert row[3] == "1"  # attempts
        assert row[6] == "retrying"
        assert row[7] == "NotFound: no queue 'emails'"
    due = [r for r in rows.values() if r[0] == "shop.record"]
    assert [(r[2], r[3], r[6], r[7]) for r in due] == [("celery", "0", "due", "-")] * 3
    assert "5 outbox messages" in page_text(browser)
    # The admin's stylesheet applied: the header bar is laid out, not a bare page.
    header = browser.find_element(By.ID, "header")
    assert header.value_of_css_property("display") == "flex"

    browser.execute_script("window.scrollTo(0, 0)")
    shot = tmp_path / "admin-outbox.png"
    if os.environ.get("OUTBOX_UPDATE_SCREENSHOT"):
        shot = DOCS_SCREENSHOT
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_retry_now_through_the_action_form(
    browser: WebDriver, live_server: LiveServer, outbox_rows: Rows
) -> None:
    login(browser, live_server, OUTBOX)
    picked = outbox_rows.retrying[0]
    before = OutboxMessage.objects.get(id=picked).available_at
    assert before > timezone.now()

    browser.find_element(
        By.CSS_SELECTOR, f"input.action-select[value='{picked}']"
    ).click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("retry_now")
    submit(browser, browser.find_element(By.CSS_SELECTOR, "button[name=index]"))

    success = browser.find_element(By.CSS_SELECTOR, "ul.messagelist li.success")
    assert success.text == "1 message(s) will be published at once."
    assert OutboxMessage.objects.get(id=picked).available_at <= timezone.now()
    other = OutboxMessage.objects.get(id=outbox_rows.retrying[1])
    assert other.available_at > timezone.now()
    assert summary(browser) == {
        "pending": "5",
        "due": "4",
        "retrying": "1",
        "in-flight": "0",
        "dead": "2",
    }
    rows = changelist_rows(browser)
    picked_task = OutboxMessage.objects.get(id=picked).task_id
    assert rows[picked_task][6] == "due"
    assert rows[other.task_id][6] == "retrying"


def test_dead_letter_shows_decoded_arguments(
    browser: WebDriver, live_server: LiveServer, outbox_rows: Rows
) -> None:
    login(browser, live_server, DEAD)

    listed = browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    assert len(listed) == 2
    assert all("billing.send_invoice" in row.text for row in listed)
    dead = outbox_rows.dead[0]
    browser.get(f"{live_server.url}{DEAD}{dead}/change/")

    fields = {
        row.find_element(By.TAG_NAME, "label")
        .text.rstrip(":")
        .lower(): row.find_element(By.CSS_SELECTOR, ".readonly").text
        for row in browser.find_elements(By.CSS_SELECTOR, "fieldset .form-row")
    }
    assert fields["task name"] == "billing.send_invoice"
    assert fields["queue"] == "billing"
    assert fields["arguments"] == (
        "args   = ['INV-2024-0042']\nkwargs = {'amount': '19.99'}"
    )
    assert fields["last error"] == "PreconditionFailed: too big"
    assert "argsrepr" not in fields["headers"]
