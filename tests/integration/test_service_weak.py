"""Weak productions in the service: outputs are sent before the checkpoint, and only
those slow to be acked are checkpointed. A worker killed anywhere, including between
sending its outputs and checkpointing (``after_weak_send``), must still leave outputs
equal to a failure-free run record for record (the code runs again on the resent
input and its outputs, under the same IDs, are dropped downstream as duplicates)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from millwheel.topology import Options, Productions
from tests.integration.test_service_failures import run_pipeline
from tests.support import pipelines
from tests.support.service_cluster import Cluster

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
WEAK = Options(productions=Productions.WEAK, key_ranges=3)


@pytest.mark.parametrize("point", ["after_weak_send:6", "after_checkpoint:20"])
def test_weak_worker_killed_at_crash_point(cluster: Cluster, tmp_path: Path, point: str) -> None:
    crashing = cluster.start_worker(env={"MILLWHEEL_CRASH_AT": point})
    cluster.start_worker()
    cluster.start_worker()
    run_pipeline(cluster, tmp_path, lambda: None, pipelines.topology(WEAK))
    assert crashing.poll() == -signal.SIGKILL, "the crash point was reached"


def test_weak_kill9_worker_mid_stream(cluster: Cluster, tmp_path: Path) -> None:
    workers = [cluster.start_worker() for _ in range(3)]
    victim = workers[1]

    def kill() -> None:
        os.kill(victim.pid, signal.SIGKILL)

    run_pipeline(cluster, tmp_path, kill, pipelines.topology(WEAK))
    assert victim.wait(5) == -signal.SIGKILL


def test_describe_reports_weak(cluster: Cluster) -> None:
    cluster.start_worker()
    cluster.register(pipelines.topology(WEAK))
    spec = cluster.client.computations().computations[0].spec
    assert spec.options.productions == "weak"
