"""The operations console in a real browser (headless Debian Chromium via Playwright).

A controller with ``--ui-port`` and a client token, two workers, the README's
quickstart pipeline and its clicks. Everything is asserted in the rendered page (what
an operator sees), not in the HTML source: login (a wrong token refused), the graph
showing every computation, watermarks advancing between two reads, a state lookup
returning the count, a poison record in the errors panel, at 1280x800 and at a narrow
width, and no error in the browser console.

``MILLWHEEL_SCREENSHOTS=docs/img`` saves the screenshots shown in the README there
(otherwise into the test's temporary directory).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from millwheel.record import Record
from services.ui.state_view import span, when
from tests.integration.ui_cluster import T0, Console, clicks, console_with_clicks, readme_pipeline
from tests.support.service_cluster import ROOT, wait_for

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WINDOW_US = 10_000_000  # the README pipeline's window

playwright_sync = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) is not installed")
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which(CHROMIUM) is None,
                       reason=f"{CHROMIUM} missing: ./dev.sh setup installs Debian's chromium"),
]


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    with console_with_clicks(tmp_path_factory.mktemp("ui"), workers=2) as con:
        yield con


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("MILLWHEEL_SCREENSHOTS")
    path = ROOT / where if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Page:
    """One browser tab, recording every console error and uncaught exception."""

    def __init__(self, browser: Any, width: int, height: int) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))

    def login(self, con: Console, token: str) -> None:
        p = self.page
        p.goto(con.url)
        p.locator("#login").wait_for(state="visible")
        p.fill("#token", token)
        p.click("#login button[type=submit]")

    def text(self, selector: str) -> str:
        return str(self.page.locator(selector).inner_text())

    def select(self, computation: str) -> None:
        self.page.select_option("#comp-select", computation)
        self.page.locator("#spec").filter(has_text=f"name: {computation}").wait_for()

    def fits(self) -> bool:
        """No horizontal scrolling of the page itself (wide parts scroll inside)."""
        return bool(self.page.evaluate(
            "document.documentElement.scrollWidth <= document.documentElement.clientWidth + 1"))


@pytest.fixture
def tab(browser: Any) -> Iterator[Page]:
    t = Page(browser, 1280, 800)
    try:
        yield t
        assert t.errors == [], f"browser console errors: {t.errors}"
    finally:
        t.context.close()


# WCAG contrast of every visible HTML element holding text against the first opaque
# background behind it (the SVG graph is checked through its node colours instead).
CONTRAST_JS = """
() => {
  const rgb = (c) => (c.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => {
    const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const bg = (el) => {
    for (let e = el; e; e = e.parentElement) {
      const c = rgb(getComputedStyle(e).backgroundColor);
      if (c.length === 3 || c[3] > 0) return c.slice(0, 3);
    }
    return [255, 255, 255];
  };
  const worst = [];
  for (const el of document.querySelectorAll("body *")) {
    if (el.closest("svg") || !el.offsetParent) continue;
    if (![...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim())) continue;
    const a = lum(rgb(getComputedStyle(el).color)), b = lum(bg(el));
    const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    if (ratio < 4.5) worst.push(`${el.tagName}#${el.id}.${el.className}: ${ratio.toFixed(2)}`);
  }
  return worst;
}
"""


def shown_watermark(text: str) -> datetime:
    return datetime.strptime(text.strip(), "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC)


def test_login_refuses_a_wrong_token_then_accepts_the_right_one(
        tab: Page, console: Console, shots: Path) -> None:
    tab.login(console, "not-the-token")
    tab.page.locator("#login-error").wait_for(state="visible")
    assert "Wrong token" in tab.text("#login-error")
    assert tab.page.locator("#console").is_hidden()
    assert tab.page.context.cookies() == []
    tab.page.screenshot(path=str(shots / "console-login.png"))
    tab.login(console, console.token)
    tab.page.locator("#graph svg").wait_for()
    cookie = tab.page.context.cookies()[0]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["value"] != console.token
    assert tab.page.locator("#login").is_hidden()


def test_graph_shows_every_computation_and_watermarks_advance(
        tab: Page, console: Console, shots: Path) -> None:
    tab.login(console, console.token)
    nodes = tab.page.locator("#graph g.node.computation")
    nodes.first.wait_for()
    names = {s["name"] for s in readme_pipeline()["computations"]}
    assert {nodes.nth(i).get_attribute("data-name") for i in range(nodes.count())} == names
    assert tab.page.locator("#graph g.node.injector[data-name=clicks]").count() == 1
    assert tab.page.locator("#graph g.node.sink[data-name=busy]").count() == 1
    assert tab.page.locator("#graph g.node.computation.ok").count() == len(names)  # coloured by health

    tab.select("counts")
    first = datetime.fromtimestamp((T0 + 29_500_000) / 1e6, UTC)
    tab.page.locator("#in-wm").filter(has_text=first.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]).wait_for()
    console.inject(clicks(60, start=60))  # the next 30 s of clicks
    # (it may pass through values in between while by_user's ranges catch up)
    final = datetime.fromtimestamp(max(r.timestamp for r in console.injected) / 1e6, UTC)
    second = wait_for(lambda: (w := shown_watermark(tab.text("#in-wm"))) == final and w, 60,
                      "the page's watermark to reach the last click")
    assert second > first
    # every click reached counts once (as the workers counted it)
    tab.page.locator("#totals").filter(has_text=f"{len(console.injected)} in,").wait_for(timeout=30_000)
    assert tab.fits()


def test_state_lookup_shows_the_count_of_the_open_window(tab: Page, console: Console, shots: Path) -> None:
    tab.login(console, console.token)
    tab.page.locator("#graph svg").wait_for()
    tab.select("counts")
    last = max(r.timestamp for r in console.injected)
    start = T0 + (last - T0) // WINDOW_US * WINDOW_US  # the window still open
    expected = sum(1 for r in console.injected if json.loads(r.value)["user"] == "ann"
                   and start <= r.timestamp < start + WINDOW_US)
    tab.page.fill("#state-key", "ann")
    tab.page.click("#state-form button[type=submit]")
    result = tab.page.locator("#state-result")
    result.filter(has_text="state (window_aggregate):").wait_for()
    text = result.inner_text()  # fields named, times readable (issue 33)
    window = text.split(f"window {span(start, start + WINDOW_US)}\n", 1)[1]
    assert re.match(r"\s+count: (\d+)\n", window).group(1) == str(expected) and expected > 0, text  # type: ignore[union-attr]
    assert "timers:" in text and \
        f"end:{when(start)} at {when(start + WINDOW_US - 1)} UTC (event, holds the watermark)" in text, text
    assert tab.fits()
    assert tab.page.evaluate(CONTRAST_JS) == []  # every text at least 4.5:1 (WCAG AA)
    tab.page.screenshot(path=str(shots / "console.png"))
    tab.page.screenshot(path=str(shots / "console-full.png"), full_page=True)
    # the key list pages through the keys with state; a click looks the key up
    keys = tab.page.locator("#keys li a")
    keys.first.wait_for()
    listed = [keys.nth(i).inner_text() for i in range(keys.count())]
    assert listed == sorted(console.cluster.client.keys("counts"))[:30]
    keys.first.click()
    result.filter(has_text=f'key "{listed[0]}"').wait_for()


def test_a_poison_record_shows_in_the_errors_panel(tab: Page, console: Console, shots: Path) -> None:
    console.inject([Record("poison-7", b"<not json>", max(r.timestamp for r in console.injected), "poison-7")])
    tab.login(console, console.token)
    tab.page.locator("#graph g.node.computation[data-name=by_user].dead-lettering").wait_for(timeout=30_000)
    tab.select("by_user")
    row = tab.page.locator("#errors tbody tr", has_text="poison-7")
    row.wait_for(timeout=30_000)
    assert "dead" in row.inner_text()
    assert tab.text("#comp-health").startswith("dead-lettering")
    assert int(tab.text("#err-counts").split("·")[0]) >= 1
    assert tab.page.locator("#errors-none").is_hidden()
    tab.page.locator("#computation-panel").screenshot(path=str(shots / "console-errors.png"))


def test_a_narrow_window_stacks_the_panels_without_page_scrolling(
        browser: Any, console: Console, shots: Path) -> None:
    t = Page(browser, 420, 900)
    try:
        t.login(console, console.token)
        t.page.locator("#graph g.node.computation").first.wait_for()
        t.page.locator("#workers tbody tr").first.wait_for()
        assert t.fits()
        boxes = [t.page.locator(s).bounding_box() for s in
                 ("#topology-panel", "#computation-panel", "#lookup-panel", "#workers-panel")]
        assert len({round(b["x"]) for b in boxes}) == 1  # one column
        assert [b["y"] for b in boxes] == sorted(b["y"] for b in boxes)
        assert all(b["width"] <= 420 for b in boxes)
        rows = t.page.locator("#workers tbody tr")
        assert rows.count() == len([w for w in console.cluster.client.status().workers if w.alive])
        t.page.screenshot(path=str(shots / "console-narrow.png"))
        assert t.errors == [], f"browser console errors: {t.errors}"
    finally:
        t.context.close()


# Every node's label: its text, its rect's width and the width the text takes.
LABELS_JS = """
() => [...document.querySelectorAll('#graph g.node')].map((g) => ({
  name: g.dataset.name, text: g.querySelector('text').textContent,
  box: g.querySelector('rect').getBBox().width, used: g.querySelector('text').getComputedTextLength()}))
"""


def test_labels_clock_and_sparkline_values_read_whole(tab: Page, console: Console) -> None:
    """Labels were cut at 17 characters ('by_user.dead_le…'), the clock was 12-hour
    local time while everything else is UTC, and sparklines had no values."""
    console.inject([Record("poison-7", b"<not json>", max(r.timestamp for r in console.injected), "poison-7")])
    tab.login(console, console.token)
    tab.page.locator("#graph g.node[data-name='by_user.dead_letters']").wait_for(timeout=30_000)
    labels = tab.page.evaluate(LABELS_JS)
    assert labels and all(n["text"] == n["name"] and n["used"] <= n["box"] - 4 for n in labels), labels

    updated = tab.text("#updated")
    m = re.fullmatch(r"updated (\d\d):(\d\d):(\d\d) UTC", updated)
    assert m, updated
    now = datetime.now(UTC)
    shown = now.replace(hour=int(m.group(1)), minute=int(m.group(2)), second=int(m.group(3)), microsecond=0)
    assert abs((now - shown).total_seconds()) < 30 or abs((now - shown).total_seconds()) > 86_370  # midnight

    tab.select("counts")
    values = tab.page.locator("#lag-spark .spark-values")
    values.filter(has_text="now ").wait_for()
    text = values.inner_text()
    parts = re.fullmatch(r"now ([\d.]+) (s|min|h|d) · min ([\d.]+) \2?.*max ([\d.]+) .*", text)
    assert parts, text
    rate = tab.text("#rate-spark .spark-values")
    assert re.fullmatch(r"now [\d.–]+/s · min [\d.–]+/s · max [\d.–]+/s( · last .*)?", rate), rate

    # Checkpoint latency has its history too (counts checkpoints as records come in).
    cp = tab.page.locator("#checkpoint-spark .spark-values")
    cp.filter(has_text="now ").wait_for(timeout=30_000)
    assert re.fullmatch(r"now [\d.]+ ms · min [\d.]+ ms · max [\d.]+ ms( · last .*)?", cp.inner_text()), cp.inner_text()
    p95 = tab.page.locator("#checkpoint-p95-spark .spark-values")
    p95.filter(has_text="now ").wait_for(timeout=30_000)
    assert re.fullmatch(r"now ≤ [\d.]+ ms · min ≤ [\d.]+ ms · max ≤ [\d.]+ ms( · last .*)?", p95.inner_text()), \
        p95.inner_text()

    # No two edge labels overlap (fan-in and fan-out put several midpoints together).
    boxes = tab.page.evaluate(
        "() => [...document.querySelectorAll('#graph text.rate')].map((t) => {"
        " const b = t.getBBox(); return [b.x, b.y, b.width, b.height, t.textContent]; })")
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            apart = a[0] + a[2] <= b[0] or b[0] + b[2] <= a[0] or a[1] + a[3] <= b[1] or b[1] + b[3] <= a[1]
            assert apart, f"edge labels overlap: {a} and {b}"


def test_late_records_show_per_input_stream(tab: Page, console: Console) -> None:
    """A click far behind by_user's input watermark is counted late on its input,
    ``clicks``, and handed to the code all the same (late_policy process)."""
    behind = min(r.timestamp for r in console.injected)
    console.inject([Record("late-click", json.dumps({"user": "ann"}).encode(), behind, "late-click-1")])
    wait_for(lambda: console.cluster.client.describe("by_user").late, 30, "the late click counted")
    tab.login(console, console.token)
    tab.page.locator("#graph g.node.computation").first.wait_for()
    tab.select("by_user")
    tab.page.locator("#late-inputs").filter(has_text="clicks: 1 processed").wait_for(timeout=30_000)
    assert tab.text("#late-inputs") == "clicks: 1 processed"
