"""The console by role (issue 34, item 8), against a real controller with a client
token, an operator token and a named read credential:

- ``/api/v1/session`` says the session's role and the actions it may take;
- an action (``POST /api/v1/actions/replay-dead-letters``) is refused 403 for a read or
  client session, naming the role needed and the one held, and nothing runs; an
  operator session runs it (through the controller's own RPC);
- in a browser, the action's button shows for an operator and stays hidden for a
  client (when chromium is installed, as tests/integration/test_ui.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any, Iterator
from urllib.parse import urlencode

import pytest

from tests.integration.ui_cluster import OPERATOR, TOKEN, Console, start_console
from tests.support.service_cluster import ROOT, wait_for

pytestmark = pytest.mark.timeout(300)
CHROMIUM = "/usr/bin/chromium"
ACTION = "/api/v1/actions/replay-dead-letters"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Console, str]]:
    tmp = tmp_path_factory.mktemp("console-roles")
    con = start_console(tmp, workers=1)
    try:
        made = subprocess.run([sys.executable, "-m", "services.cli", "credentials", "create", "viewer",
                               "--role", "read", "--json", "--store", con.cluster.store_url],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        viewer = str(json.loads(made.stdout)["token"])
        wait_for(lambda: con.get("/api/v1/session", viewer)[1]["authorized"], 10, "the console to know it")
        yield con, viewer
    finally:
        con.cluster.stop()


def login(con: Console, token: str) -> str:
    """The session cookie the login form sets for ``token``."""
    status, headers, _ = con.request("POST", "/login", FORM, urlencode({"token": token}).encode())
    assert status == 303 and "set-cookie" in headers, (status, headers)
    return headers["set-cookie"].split(";")[0]


def act(con: Console, cookie: str, body: Any, ctype: str = "application/json") -> tuple[int, Any]:
    status, _, raw = con.request("POST", ACTION, {"Cookie": cookie, "Content-Type": ctype},
                                 json.dumps(body).encode())
    return status, json.loads(raw)


def test_sessions_carry_their_role_and_only_an_operator_acts(console: tuple[Console, str]) -> None:
    con, viewer = console
    for token, role, actions in ((viewer, "read", []), (TOKEN, "client", []),
                                 (OPERATOR, "operator", ["replay-dead-letters"])):
        status, session = con.get("/api/v1/session", token)
        assert status == 200 and (session["role"], session["actions"]) == (role, actions), session
    before = con.api("/api/v1/overview")["computations"]
    for token, held in ((viewer, "viewer (role read)"), (TOKEN, "client token (role client)")):
        cookie = login(con, token)
        assert con.request("GET", "/api/v1/overview", {"Cookie": cookie})[0] == 200  # reading is fine
        status, answer = act(con, cookie, {"computation": "counts"})
        assert status == 403, answer
        assert "needs role operator" in answer["error"] and held in answer["error"], answer
    assert con.api("/api/v1/overview")["computations"] == before
    # the operator's session runs it, through the controller's own RPC
    cookie = login(con, OPERATOR)
    status, answer = act(con, cookie, {"computation": "counts"})
    assert status == 200, answer
    assert answer == {"computation": "counts", "replayed": 0, "skipped": 0, "remaining": 0}
    status, answer = act(con, cookie, {"computation": "nope"})
    assert status == 404 and "nope" in answer["error"]
    # only JSON: a form posted from elsewhere is not an action
    status, answer = act(con, cookie, {"computation": "counts"}, ctype="application/x-www-form-urlencoded")
    assert status == 415
    status, answer = act(con, "millwheel_session=forged", {"computation": "counts"})
    assert status == 401


@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} missing")
def test_the_page_shows_the_action_only_to_an_operator(console: tuple[Console, str]) -> None:
    playwright_sync = pytest.importorskip("playwright.sync_api")
    con, _viewer = console
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"],
                                    headless=True)
        try:
            for token, shown in ((TOKEN, False), (OPERATOR, True)):
                ctx = browser.new_context()
                page = ctx.new_page()
                page.goto(con.url)
                page.locator("#login").wait_for(state="visible")
                page.fill("#token", token)
                page.click("#login button[type=submit]")
                page.locator("#spec").filter(has_text="name:").wait_for()  # the console drew
                assert page.locator("#replay-dead-letters").is_visible() is shown, token[:9]
                if shown:
                    page.click("#replay-dead-letters")
                    page.locator("#action-result").filter(has_text="replayed").wait_for()
                    assert "0 replayed" in page.locator("#action-result").inner_text()
                ctx.close()
        finally:
            browser.close()
