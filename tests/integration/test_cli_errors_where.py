"""``millwheel errors`` says where the failing code is: each error's FILE:LINE (the
innermost frame of the code that raised), in the table and in ``--json`` (issue 33)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from millwheel.record import MAX_TIMESTAMP
from tests.integration.test_service_dead_letters import BAD_AMOUNT, cli, events, sums_topology, with_bad
from tests.support.service_cluster import Cluster, start_cluster

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, workers=1)
    try:
        yield c
    finally:
        c.stop()


def test_errors_name_the_file_and_line_that_raised(cluster: Cluster) -> None:
    cluster.register(sums_topology())
    cluster.inject("events", "events", with_bad(events(50)), batch=100, max_disorder_us=2_000_000, done=True)
    cluster.wait_watermark("sums", MAX_TIMESTAMP, timeout=120)
    shown = json.loads(cli(cluster, "errors", "sums", "--json"))
    [bad] = [e for e in shown["recent_errors"] if e["record_id"] == BAD_AMOUNT.record_id]
    path, _, line = bad["where"].rpartition(":")
    assert path.endswith(".py") and line.isdigit(), bad
    table = cli(cluster, "errors", "sums")
    assert f"(at {bad['where']})" in table
