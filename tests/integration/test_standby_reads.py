"""A standby controller answers DescribeComputation and ListComputations with the registry
the store holds now (issue 34): a client that just updated a computation through any
controller, standby or leader, reads the new spec and version through a standby at
once, never the spec of up to half a second ago (the standby's periodic pass).

Real processes on loopback: two ``millwheel controller`` over one store (SQLite, and a
real redis-server), no workers (an update's fence needs none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from millwheel.topology import CodeRef, ComputationSpec, InputSpec, Options
from services.rpc.convert import spec_from_proto, spec_to_proto
from tests.integration.test_controller_ha import HACluster
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
UPDATES = 8


def spec(i: int) -> ComputationSpec:
    """Version ``i + 1`` of the computation: its map's value expression names ``i``."""
    return ComputationSpec("c", (InputSpec("events"),), ("out",),
                           CodeRef("map", {"key": "key", "value": f"'v{i}'"}), Options(key_ranges=2))


@pytest.fixture(params=["sqlite", "redis"])
def ha(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[HACluster]:
    redis = RedisServer() if request.param == "redis" else None
    c = HACluster(tmp_path, n=2, store_url=redis.url if redis else None)
    try:
        yield c
    finally:
        c.stop()
        if redis is not None:
            redis.stop()


def test_a_standby_describes_each_update_at_once(ha: HACluster) -> None:
    ha.start_controller()
    leader_address = ha.leader()
    assert leader_address is not None
    lead = ha.addresses.index(leader_address)
    standby, leader = ha.one(1 - lead), ha.one(lead)
    try:
        standby.register_injector("events", "events")
        standby.register_computation(spec_to_proto(spec(0)), [])
        assert standby.describe("c").version == 1
        stale = []
        for i in range(1, UPDATES + 1):
            writer = standby if i % 2 else leader  # through the standby (forwarded), then the leader
            assert writer.update(spec_to_proto(spec(i))).computation.version == i + 1
            info = standby.describe("c")  # at once: well inside the standby's 0.5 s pass
            listed = {c.spec.name: c for c in standby.computations().computations}["c"]
            for what, got in (("DescribeComputation", info), ("ListComputations", listed)):
                if got.version != i + 1 or spec_from_proto(got.spec).code.params["value"] != f"'v{i}'":
                    stale.append((i + 1, what, got.version, spec_from_proto(got.spec).code.params))
        assert stale == [], f"stale answers through the standby (wanted version, rpc, got): {stale}"
        assert standby.describe("c").has_previous
    finally:
        standby.close()
        leader.close()
