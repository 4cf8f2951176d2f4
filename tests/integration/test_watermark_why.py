"""``held_by`` names what holds a watermark, for each cause (issue 33, "watermarks that
explain themselves"), through GetWatermark, ``millwheel watermark NAME --why --json``
and the console, over a real controller and worker on loopback (SQLite store):

* an idle injector: nothing injected yet, then its watermark as set and nothing more;
* a failing range: code that cannot be built, named with its worker and its error;
* a backlog: records waiting in an injector's outbox for a consumer that refuses them,
  and a computation's productions waiting for theirs (the oldest one named);
* a held timer: a due event-time timer whose firing fails, named with its time, key
  and tag while the computation's input watermark is an hour past it.

Every cause lives in its own pipeline of one registry, so one cluster serves them all.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from millwheel.record import MIN_TIMESTAMP, Record
from millwheel.topology import InjectorSpec
from services.generated import millwheel_pb2 as pb
from services.inject_feed import inject_messages
from tests.integration.watermark_why_code import BROKEN_MESSAGE, HOUR_US
from tests.support.redis_server import free_port
from tests.support.service_cluster import ROOT, Cluster, wait_for

pytestmark = pytest.mark.timeout(400)
CODE = "tests.integration.watermark_why_code"
T0 = 1_767_225_600_000_000  # 2026-01-01T00:00:00Z
SECOND = 1_000_000
CHROMIUM = "/usr/bin/chromium"
WAIT_S = 60  # a loaded 2-core machine: generous, never a speed assertion


def comp(name: str, stream: str, code: str, outputs: list[str], params: dict[str, Any] | None = None,
         on_error: str = "") -> pb.ComputationSpec:
    return pb.ComputationSpec(name=name, inputs=[pb.InputStream(stream=stream)], outputs=outputs,
                              code=pb.Code(name=f"{CODE}:{code}", params_json=json.dumps(params or {})),
                              options=pb.Options(key_ranges=1, on_error=on_error))


class Service:
    """Controller (with the console on ``ui``, no token) and one worker."""

    def __init__(self, tmp: Path) -> None:
        self.ui = free_port()
        self.cluster = Cluster(tmp, allow_code=CODE, controller_args=["--ui-port", str(self.ui)])

    def held(self, node: str) -> str:
        return str(self.cluster.client.watermarks(node)[0].held_by)

    def low(self, node: str) -> int:
        return int(self.cluster.client.watermarks(node)[0].low_watermark)

    def why(self, node: str) -> list[tuple[str, str]]:
        """``millwheel watermark NODE --why --json``: the chain a user reads."""
        done = subprocess.run([sys.executable, "-m", "services.cli", "watermark", node, "--why", "--json",
                               "--controller", self.cluster.address], capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stdout + done.stderr
        return [(w["node"], w["held_by"]) for w in json.loads(done.stdout)]

    def console(self, computation: str) -> Any:
        """The console's view of one computation (what its page shows)."""
        query = urllib.parse.urlencode({"computation": computation})
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui}/api/v1/computation?{query}", timeout=10) as resp:
            return json.loads(resp.read())

    def inject(self, injector: str, records: list[Record], watermark: int) -> None:
        """``records`` and then the injector's watermark, as a client sets it."""
        stream = f"{injector}-in"
        msgs = list(inject_messages(injector, stream, records, max_disorder_us=None)) if records else []
        self.cluster.client.inject([*msgs, pb.InjectRequest(injector=injector, stream=stream, watermark=watermark)])


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service(tmp_path_factory.mktemp("why"))
    try:
        svc.cluster.start(workers=1)
        svc.cluster.client.register_topology(
            [comp("idle_copy", "idle-in", "Forward", ["idle-out"], {"output": "idle-out"}),
             comp("fraud", "broken-in", "CannotBuild", ["fraud-out"]),
             comp("ledger", "busy-in", "RefusesEveryRecord", ["ledger-out"], on_error="fail"),
             comp("relay", "orders-in", "Forward", ["relayed"], {"output": "relayed"}),
             comp("audit", "relayed", "RefusesEveryRecord", ["audit-out"], on_error="fail"),
             comp("reminders", "remind-in", "RemindAnHourLater", ["reminders-out"], on_error="fail")],
            [InjectorSpec(name, f"{name}-in", key_ranges=1) for name in ("idle", "broken", "busy", "orders", "remind")])
        svc.cluster.wait_balanced(WAIT_S)
        yield svc
    finally:
        svc.cluster.stop()


def wait_held(svc: Service, node: str, expected: str) -> None:
    last: list[str] = []

    def said() -> bool:
        last[:] = [svc.held(node)]
        return last[0] == expected
    try:
        wait_for(said, WAIT_S, f"{node}'s held_by to be {expected!r}")
    except BaseException:
        print(f"{node}'s held_by: {last}")
        raise


def test_an_idle_injector_is_named_with_its_watermark_as_set(service: Service) -> None:
    wait_held(service, "injector:idle", "nothing injected yet: no Inject or writer has set its watermark")
    assert service.low("injector:idle") == MIN_TIMESTAMP
    wait_held(service, "idle_copy", "input: injector:idle")
    assert service.why("idle_copy") == [
        ("idle_copy", "input: injector:idle"),
        ("injector:idle", "nothing injected yet: no Inject or writer has set its watermark")]

    service.inject("idle", [], T0 + 90 * SECOND)  # a watermark, then nothing more
    said = ("its watermark as set (2026-01-01T00:01:30.000Z): nothing has advanced it further "
            "(Inject's watermark or done)")
    wait_held(service, "injector:idle", said)
    assert service.low("injector:idle") == T0 + 90 * SECOND
    wait_for(lambda: service.low("idle_copy") == T0 + 90 * SECOND, WAIT_S, "idle_copy to follow its input")
    assert service.why("idle_copy") == [("idle_copy", "input: injector:idle"), ("injector:idle", said)]


def test_a_failing_range_is_named_with_its_worker_and_error(service: Service) -> None:
    (worker,) = [w.worker_id for w in service.cluster.client.status().workers]
    wait_for(lambda: service.held("fraud").startswith("range 0 is failing"), WAIT_S, "fraud's range to be failing")
    said = service.held("fraud")
    assert said.startswith(f"range 0 is failing on {worker} (build): ") and BROKEN_MESSAGE in said, said
    assert service.low("fraud") == MIN_TIMESTAMP
    ((node, why),) = service.why("fraud")
    assert node == "fraud" and why.startswith(f"range 0 is failing on {worker} (build): ") and BROKEN_MESSAGE in why
    wait_for(lambda: service.console("fraud")["held_by"] == said, WAIT_S, "the console to name it")


def test_a_backlog_is_named_with_its_count_or_its_oldest_production(service: Service) -> None:
    records = [Record(f"k{i}", b"{}", T0 + i * SECOND, f"order-{i}") for i in range(1, 6)]
    # An injector whose consumer refuses every record: they wait in its outbox.
    service.inject("busy", records, T0 + 10 * SECOND)
    backlog = "range 0: 5 records in its outbox not yet taken by every consumer"
    wait_held(service, "injector:busy", backlog)
    assert service.low("injector:busy") == T0 + SECOND  # its oldest record
    wait_held(service, "ledger", "input: injector:busy")  # once it reported as much
    assert service.why("ledger") == [("ledger", "input: injector:busy"), ("injector:busy", backlog)]

    # A computation whose consumer refuses what it produced: its oldest production is named.
    service.inject("orders", records, T0 + 10 * SECOND)
    pending = ("range 0: production at 2026-01-01T00:00:01.000Z for key 'k1' on stream 'relayed' "
               "not yet acked by 'audit' (5 productions pending)")
    wait_held(service, "relay", pending)
    assert service.low("relay") == T0 + SECOND
    wait_held(service, "audit", "input: relay")
    assert service.why("audit") == [("audit", "input: relay"), ("relay", pending)]
    wait_for(lambda: service.console("relay")["held_by"] == pending, WAIT_S, "the console to name it")


HELD_TIMER = "range 0: timer at 2026-01-01T01:00:00.000Z for key 'k7' (tag 'remind') not yet fired"


def test_a_held_timer_is_named_with_its_time_key_and_tag(service: Service) -> None:
    # k7's record sets its timer at T0 + 1 h; the input watermark goes to T0 + 2 h, so
    # the timer is due, but its firing fails (and is retried): it holds the watermark.
    service.inject("remind", [Record("k7", b"{}", T0, "remind-1")], T0 + 2 * HOUR_US)
    wait_held(service, "reminders", HELD_TIMER)
    wms = service.cluster.client.watermarks("reminders")[0]
    assert (wms.low_watermark, wms.input_low_watermark) == (T0 + HOUR_US, T0 + 2 * HOUR_US)
    assert service.why("reminders") == [("reminders", HELD_TIMER)]
    wait_for(lambda: service.console("reminders")["held_by"] == HELD_TIMER, WAIT_S,
             "the console's snapshot to name the timer")


def test_the_console_shows_what_holds_the_selected_computation(service: Service) -> None:
    """In a real browser (headless Chromium): the held timer's reason under the selected
    computation, as the user reads it."""
    playwright_sync = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) is not installed")
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"{CHROMIUM} missing: ./dev.sh setup installs Debian's chromium")
    service.inject("remind", [Record("k7", b"{}", T0, "remind-1")], T0 + 2 * HOUR_US)  # (if run alone)
    wait_for(lambda: service.console("reminders")["held_by"] == HELD_TIMER, WAIT_S,
             "the console's snapshot to name the timer")
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args, headless=True)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 800}).new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"http://127.0.0.1:{service.ui}/")
            page.locator("#comp-select option[value=reminders]").wait_for(state="attached", timeout=30_000)
            page.select_option("#comp-select", "reminders")
            page.locator("#spec").filter(has_text="name: reminders").wait_for(timeout=30_000)
            held = page.locator("#held-by")
            held.filter(has_text="timer at").wait_for(timeout=30_000)
            assert held.inner_text() == f"watermark held by: {HELD_TIMER}"
            assert errors == [], errors
        finally:
            browser.close()
