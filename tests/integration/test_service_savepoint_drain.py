"""Drain (``millwheel savepoint create FILE --drain``) on a real controller and two real
workers (subprocesses, gRPC on loopback).

A windowed count runs, records are injected without closing the injector (windows stay
open), then the service is drained: its sink log must equal the failure-free run
record by record, final windows included; the file must hold no open window and no
pending record; Inject afterwards is refused with FAILED_PRECONDITION. The same with a
worker killed -9 during the drain. A drain that cannot finish (a range that cannot be
built holds the watermark) fails at its timeout and leaves the service draining:
Inject refused, ranges still running, no file; a stop with savepoint still works.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from millwheel.record import Record
from millwheel.sources import ListSource
from millwheel.state import open_store
from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Options
from services.rpc.status import PreconditionError
from tests.support import tagged_counts
from tests.support.savepoints import run_cli
from tests.support.service_cluster import PIPELINE_CODE, Cluster, expected_outputs, wait_for
from tests.support.tagged_counts import SECOND, topology

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
N = 1200


def records() -> list[Record]:
    return tagged_counts.records(N)


def run_drain(c: Cluster, tmp_path: Path, kill: bool = False) -> None:
    topo, recs = topology(), records()
    c.register(topo)
    c.wait_balanced()
    # The records with the watermark they imply (2 s behind), but no end of input: the
    # last windows stay open until the drain closes the injector.
    c.inject("events", "events", recs, batch=40, max_disorder_us=2 * SECOND)
    wait_for(lambda: c.client.state("counts", "k6").exists, 60, "open windows before the drain")
    path = tmp_path / "final.mwsp"
    killed: list[float] = []
    if kill:
        victim = c.workers[0]

        def killer() -> None:
            # Once the drain has begun (its marker is in the store), kill -9 a worker.
            store = open_store(c.store_url)
            try:
                wait_for(lambda: store.get_meta("savepoint/draining"), 60, "the drain to begin")
            finally:
                store.close()
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(time.monotonic())

        threading.Thread(target=killer).start()
    code, out, err = run_cli("savepoint", "create", str(path), "--drain", "--timeout", "120",
                             "--controller", c.address, "--json")
    ended = time.monotonic()
    assert code == 0, err
    summary = json.loads(out)
    assert summary["drained"] and summary["stopped"]
    assert not summary["counts"].get("outbox") and not summary["counts"].get("timers")
    if kill:
        assert killed and killed[0] < ended, "the worker should die during the drain"
        assert c.workers[0].wait(10) == -signal.SIGKILL
    # The sink holds every result, the final windows' included, each once.
    want = expected_outputs(tmp_path, topo, {"events": ListSource(recs)}, ("counts",))["counts"]
    assert c.outputs("counts") == want
    # The file: no open window (no timer, no window state), nothing pending.
    code, out, err = run_cli("savepoint", "inspect", str(path), "--json")
    assert code == 0, err
    held = json.loads(out)["counts"]
    assert held.get("range") == 1 + 3 + 2 and not held.get("timers") and not held.get("outbox"), held
    with pytest.raises(PreconditionError, match="stopped with a savepoint|draining"):
        c.client.inject_records("events", recs[:10])
    assert all(not r.worker_id for r in c.client.status().ranges)


def test_drain_fires_the_last_windows_and_stops(two_workers: Cluster, tmp_path: Path) -> None:
    run_drain(two_workers, tmp_path)


def test_drain_with_a_worker_killed_during_it(two_workers: Cluster, tmp_path: Path) -> None:
    run_drain(two_workers, tmp_path, kill=True)


def test_drain_timeout_leaves_the_service_draining(tmp_path: Path) -> None:
    # A computation whose code the workers cannot build: its ranges fail, and hold the
    # watermark of everything downstream of them (their own) for good.
    broken = ComputationSpec("broken", (InputSpec("events"),), ("nowhere",),
                             CodeRef(f"{PIPELINE_CODE}:NoSuchComputation"), Options(key_ranges=1))
    c = Cluster(tmp_path, allow_code=PIPELINE_CODE)
    try:
        c.start_controller()
        c.start_worker()
        c.register(topology((broken,)))
        c.inject("events", "events", records()[:200], batch=50)
        path = tmp_path / "never.mwsp"
        started = time.monotonic()
        code, _out, err = run_cli("savepoint", "create", str(path), "--drain", "--timeout", "3",
                                  "--controller", c.address)
        assert code == 2, err
        assert "drain: " in err  # progress on stderr: what it waits for
        assert "drain not finished" in err and "broken/0" in err and "left draining" in err, err
        assert time.monotonic() - started < 60
        assert not path.exists() and not Path(str(path) + ".partial").exists()
        with pytest.raises(PreconditionError, match="draining"):
            c.client.inject_records("events", records()[200:210])
        # Not stopped: the ranges are still assigned (and run).
        assert all(r.worker_id for r in c.client.status().ranges)
        # Stop with savepoint still works, with what is pending in the file.
        code, out, err = run_cli("savepoint", "create", str(path), "--stop", "--controller", c.address, "--json")
        assert code == 0, err
        assert json.loads(out)["stopped"] and not json.loads(out)["drained"]
    finally:
        c.stop()
