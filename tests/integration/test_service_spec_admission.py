"""Every spec the controller accepts can be built and run by a worker.

A built-in operator that writes nowhere (``outputs: []``), an ``output`` parameter
naming a stream the computation does not write, and a window or option so large that
a derived timestamp (a window's end plus its lateness, a retention horizon) no longer
fits in an int64 or a store column used to register: each then failed on every worker,
ten times a second, or wedged its range at its first record. Now each is refused at
registration (INVALID_ARGUMENT naming the field and the limit), the registry is left
as it was, and a canary pipeline flows throughout with every worker alive.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from millwheel.errors import MillWheelError
from services.generated import millwheel_pb2 as pb
from tests.support.canary_pipeline import COMPUTATION, Canary
from tests.support.service_cluster import Cluster

pytestmark = pytest.mark.timeout(300)
CENTURY_US = 100 * 365 * 86_400 * 1_000_000


def spec(name: str, code: str, params: dict[str, Any], outputs: list[str],
         options: pb.Options | None = None, inputs: tuple[str, ...] = ("canary-in",)) -> pb.ComputationSpec:
    return pb.ComputationSpec(name=name, inputs=[pb.InputStream(stream=s) for s in inputs], outputs=outputs,
                              code=pb.Code(name=code, params_json=json.dumps(params)),
                              options=options or pb.Options())


#: (spec, words the refusal must contain)
REFUSED = [
    (spec("f", "filter", {"expr": "True"}, []), ["'f'", "outputs", "filter"]),
    (spec("m", "map", {"key": "key"}, []), ["'m'", "outputs", "map"]),
    (spec("w", "window_aggregate", {"size_us": 1000}, []), ["'w'", "outputs", "window_aggregate"]),
    (spec("s", "spark_aggregate", {"size_us": 1000}, []), ["'s'", "outputs", "spark_aggregate"]),
    (spec("f2", "filter", {"function": "tests.support.misbehaving_code:first_char_key"}, []),
     ["'f2'", "outputs"]),
    (spec("o", "window_aggregate", {"size_us": 1000, "output": "elsewhere"}, ["out"]),
     ["'o'", "params.output", "'elsewhere'", "['out']"]),
    (spec("big", "window_aggregate", {"size_us": 10**30}, ["out"]),
     ["'big'", "params.size_us", "must be <="]),
    (spec("bigf", "window_aggregate", {"size_us": 1e30}, ["out"]), ["params.size_us", "must be <="]),
    (spec("late", "window_aggregate", {"size_us": 1000, "allowed_lateness_us": 10**30}, ["out"]),
     ["'late'", "allowed_lateness_us", "must be <="]),
    (spec("olate", "window_aggregate", {"size_us": 1000}, ["out"],
          pb.Options(allowed_lateness_us=2**63 - 1)), ["'olate'", "allowed_lateness_us", str(CENTURY_US)]),
    (spec("keep", "map", {"key": "key"}, ["out"], pb.Options(record_id_retention_us=2**63 - 1)),
     ["'keep'", "record_id_retention_us", str(CENTURY_US)]),
    (spec("ttl", "map", {"key": "key"}, ["out"], pb.Options(state_ttl_us=2**63 - 1)),
     ["'ttl'", "state_ttl_us"]),
    (spec("sw", "session_window", {"gap_us": 1000}, []), ["'sw'", "outputs", "session_window"]),
    (spec("sgap", "session_window", {}, ["out"]), ["'sgap'", "params.gap_us", "required"]),
    (spec("sbig", "session_window", {"gap_us": 10**30}, ["out"]), ["'sbig'", "params.gap_us", str(CENTURY_US)]),
    (spec("slate", "session_window", {"gap_us": 1000, "allowed_lateness_us": -1}, ["out"]),
     ["'slate'", "allowed_lateness_us", "must be >= 0"]),
    (spec("sagg", "session_window", {"gap_us": 1000, "aggregation": "median"}, ["out"]),
     ["'sagg'", "params.aggregation", "'median'"]),
    (spec("j1", "interval_join", {"lower_us": 0, "upper_us": 1}, ["out"]),
     ["'j1'", "inputs", "exactly two different streams"]),
    (spec("jsame", "interval_join", {"lower_us": 0, "upper_us": 1}, ["out"], inputs=("canary-in", "canary-in")),
     ["'jsame'", "inputs", "exactly two different streams"]),
    (spec("jnone", "interval_join", {"lower_us": 0, "upper_us": 1}, [], inputs=("canary-in", "canary-counts")),
     ["'jnone'", "outputs", "interval_join"]),
    (spec("jbounds", "interval_join", {"lower_us": 5, "upper_us": 1}, ["out"], inputs=("canary-in", "canary-counts")),
     ["'jbounds'", "params.upper_us", "must be >= lower_us"]),
    (spec("jbig", "interval_join", {"lower_us": -(10**30), "upper_us": 1}, ["out"],
          inputs=("canary-in", "canary-counts")), ["'jbig'", "params.lower_us", str(CENTURY_US)]),
    (spec("jside", "interval_join", {"lower_us": 0, "upper_us": 1, "left": "elsewhere"}, ["out"],
          inputs=("canary-in", "canary-counts")), ["'jside'", "params.left", "'elsewhere'"]),
]


def refusal(call: Any) -> MillWheelError:
    with pytest.raises(MillWheelError) as caught:
        call()
    return caught.value


def test_specs_no_worker_could_run_are_refused_and_change_nothing(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, allow_code="tests.support.misbehaving_code")
    try:
        cluster.start_controller()
        workers = [cluster.start_worker(), cluster.start_worker()]
        canary = Canary(cluster.client)
        canary.register()
        canary.round()
        def registry() -> tuple[list[pb.ComputationSpec], list[pb.InjectorSpec]]:
            listed = cluster.client.computations()  # (watermarks move: the specs are the registry)
            return [c.spec for c in listed.computations], list(listed.injectors)

        before = registry()
        for bad, words in REFUSED:
            for call in (lambda b=bad: cluster.client.register_computation(b),  # type: ignore[misc]
                         # all or nothing: a good computation beside it is not registered either
                         lambda b=bad: cluster.client.register_topology(  # type: ignore[misc]
                             [spec("fine", "map", {"key": "key"}, ["fine-out"]), b], [])):
                err = refusal(call)
                assert getattr(err, "status", None) == grpc.StatusCode.INVALID_ARGUMENT, (bad.name, err)
                for word in words:
                    assert word in str(err), (bad.name, word, str(err))
            assert registry() == before, bad.name
        # The same specs with what was missing are accepted: the limits refuse only what
        # no worker could run.
        cluster.client.register_computation(spec("f", "filter", {"expr": "True"}, ["f-out"]))
        cluster.client.register_computation(
            spec("w", "window_aggregate", {"size_us": CENTURY_US, "allowed_lateness_us": CENTURY_US},
                 ["w-out"], pb.Options(allowed_lateness_us=CENTURY_US, record_id_retention_us=CENTURY_US)))
        cluster.client.register_computation(
            spec("sw", "session_window", {"gap_us": CENTURY_US, "allowed_lateness_us": CENTURY_US}, ["sw-out"]))
        cluster.client.register_computation(
            spec("j", "interval_join", {"lower_us": -CENTURY_US, "upper_us": CENTURY_US,
                                        "allowed_lateness_us": CENTURY_US}, ["j-out"],
                 inputs=("canary-in", "f-out")))
        for _ in range(2):
            canary.round()
        status = cluster.client.status()
        assert len(status.workers) == 2 and all(w.alive for w in status.workers), status.workers
        assert all(p.poll() is None for p in workers)
        assert {c.spec.name for c in cluster.client.computations().computations} == {COMPUTATION, "f", "w", "sw", "j"}
        for i in range(2):
            assert "Traceback" not in cluster.log(f"worker{i}"), cluster.log(f"worker{i}")[-3000:]
        print(f"canary rounds (s): {[round(t, 2) for t in canary.seconds]}")
    finally:
        cluster.stop()
