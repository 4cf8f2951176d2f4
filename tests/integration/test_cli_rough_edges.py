"""What a newcomer meets in the CLI, checked as they would see it: lags in days rather
than millions of seconds, ``--json`` saying done as the table and the console do, records
for a closed injector refused, output piped into ``head`` without a traceback, a
drained and exited worker shown dead, ``--metrics-port -1`` said to be off, and a
controller that stops without its console tracebacking over a closed store."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_server import free_port
from tests.support.service_cluster import Cluster, wait_for

ROOT = Path(__file__).resolve().parents[2]
OLD = 1_600_000_000_000_000  # 2020-09-13: a lag of years
SPEC = """injectors:
  - {name: clicks, stream: clicks}
computations:
  - name: keep
    inputs: [clicks]
    outputs: [kept]
    code: {name: filter, params: {expr: "True"}}
"""


def cli(cluster: Cluster, *args: str, stdin: str | None = None, stdout: int | None = None
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args, "--controller", cluster.address],
                          input=stdin, stdout=stdout if stdout is not None else subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=cluster.tmp, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def records(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"key": f"k{i}", "value": i, "timestamp": OLD + i}) + "\n"
                   for i in range(start, start + n))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("rough"), controller_args=["--ui-port", str(free_port()),
                                                                    "--metrics-port", "-1"])
    c.ui_port = int(c.controller_args[1])  # type: ignore[attr-defined]
    c.start_controller()
    c.start_worker()
    try:
        (c.tmp / "spec.yaml").write_text(SPEC)
        reg = cli(c, "register", str(c.tmp / "spec.yaml"))
        assert reg.returncode == 0, reg.stderr
        c.wait_balanced()
        yield c
    finally:
        c.stop()


def test_lag_in_human_units_and_done_said_alike(cluster: Cluster) -> None:
    inj = cli(cluster, "inject", "--injector", "clicks", stdin=records(10))
    assert inj.returncode == 0, inj.stderr
    wait_for(lambda: json.loads(cli(cluster, "watermark", "keep", "--json").stdout)[0]["low_watermark"]
             == OLD + 9, 30, "keep's watermark to follow the injector")
    table = cli(cluster, "watermark").stdout
    days = (time.time() * 1e6 - OLD) / 86_400e6
    lags = re.findall(r"(\d+)d (\d+)h$", table, re.M)
    assert lags and all(abs(int(d) - days) <= 1 for d, _h in lags), table  # not 95563585.6s
    assert re.search(r"\d+d \d+h", cli(cluster, "status").stdout)

    done = cli(cluster, "inject", "--injector", "clicks", "--done", "--json", stdin="")
    assert done.returncode == 0 and json.loads(done.stdout)["watermark"] == "+inf", done.stdout
    wait_for(lambda: all(w["low_watermark"] == "+inf"
                         for w in json.loads(cli(cluster, "watermark", "--json").stdout)), 30, "done")
    # As the table says "+inf (done)" and the console's API "+inf": not 2**62.
    shown = json.loads(cli(cluster, "watermark", "--json").stdout)
    assert {w["node"]: w["low_watermark"] for w in shown} == {"injector:clicks": "+inf", "keep": "+inf"}
    assert "+inf (done)" in cli(cluster, "watermark").stdout
    status = json.loads(cli(cluster, "status", "--json").stdout)
    assert {w["low_watermark"] for w in status["watermarks"]} == {"+inf"}

    # The injector is closed: more records would be late everywhere. Refused, nothing sent.
    late = cli(cluster, "inject", "--injector", "clicks", stdin=records(3, start=100))
    assert late.returncode == 2, late.stdout
    assert "injector 'clicks' is closed" in late.stderr and "[FAILED_PRECONDITION]" in late.stderr
    assert len(cluster.outputs("kept")) == 10
    again = cli(cluster, "inject", "--injector", "clicks", "--done", stdin="")  # closing again: fine
    assert again.returncode == 0, again.stderr


def test_output_into_a_closed_pipe_ends_quietly(cluster: Cluster) -> None:
    """``millwheel errors X | head -1``: the reader is gone before the output is written."""
    for args in (("errors", "keep"), ("status",), ("watermark", "--json"), ("--help",)):
        read, write = os.pipe()
        os.close(read)
        try:
            out = cli(cluster, *args, stdout=write) if args != ("--help",) else subprocess.run(
                [sys.executable, "-m", "services.cli", "--help"], stdout=write, stderr=subprocess.PIPE,
                text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
        finally:
            os.close(write)
        assert out.returncode == 0 and out.stderr == "", (args, out.returncode, out.stderr)


def test_a_drained_worker_that_exited_is_dead_not_draining(cluster: Cluster) -> None:
    leaving = cluster.start_worker()
    wid = wait_for(lambda: cluster.worker_id(leaving), 20, "the second worker's id")
    wait_for(lambda: any(w.worker_id == wid and w.alive for w in cluster.client.status().workers), 20,
             "the second worker to heartbeat")
    leaving.send_signal(signal.SIGTERM)  # drains, then exits
    leaving.wait(60)
    wait_for(lambda: not next(w for w in cluster.client.status().workers if w.worker_id == wid).alive,
             30, "the controller to notice")
    rows = [line.split() for line in cli(cluster, "status").stdout.splitlines() if line.startswith(wid)]
    assert rows and rows[0][2] == "dead", rows
    import http.client

    def console_state() -> str:
        conn = http.client.HTTPConnection("127.0.0.1", cluster.ui_port, timeout=10)  # type: ignore[attr-defined]
        conn.request("GET", "/api/v1/workers")
        workers = json.loads(conn.getresponse().read())["workers"]
        conn.close()
        return str(next(w["state"] for w in workers if w["id"] == wid))

    wait_for(lambda: console_state() == "dead", 10, "the console to show the worker dead")


def test_metrics_port_off_is_said_to_be_off(cluster: Cluster) -> None:
    log = cluster.log("controller")
    assert "metrics off" in log and "metrics port 0" not in log, log


def test_a_stopped_controller_stops_its_console_before_its_store(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The console's snapshots read the store: closing the store under them logged
    "Cannot operate on a closed database" tracebacks until the process ended."""
    import argparse

    import yaml

    from millwheel.spec import topology_from_dict
    from services.cli.service import stop_controller
    from services.client import ControllerClient
    from services.controller.service import serve
    from services.ui.server import start_console

    server, port, _mport, service = serve(f"sqlite:///{tmp_path}/c.db", "127.0.0.1", 0, None)
    with ControllerClient(f"127.0.0.1:{port}") as mw:  # the snapshots read its watermarks from the store
        mw.register(topology_from_dict(yaml.safe_load(SPEC)))
    console = start_console(service, argparse.Namespace(ui_port=0, host="127.0.0.1", insecure=False))
    assert console is not None
    console.snap.interval_s = 0.05
    with caplog.at_level(logging.ERROR):
        stop_controller(server, service, console)
        time.sleep(1.0)  # a process that lingers after stopping (threads winding down)
    failed = [r for r in caplog.records if "console snapshot failed" in r.getMessage()]
    assert not failed, failed[0].exc_text if failed else ""
