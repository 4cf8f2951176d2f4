"""A rescale keeps a computation's error counts (before: shrinking from 4 ranges to 1
dropped the dead letters counted by ranges 1-3 from DescribeComputation, `millwheel
status` and the console, and growing again brought stale ones back)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from millwheel.keys import KeyExtractor
from millwheel.record import Record
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology
from tests.support.service_cluster import Cluster, start_cluster, wait_for

pytestmark = pytest.mark.timeout(240)
S = 1_000_000
USERS = [f"u{i}" for i in range(16)]  # enough keys that every one of 4 ranges has some


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def topology() -> Topology:
    return Topology(
        computations=(ComputationSpec(
            "sums", (InputSpec("events", KeyExtractor("json:user")),), ("sums",),
            CodeRef("window_aggregate", {"size_us": 10 * S, "aggregation": "sum", "field": "amount"}),
            Options(key_ranges=4)),),
        injectors=(InjectorSpec("events", "events"),),
    )


def events() -> list[Record]:
    """Two records per user, one of them a bad amount (dead-lettered by the sum)."""
    out = []
    for i, user in enumerate(USERS):
        out.append(Record("raw", json.dumps({"user": user, "amount": i}).encode(), 1_000 * S + i * S, f"ok-{i}"))
        out.append(Record("raw", json.dumps({"user": user, "amount": "abc"}).encode(), 1_000 * S + i * S + 1,
                          f"bad-{i}"))
    return out


def test_dead_letter_counts_survive_a_shrink_and_a_grow(cluster: Cluster) -> None:
    cluster.register(topology())
    cluster.inject("events", "events", events(), batch=8)
    wait_for(lambda: cluster.client.describe("sums").dead_lettered == len(USERS), 90,
             "every bad amount dead-lettered")
    counted = {e.range_id for e in cluster.client.describe("sums").recent_errors}
    assert len(counted) > 1, counted  # the counts are spread over the ranges: a shrink strands some

    cluster.client.rescale("sums", 1)
    info = cluster.client.describe("sums")
    assert info.spec.options.key_ranges == 1
    assert info.dead_lettered == len(USERS)
    assert {e.record_id for e in info.recent_errors} == {f"bad-{i}" for i in range(len(USERS))}

    cluster.client.rescale("sums", 4)
    assert cluster.client.describe("sums").dead_lettered == len(USERS)
    # and new errors count on top, in the new layout
    late_bad = Record("raw", json.dumps({"user": "u3", "amount": "x"}).encode(), 1_000 * S + 40 * S, "bad-more")
    cluster.inject("events", "events", [late_bad])
    wait_for(lambda: cluster.client.describe("sums").dead_lettered == len(USERS) + 1, 90,
             "the next bad amount counted on top")
