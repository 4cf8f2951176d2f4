"""The Python client API as a user's script uses it: core types in (a Topology,
Records), core types out, errors as millwheel exceptions carrying the gRPC status."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest

import millwheel
from millwheel.errors import AlreadyExistsError, NotFoundError
from millwheel.queries import KeyState, NodeWatermark
from millwheel.record import MAX_TIMESTAMP, Timer
from millwheel.topology import Topology
from services.client import ControllerClient
from services.generated import millwheel_pb2 as pb
from tests.support import pipelines
from tests.support.service_cluster import PIPELINE_CODE, Cluster, expected_outputs


def test_register_inject_subscribe_with_core_types(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, allow_code=PIPELINE_CODE)
    try:
        cluster.start_controller()
        cluster.start_worker()
        cluster.start_worker()
        topology = pipelines.topology(key_ranges=2)
        records = pipelines.workload(n=300)
        with ControllerClient(cluster.address, timeout_s=10) as mw:
            resp = mw.register(topology)
            assert sorted(c.spec.name for c in resp.computations) == sorted(c.name for c in topology.computations)
            # All or nothing: a new computation beside one that clashes is not registered.
            first = topology.computations[0]
            clash = dataclasses.replace(first, options=dataclasses.replace(first.options, key_ranges=5))
            extra = dataclasses.replace(topology.computations[-1], name="extra", outputs=("extra_out",))
            with pytest.raises(AlreadyExistsError) as again:
                mw.register(Topology((clash, extra), topology.injectors))
            assert again.value.status == grpc.StatusCode.ALREADY_EXISTS  # type: ignore[attr-defined]
            assert "extra" not in {c.spec.name for c in mw.computations().computations}
            accepted = mw.inject_records("events", records, max_disorder_us=2 * pipelines.SECOND, done=True)
            assert accepted.accepted == len(records) and accepted.watermark == MAX_TIMESTAMP
            cluster.wait_watermark("totals")
            got = sorted((r.key, r.value, r.timestamp, r.record_id) for _seq, r in mw.subscribe("totals"))
            assert [w.node for w in mw.watermarks()] == sorted(
                [c.name for c in topology.computations] + ["injector:events"])
            some_key = got[0][0]
            assert mw.state("totals", some_key).exists
            # Core types come out (the README's promise), not protocol messages.
            wms = mw.watermarks()
            assert all(type(w) is NodeWatermark and w.done for w in wms)
            state = mw.state("totals", some_key)
            assert type(state) is KeyState and (state.computation, state.key) == ("totals", some_key)
            assert isinstance(state.state, bytes) and all(type(t) is Timer for t in state.timers)
            assert some_key in set(mw.keys("totals"))
            with pytest.raises(NotFoundError) as missing:
                mw.state("nope", "k")
            assert missing.value.status == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
            assert "no computation named 'nope'" in str(missing.value)
            _resp, call = mw.stub.ClusterStatus.with_call(pb.ClusterStatusRequest(), timeout=10)
            assert ("millwheel-version", millwheel.__version__) in call.initial_metadata()
        want = expected_outputs(tmp_path, topology, pipelines.sources(records), ["totals"])
        assert got == want["totals"]
    finally:
        cluster.stop()
