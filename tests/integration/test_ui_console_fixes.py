"""The console's defects a new user tripped on (issue 33), in a real browser over a real
service on loopback (headless Debian Chromium via Playwright):

* each edge of the graph shows its own records/s (what its consumer acknowledged),
  not its consumer's whole input rate with retries counted: records injected at a
  steady ~20/s show ~20/s on the injector's edge, a computation's two outputs show
  their own rates (all of them, and a quarter), a stream read by two consumers shows
  the rate on each, and a consumer whose batches fail and are retried shows ~20/s in
  and out;
* a wide and tall graph (12 computations in a chain, 12 reading one stream) is not
  clipped: every node lies inside the graph's scrollable area and can be scrolled to;
* the console opens on the failing computation, and shows what holds its watermark;
* a key's state of a built-in operator is shown with field names and readable times
  (no bare arrays, no raw microseconds);
* a connector sink's edge shows the rows its sink wrote per second (a Redis stream sink
  on a redis-server of the test's own): 0 before anything is injected, the rows counted
  in Redis per second while records flow, 0 again once they stop, and 0 while the sink
  is down (named in the summary); the edge into its stream (a log no computation reads)
  shows what was appended.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from millwheel.connectors.spec import sinks_from_list
from millwheel.record import Record
from services.generated import millwheel_pb2 as pb
from tests.support.redis_server import RedisServer, free_port
from tests.support.service_cluster import Cluster, wait_for

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CODE = "tests.integration.ui_console_code"
T0 = 1_700_000_000_000_000
RATE = 20.0  # records/s injected
SESSION_GAP_US = 2_000_000

playwright_sync = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) is not installed")
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which(CHROMIUM) is None,
                       reason=f"{CHROMIUM} missing: ./dev.sh setup installs Debian's chromium"),
]


def comp(name: str, inputs: list[str], code: str, outputs: list[str], params: dict[str, Any] | None = None,
         key: str = "", key_ranges: int = 2) -> pb.ComputationSpec:
    return pb.ComputationSpec(name=name, inputs=[pb.InputStream(stream=s, key_extractor=key) for s in inputs],
                              outputs=outputs, code=pb.Code(name=code, params_json=json.dumps(params or {})),
                              options=pb.Options(key_ranges=key_ranges))


def click(i: int) -> Record:
    user = ["ann", "bob", "cy"][i % 3]
    return Record(user, json.dumps({"user": user, "n": i}).encode(), T0 + i * 50_000, f"click-{i}")


class Service:
    """Controller with the console (loopback, no token) and two workers."""

    def __init__(self, tmp: Path) -> None:
        self.ui = free_port()
        self.cluster = Cluster(tmp, allow_code=CODE, controller_args=["--ui-port", str(self.ui)])
        self.cluster.start_controller()
        self.cluster.start_worker()
        self.cluster.start_worker()
        self.injected = 0
        self.inject_started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ui}/"

    def inject_steadily(self) -> None:
        """Inject RATE records/s (two every 0.1 s, on a fixed schedule) until stopped."""
        def run() -> None:
            start = self.inject_started = time.monotonic()
            i = 0
            while not self._stop.is_set():
                due = start + i / RATE
                if due > time.monotonic():
                    time.sleep(due - time.monotonic())
                self.cluster.inject("clicks", "clicks", [click(i), click(i + 1)])
                i += 2
                self.injected = i
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def injected_per_s(self) -> float:
        return self.injected / max(1e-6, time.monotonic() - self.inject_started)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.cluster.stop()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service(tmp_path_factory.mktemp("ui-fixes"))
    try:
        svc.cluster.client.register_topology(
            [comp("split", ["clicks"], f"{CODE}:Split", ["all", "some"], {"every": 4}),
             comp("counts", ["all"], "window_aggregate", ["counts_out"],
                  {"size_us": 10_000_000, "aggregation": "count"}, key="json:user"),
             comp("sessions", ["all"], "session_window", ["sessions_out"],
                  {"gap_us": SESSION_GAP_US, "aggregation": "sum", "field": "n"}, key="json:user"),
             comp("flaky", ["clicks"], f"{CODE}:Flaky", ["flaky_out"], {"every": 25}),
             comp("zz_broken", ["quiet"], f"{CODE}:Broken", ["broken_out"], key_ranges=1)],
            [("clicks", "clicks"), ("quiet", "quiet")])
        svc.cluster.wait_balanced()
        svc.inject_steadily()
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    p = context.new_page()
    errors: list[str] = []
    p.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield p
        assert errors == [], f"browser console errors: {errors}"
    finally:
        context.close()


EDGE_LABELS_JS = """
() => Object.fromEntries([...document.querySelectorAll('#graph text.rate')].map(
  (t) => [t.dataset.from + ' -> ' + t.dataset.to, t.textContent]))
"""


def rate_of(label: str) -> float | None:
    m = re.match(r"([\d.]+)/s", label)
    return float(m.group(1)) if m else None


def test_each_edge_shows_its_own_rate_against_what_was_injected(page: Any, service: Service) -> None:
    page.goto(service.url)
    page.locator("#graph text.rate").first.wait_for()
    share = 1 / 4  # split's "some": every 4th record
    expected = {  # edge -> the share of the injected rate it carries
        "i:clicks -> s:clicks": 1.0, "s:clicks -> c:split": 1.0,
        "c:split -> s:all": 1.0, "c:split -> s:some": share,
        "s:all -> c:counts": 1.0, "s:all -> c:sessions": 1.0,  # one stream, two consumers: each
        "s:clicks -> c:flaky": 1.0, "c:flaky -> s:flaky_out": 1.0,  # retried batches count once
    }
    seen: dict[str, str] = {}

    def close_enough() -> bool:
        nonlocal seen
        seen = page.evaluate(EDGE_LABELS_JS)
        injected = service.injected_per_s()
        for edge, part in expected.items():
            shown = rate_of(seen.get(edge, ""))
            if shown is None or abs(shown - part * injected) > 0.25 * part * injected + 0.5:
                return False
        return True

    time.sleep(6)  # a full averaging window of steady traffic
    try:
        wait_for(close_enough, 60, "every edge label to show its own rate")
    except AssertionError:
        raise AssertionError(f"edge labels {seen}, injected {service.injected_per_s():.1f}/s") from None
    # The two outputs of split differ (they were both split's rate), and the injector's
    # edge is about what was injected (it was twice that: retries counted as input).
    assert rate_of(seen["c:split -> s:some"]) < 0.5 * rate_of(seen["c:split -> s:all"])  # type: ignore[operator]
    assert rate_of(seen["i:clicks -> s:clicks"]) <= 1.25 * service.injected_per_s() + 0.5  # type: ignore[operator]
    # flaky did retry (its first runs of every 25th record failed), and lost nothing
    logs = "".join(service.cluster.log(f"worker{i}") for i in range(len(service.cluster.workers)))
    assert "the feature store timed out (transient)" in logs  # the workers logged the failed runs
    flaky = page.evaluate("async () => (await fetch('/api/v1/computation?computation=flaky')).json()")
    assert flaky["dead_lettered"] == 0, flaky
    # The panel's records/s in of a computation is what its consumers acked too.
    page.select_option("#comp-select", "split")
    page.locator("#spec").filter(has_text="name: split").wait_for()
    page.locator("#rates").filter(has_text=re.compile(r"\d")).wait_for()
    shown_in = float(page.locator("#rates").inner_text().split("·")[0])
    assert abs(shown_in - service.injected_per_s()) <= 0.3 * service.injected_per_s() + 0.5, shown_in


def test_the_console_opens_on_the_failing_computation_and_says_what_holds_it(
        page: Any, service: Service) -> None:
    wait_for(lambda: any(f for f in service.cluster.client.describe("zz_broken").failing_ranges), 30,
             "zz_broken's range to be failing")
    page.goto(service.url)
    health = page.locator("#comp-health")
    health.filter(has_text="failing").wait_for(timeout=20_000)
    assert page.locator("#comp-select").input_value() == "zz_broken"  # not "counts", the first by name
    assert "cannot reach the feature store" in health.inner_text()
    held = page.locator("#held-by")
    held.filter(has_text="watermark held by").wait_for(timeout=20_000)
    assert "range 0" in held.inner_text(), held.inner_text()


WIDE = 12
# Where a node lies: inside the graph's scrollable content, and inside its visible box
# once scrolled to.
PLACE_JS = """(name) => {
  const g = document.getElementById('graph'), node = g.querySelector(`g.node[data-name="${name}"]`);
  let r = g.getBoundingClientRect(), n = node.getBoundingClientRect();
  const x = n.left - r.left + g.scrollLeft, y = n.top - r.top + g.scrollTop;
  const inside = x >= 0 && y >= 0 && x + n.width <= g.scrollWidth + 1 && y + n.height <= g.scrollHeight + 1;
  node.scrollIntoView({ block: 'nearest', inline: 'nearest' });
  r = g.getBoundingClientRect(); n = node.getBoundingClientRect();
  const seen = n.left >= r.left - 1 && n.right <= r.right + 1 && n.top >= r.top - 1 && n.bottom <= r.bottom + 1;
  return { inside, seen, node: [n.left, n.top, n.width, n.height], graph: [r.left, r.top, r.width, r.height] };
}"""


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """12 computations in a chain (25 columns) and 12 reading one stream (12 rows)."""
    svc = Service(tmp_path_factory.mktemp("ui-wide"))
    try:
        chain = [comp(f"stage_{i:02d}", ["clicks" if i == 1 else f"s{i - 1:02d}"], "map", [f"s{i:02d}"],
                      {"value": "json"}, key_ranges=1) for i in range(1, WIDE + 1)]
        fan = [comp(f"fan_{i:02d}", ["clicks"], "map", [f"fan_out_{i:02d}"], {"value": "json"}, key_ranges=1)
               for i in range(1, WIDE + 1)]
        svc.cluster.client.register_topology([*chain, *fan], [("clicks", "clicks")])
        yield svc
    finally:
        svc.stop()


def test_a_wide_and_tall_graph_is_not_clipped(page: Any, wide: Service) -> None:
    page.goto(wide.url)
    nodes = page.locator("#graph g.node")
    page.locator("#graph g.node[data-name=stage_12]").wait_for(state="attached", timeout=30_000)
    graph = page.locator("#graph")
    box = graph.bounding_box()
    # the graph scrolls inside its panel; the page itself does not scroll sideways
    assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth + 1")
    size = page.evaluate("(() => { const g = document.getElementById('graph');"
                         " return [g.scrollWidth, g.scrollHeight, g.clientWidth, g.clientHeight]; })()")
    assert size[0] > size[2], f"a 25-column graph wider than the panel scrolls: {size}"
    names = [nodes.nth(i).get_attribute("data-name") for i in range(nodes.count())]
    assert {f"stage_{i:02d}" for i in range(1, WIDE + 1)} | {f"fan_{i:02d}" for i in range(1, WIDE + 1)} <= set(names)
    # The graph is redrawn every second: each check is one synchronous script.
    for name in ("stage_12", "s12", "fan_12", "stage_01"):
        where = page.evaluate(PLACE_JS, name)
        assert where["inside"], f"{name} lies outside the graph's scrollable area: {where}"
        assert where["seen"], f"{name} scrolled to is not inside the visible graph: {where}"
    assert box is not None and box["width"] <= 1280
    # it says so (an overlay scrollbar hid it), and "Fit to panel" shows it whole
    hint = page.locator("#graph-hint")
    assert hint.is_visible() and "larger than the panel" in hint.inner_text()
    page.click("#graph-fit")
    page.locator("#graph-fit").filter(has_text="Actual size").wait_for()
    page.wait_for_timeout(1500)  # a refresh redraws the graph: it stays fitted
    outside = page.evaluate("""() => {
      const r = document.getElementById('graph').getBoundingClientRect();
      return [...document.querySelectorAll('#graph g.node')].filter((g) => {
        const n = g.getBoundingClientRect();
        return n.left < r.left - 1 || n.right > r.right + 1 || n.top < r.top - 1 || n.bottom > r.bottom + 1;
      }).map((g) => g.dataset.name);
    }""")
    assert outside == [], f"fitted, these nodes are still outside the panel: {outside}"
    assert hint.is_hidden()
    page.click("#graph-fit")
    page.locator("#graph-fit").filter(has_text="Fit to panel").wait_for()
    # nothing is wrong here: the console opens on the first computation by name
    assert page.locator("#comp-select").input_value() == "fan_01"


def test_state_is_shown_with_field_names_and_readable_times(page: Any, service: Service) -> None:
    wait_for(lambda: service.cluster.client.keys("sessions"), 30, "sessions to hold state")
    page.goto(service.url)
    page.locator("#comp-select option").first.wait_for(state="attached")
    page.select_option("#comp-select", "sessions")
    page.locator("#spec").filter(has_text="name: sessions").wait_for()
    page.fill("#state-key", "ann")
    page.click("#state-form button[type=submit]")
    result = page.locator("#state-result")
    result.filter(has_text="state (session_window)").wait_for(timeout=20_000)
    text = result.inner_text()
    assert re.search(r"session \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} – (\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d\.\d{3} UTC",
                     text), text
    for field in ("end", "count", "sum", "min", "max", "fired"):
        assert re.search(rf"^\s+{field}: \S", text, re.M), (field, text)
    assert not re.search(r"\[\s*\d+\s*,", text), f"a bare array is shown: {text}"
    assert not re.search(r"\d{13,}", text), f"raw microseconds are shown: {text}"
    assert re.search(r"timers:\n\s+end:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} at \d{4}-", text), text

    page.select_option("#comp-select", "counts")
    page.locator("#spec").filter(has_text="name: counts").wait_for()
    page.fill("#state-key", "bob")
    page.click("#state-form button[type=submit]")
    result.filter(has_text="state (window_aggregate)").wait_for(timeout=20_000)
    text = result.inner_text()
    assert re.search(r"window \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.000 – \d\d:\d\d:\d\d\.000 UTC\n\s+count: \d+", text), text
    assert "sum:" not in text  # a count keeps no sum worth showing
    assert not re.search(r"\d{13,}", text), text


SINK = "passed.redis"
SINK_EDGE = f"s:passed -> k:{SINK}"
EDGE_WINDOW_S = 5.0  # services/ui/snapshot.py: an edge's records/s is averaged over this long


class Orders:
    """Inject ``orders`` at RATE records/s (two every 0.1 s, on a fixed schedule) from a
    thread until stopped; ``injected`` counts what was sent."""

    def __init__(self, service: Service, first: int = 0) -> None:
        self.service, self.injected, self.first = service, 0, first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start, i = time.monotonic(), 0
        while not self._stop.is_set():
            due = start + i / RATE
            if due > time.monotonic():
                time.sleep(due - time.monotonic())
            n = self.first + i
            self.service.cluster.inject("orders", "orders", [
                Record(f"o{k % 5}", json.dumps({"n": k}).encode(), T0 + k * 50_000, f"order-{k}")
                for k in (n, n + 1)])
            i += 2
            self.injected = i

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def test_a_sink_edge_shows_the_rows_its_sink_wrote_per_second(page: Any, service: Service) -> None:
    import redis

    with RedisServer() as target:
        out = redis.Redis.from_url(target.url)
        service.cluster.client.register_topology(
            [comp("orders_pass", ["orders"], "filter", ["passed"], {"expr": "True"})], [("orders", "orders")],
            sinks=sinks_from_list([{"stream": "passed", "name": SINK, "type": "redis-stream",
                                    "url": target.url, "redis_stream": "out"}]))
        service.cluster.wait_balanced()
        page.goto(service.url)
        page.locator(f"#graph g.node[data-name='{SINK}']").wait_for(state="attached", timeout=30_000)

        def label(edge: str) -> str | None:
            return page.evaluate(EDGE_LABELS_JS).get(edge)  # type: ignore[no-any-return]

        # Nothing injected yet: nothing written, the edge says so (or has no figure yet).
        for _ in range(3):
            assert label(SINK_EDGE) in (None, "0.0/s"), label(SINK_EDGE)
            assert out.xlen("out") == 0
            page.wait_for_timeout(1000)
        assert label(SINK_EDGE) == "0.0/s"

        # Records flow: the edge shows what the sink wrote, as Redis counts it, per second
        # over the console's window (the Redis side sampled here over the same span).
        orders = Orders(service)
        counted: list[tuple[float, int]] = []
        seen: dict[str, str] = {}

        def written_per_s() -> float | None:
            now = time.monotonic()
            counted.append((now, int(out.xlen("out"))))
            old = [c for c in counted if c[0] <= now - EDGE_WINDOW_S]
            if not old:
                return None
            t0, n0 = old[-1]
            return (counted[-1][1] - n0) / (now - t0)

        def close_enough() -> bool:
            nonlocal seen
            written = written_per_s()
            seen = page.evaluate(EDGE_LABELS_JS)
            shown, into_log = rate_of(seen.get(SINK_EDGE, "")), rate_of(seen.get("c:orders_pass -> s:passed", ""))
            if written is None or shown is None or into_log is None or written < 0.5 * RATE:
                return False
            return abs(shown - written) <= 0.25 * written + 0.5 and abs(into_log - written) <= 0.25 * written + 0.5

        try:
            time.sleep(EDGE_WINDOW_S + 1)  # a full averaging window of steady traffic
            wait_for(close_enough, 60, "the sink's edge to show the rows it wrote per second")
        except AssertionError:
            raise AssertionError(f"edge labels {seen}, rows in Redis {counted[-8:]}, "
                                 f"injected {orders.injected}") from None
        finally:
            orders.stop()
        shown = rate_of(seen[SINK_EDGE])
        assert shown is not None and abs(shown - RATE) <= 0.25 * RATE + 0.5, (shown, RATE)
        # Every record written once; then nothing more is, and the edge falls back to 0.
        wait_for(lambda: out.xlen("out") == orders.injected, 60, "every order in Redis")
        wait_for(lambda: label(SINK_EDGE) == "0.0/s", 30, "the sink's edge back to 0/s once nothing flows")
        rows: Any = out.xrange("out")
        assert sorted(json.loads(f[b"value"])["n"] for _i, f in rows) == list(range(orders.injected))

        # The sink down (its Redis gone): the summary names it, the node is failing and
        # its edge shows 0, whatever the window still holds.
        target.kill()
        more = Orders(service, first=orders.injected)
        try:
            page.locator("#summary").filter(has_text=f"sink down: {SINK}").wait_for(timeout=30_000)
            assert label(SINK_EDGE) == "0.0/s"
            assert page.locator(f"#graph g.node.failing[data-name='{SINK}']").count() == 1
        finally:
            more.stop()
