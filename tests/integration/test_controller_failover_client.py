"""Clients and workers given several controller addresses fail over by themselves.

Real processes on loopback, with today's single controller (no leader election
needed): the other addresses in the lists are a port nobody listens on (refused at
once), or a second, idle ``millwheel controller`` on a store of its own, SIGSTOPped
(it accepts connections and never answers: only a deadline or a cut gets a caller
out). Outputs are compared with the failure-free run record by record.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from millwheel.record import Record
from services.client import ControllerClient, inject_messages
from services.generated import millwheel_pb2 as pb
from services.rpc.security import Security
from services.rpc.status import UnavailableError
from tests.support import pipelines
from tests.support.redis_server import free_port
from tests.support.service_cluster import ROOT, Cluster, expected_outputs, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
DISORDER = 2 * pipelines.SECOND
SINKS = ("counts", "totals")


def _client(addresses: str, **kw: float) -> ControllerClient:
    # timeout_s well above the failover times measured: a client that waited for its
    # deadline instead of moving on would take a minute, not seconds.
    return ControllerClient(addresses, security=Security(), **{"timeout_s": 60.0, **kw})


def dead_address() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there: connections are refused


@pytest.fixture
def stopped_controller(tmp_path: Path) -> Iterator[str]:
    """The address of a real controller on a store of its own (idle), SIGSTOPped."""
    other = Cluster(tmp_path / "stopped", store_url=f"sqlite:///{tmp_path}/stopped.db")
    (tmp_path / "stopped").mkdir()
    other.start_controller()
    assert other.controller is not None
    os.kill(other.controller.pid, signal.SIGSTOP)
    try:
        yield other.address
    finally:
        other.stop()  # SIGCONT, then kill


def records_without_ids(n: int) -> list[Record]:
    return [Record(r.key, r.value, r.timestamp, "") for r in pipelines.workload(n=n)]


def outputs_of(client: ControllerClient, stream: str) -> list[tuple[str, bytes, int, str]]:
    return sorted((r.key, r.value, r.timestamp, r.record_id) for _seq, r in client.subscribe(stream))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_dead_first_address_is_skipped_by_clients_the_cli_and_workers(cluster: Cluster, tmp_path: Path) -> None:
    listed = f"{dead_address()},{cluster.address}"
    with _client(listed) as mw:
        started = time.monotonic()
        assert mw.status().store_url == cluster.store_url
        print(f"\nstatus via {listed}: {time.monotonic() - started:.3f} s, {mw.failovers} failover(s)")
        assert mw.failovers == 1 and mw.address == cluster.address
        topology = pipelines.topology(key_ranges=3)
        mw.register(topology)
    # The CLI takes the list in --controller and in $MILLWHEEL_CONTROLLER alike.
    done = run_cli("computations", "--json", "--controller", listed)
    assert done.returncode == 0, done.stderr
    assert '"name": "totals"' in done.stdout
    worker = cluster.start_worker(controller=listed)  # joins, through the dead address first
    cluster.wait_balanced()
    records = records_without_ids(600)
    events = tmp_path / "events.jsonl"  # no "id": the CLI's client gives them IDs
    events.write_text("".join(json.dumps({"key": r.key, "value": json.loads(r.value), "timestamp": r.timestamp})
                              + "\n" for r in records))
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "inject", str(events), "--injector", "events",
         "--max-disorder-us", str(DISORDER), "--done", "--batch", "50"], cwd=ROOT, capture_output=True,
        text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "MILLWHEEL_CONTROLLER": listed})
    assert done.returncode == 0, done.stderr
    assert "injected 600 records" in done.stdout
    cluster.wait_watermark("totals", timeout=120)
    want = expected_outputs(tmp_path, topology, pipelines.sources(pipelines.workload(n=600)), SINKS)
    with _client(listed) as mw:
        for stream in SINKS:
            assert outputs_of(mw, stream) == want[stream]
    assert worker.poll() is None
    # One address alone behaves as it always did: it works, and a dead one fails at once
    # with the same message (no retrying when there is nowhere else to go).
    with _client(cluster.address) as one:
        assert outputs_of(one, "totals") == want["totals"]
        assert one.failovers == 0
    lone = dead_address()
    with _client(lone) as one:
        with pytest.raises(UnavailableError, match=rf"^controller {lone}: .*\[UNAVAILABLE\]$"):
            one.status()
        assert one.failovers == 0


def test_a_stopped_first_controller_is_left_within_seconds(
        cluster: Cluster, stopped_controller: str, tmp_path: Path) -> None:
    listed = f"{stopped_controller},{cluster.address}"
    with _client(listed) as mw:
        started = time.monotonic()
        mw.status()
        took = time.monotonic() - started
    print(f"\nclient: status via a stopped first controller took {took:.2f} s")
    assert took < 15  # not the 60 s deadline: the call was cut when the controller did not start it
    topology = pipelines.topology(key_ranges=3)
    with _client(listed) as mw:
        mw.register(topology)  # a fresh client: through the stopped controller again
    started = time.monotonic()
    cluster.start_worker()
    alone = time.monotonic() - started
    started = time.monotonic()
    cluster.start_worker(controller=listed)
    listed_took = time.monotonic() - started
    print(f"worker joined in {listed_took:.2f} s via the list with a stopped first controller "
          f"({alone:.2f} s given the live controller alone)")
    cluster.wait_balanced()
    records = pipelines.workload(n=800)
    with _client(listed) as mw:  # Inject, then Subscribe, each first tried on the stopped one
        resp = mw.inject_records("events", records, batch=50, max_disorder_us=DISORDER, done=True)
        assert resp.accepted == 800 and mw.failovers == 1
    cluster.wait_watermark("totals", timeout=120)
    want = expected_outputs(tmp_path, topology, pipelines.sources(records), SINKS)
    for stream in SINKS:
        with _client(listed) as mw:
            assert outputs_of(mw, stream) == want[stream]
            assert mw.failovers == 1


def test_all_controllers_down_is_one_error_naming_every_address(stopped_controller: str) -> None:
    dead = [dead_address(), dead_address()]
    listed = ",".join([dead[0], stopped_controller, dead[1]])
    with _client(listed, failover_s=4.0) as mw:
        started = time.monotonic()
        with pytest.raises(UnavailableError) as info:
            mw.watermarks()
        took = time.monotonic() - started
    message = str(info.value)
    print(f"\ngave up after {took:.1f} s: {message[:300]}")
    assert message.startswith(f"no controller of {listed} served the call within 4 s: ")
    for address in (*dead, stopped_controller):
        assert f"{address} (" in message  # each with why it failed
    assert f"{stopped_controller} (DEADLINE_EXCEEDED: controller {stopped_controller} did not answer" in message
    assert info.value.status.name == "UNAVAILABLE"  # type: ignore[attr-defined]


def _duplicates_dropped(metrics_address: str, computation: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(rf'millwheel_duplicates_dropped_total\{{computation="{computation}"\}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_inject_resent_after_controller_kill9_delivers_every_record_once(cluster: Cluster, tmp_path: Path) -> None:
    """The controller is killed -9 in the middle of an Inject call, after it accepted
    part of the call, and restarted on its port. The client resends the call's
    messages (to the dead address first, then the restarted controller); the records
    have no IDs of their own, so only the IDs the client gave them before the first
    send make the resent ones duplicates, dropped downstream. A Subscribe following a
    sink across the restart resumes where it was."""
    listed = f"{cluster.address},{dead_address()}"
    topology = pipelines.topology(key_ranges=3)
    cluster.client.register(topology)
    cluster.start_worker(controller=listed)
    cluster.start_worker(controller=listed)
    cluster.wait_balanced()
    records = records_without_ids(1200)
    messages = list(inject_messages("events", "", records, batch=40, max_disorder_us=DISORDER, done=True))
    assert all(r.id for m in messages for r in m.records)
    kill_before = 12  # the second call (8 messages a call) breaks after messages 8-11 got in
    restarted = threading.Thread(target=lambda: (time.sleep(0.5), cluster.start_controller()))

    def feed() -> Iterator[pb.InjectRequest]:
        for i, msg in enumerate(messages):
            if i == kill_before:
                last = messages[i - 1].watermark
                wait_for(lambda: any(w.node == "injector:events" and w.low_watermark >= last  # noqa: B023
                                     for w in cluster.client.watermarks()), 30, "messages 8-11 to be accepted")
                assert cluster.controller is not None
                os.kill(cluster.controller.pid, signal.SIGKILL)
                cluster.controller.wait(5)
                restarted.start()
            yield msg

    followed: list[tuple[int, Record]] = []
    want = expected_outputs(tmp_path, topology, pipelines.sources(pipelines.workload(n=1200)), SINKS)

    def follow() -> None:
        with _client(listed) as sub:
            for item in sub.subscribe("totals", follow=True):
                followed.append(item)
                if len(followed) >= len(want["totals"]):
                    return

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    with _client(listed) as mw:
        resp = mw.inject(feed(), messages_per_call=8)
        print(f"\ninject: {resp.accepted} records accepted, {mw.failovers} failover(s)")
        assert mw.failovers >= 1
    restarted.join(30)
    assert resp.accepted == 1200
    cluster.wait_watermark("totals", timeout=120)
    for stream in SINKS:
        assert cluster.outputs(stream) == want[stream]
    # The resend did send accepted records again, and they were dropped as duplicates.
    dropped = sum(_duplicates_dropped(w.metrics_address, "parse") for w in cluster.client.status().workers)
    print(f"duplicates dropped by parse: {dropped:.0f}")
    assert dropped >= 4 * 40
    follower.join(60)
    assert not follower.is_alive()
    seqs = [seq for seq, _ in followed]
    assert seqs == sorted(set(seqs))  # in order, none twice
    assert sorted((r.key, r.value, r.timestamp, r.record_id) for _, r in followed) == want["totals"]
