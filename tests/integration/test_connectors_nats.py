"""NATS JetStream in and out: local mode, and service mode through kill -9 of a worker
and of the controller; the output subject must equal a failure-free run's, message by
message, none twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.test_connectors_service import owner_of
from tests.support.connector_pipeline import entries, expected_sums, message_sums, spec
from tests.support.nats_server import NatsServer
from tests.support.service_cluster import ROOT, Cluster, wait_for

pytest.importorskip("nats")


def nats_spec(url: str, *, until_end: bool, subject_in: str, subject_out: str, out: str = "OUT") -> dict[str, Any]:
    return spec("", "", until_end=until_end,
                source={"type": "nats-jetstream", "url": url, "stream": "EVENTS", "subject": subject_in},
                sink={"type": "nats-jetstream", "url": url, "subject": subject_out, "jetstream": out})


def bodies(items: list[dict[str, str]]) -> list[dict[str, Any]]:
    return [{"key": e["key"], "value": json.loads(e["value"]), "timestamp": int(e["timestamp"])} for e in items]


def run_local(tmp: Path, data: dict[str, Any], name: str) -> subprocess.CompletedProcess[str]:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return subprocess.run([sys.executable, "-m", "services.cli", "run", str(path), "--quiet", "--store",
                           f"sqlite:///{tmp}/{name}.db", "--print", "ev.dead_letters"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_nats_in_and_out_locally_with_a_bad_message_dead_lettered(tmp_path: Path) -> None:
    items = entries(300)
    with NatsServer() as server:
        server.add_stream("EVENTS", ["events.>"])
        msgs = bodies(items)
        server.publish("events.a", [*msgs[:150], {"key": "x", "value": 1}, *msgs[150:]])  # no timestamp
        done = run_local(tmp_path, nats_spec(server.url, until_end=True, subject_in="events.>",
                                             subject_out="out.sums"), "local")
        assert done.returncode == 3, done.stderr  # done, with a record set aside
        assert "dead-lettered records (ev.dead_letters 1)" in done.stderr
        letters = [json.loads(json.loads(line)["value"]) for line in done.stdout.splitlines()]
        assert [m["message"] for m in letters] == ["entry 151: missing field 'timestamp'"]
        assert message_sums(server.read("OUT", "out.sums")) == expected_sums(items)


def test_nats_in_and_out_in_service_mode_through_kill9(tmp_path: Path) -> None:
    items = entries(900)
    with NatsServer() as server:
        server.add_stream("EVENTS", ["events.>", "ref.>"])
        server.publish("ref.a", bodies(items))
        ref = run_local(tmp_path, nats_spec(server.url, until_end=True, subject_in="ref.>",
                                            subject_out="out.ref", out="REF"), "ref")
        assert ref.returncode == 0, ref.stderr
        reference = server.read("REF", "out.ref")
        assert message_sums(reference) == expected_sums(items)
        cluster = Cluster(tmp_path)
        try:
            cluster.start_controller()
            cluster.start_worker()
            cluster.start_worker()
            path = tmp_path / "spec.yaml"
            path.write_text(yaml.safe_dump(nats_spec(server.url, until_end=False, subject_in="events.>",
                                                     subject_out="out.sums")))
            reg = subprocess.run([sys.executable, "-m", "services.cli", "register", str(path), "--controller",
                                  cluster.address], cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert reg.returncode == 0, reg.stderr
            third = len(items) // 3
            server.publish("events.a", bodies(items[:third]))
            time.sleep(1.0)
            victim = owner_of(cluster, "injector:ev")
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(10)
            cluster.start_worker()
            server.publish("events.a", bodies(items[third:2 * third]))
            time.sleep(1.0)
            assert cluster.controller is not None
            os.kill(cluster.controller.pid, signal.SIGKILL)
            cluster.controller.wait(10)
            cluster.start_controller()
            victim = owner_of(cluster, "sink:sums.nats-jetstream")
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(10)
            cluster.start_worker()
            server.publish("events.a", [*bodies(items[2 * third:]),
                                        {"key": "end", "value": {"n": -1}, "timestamp": 10**15}])
            wait_for(lambda: len(server.read("OUT", "out.sums")) >= len(reference), 180,
                     f"{len(reference)} messages on out.sums")
            time.sleep(1.0)
            got = server.read("OUT", "out.sums")
            key = [(m["id"], m["key"], m["value"], m["timestamp"]) for m in reference]
            assert sorted((m["id"], m["key"], m["value"], m["timestamp"]) for m in got) == sorted(key)
        finally:
            cluster.stop()
