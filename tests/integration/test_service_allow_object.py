"""The code allow-list is checked on the object named, not only on its module.

With ``--allow-code tests.support.misbehaving_code``, that module's own classes and
functions run; but the module imports ``os`` and ``subprocess``, so
``...:subprocess.Popen``, ``...:os.system`` and the re-exported ``...:system`` are
reachable through it. They used to pass (the module is allowed) and a worker ran them:
``Popen`` as a computation's code started a shell command. Now a worker resolves the
object and refuses it unless it is a class or function defined in an allowed module;
nothing is run, the refusal shows as failing ranges, and the rest of the service,
allowed code of that same module included, runs on.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from services.generated import millwheel_pb2 as pb
from tests.support.canary_pipeline import Canary
from tests.support.service_cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(300)
CODE = "tests.support.misbehaving_code"


def comp(name: str, code: str, params: dict[str, object], key: str = "key") -> pb.ComputationSpec:
    return pb.ComputationSpec(name=name, inputs=[pb.InputStream(stream="sneaky-in", key_extractor=key)],
                              outputs=[f"{name}-out"],
                              code=pb.Code(name=code, params_json=json.dumps(params)),
                              options=pb.Options(key_ranges=1))


def test_objects_reached_through_an_allowed_module_are_refused_and_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    cluster = Cluster(tmp_path, allow_code=CODE)
    try:
        cluster.start_controller()
        cluster.start_worker()
        cluster.start_worker()
        canary = Canary(cluster.client)
        canary.register()
        canary.round()
        refused = {  # computation -> the object's defining module, which the refusal names
            "popen": (comp("popen", f"{CODE}:subprocess.Popen", {"args": ["touch", str(marker)]}),
                      "subprocess"),
            "os-system": (comp("os-system", "map", {"function": f"{CODE}:os.system"}), "posix"),
            "re-export": (comp("re-export", "filter", {"function": f"{CODE}:system"}), "posix"),
            "key-fn": (comp("key-fn", f"{CODE}:PassThrough", {"output": "key-fn-out"},
                            key=f"import:{CODE}:os.getcwd"), "posix"),
        }
        allowed = comp("allowed", f"{CODE}:PassThrough", {"output": "allowed-out"},
                       key=f"import:{CODE}:first_char_key")
        cluster.client.register_topology([allowed, *(s for s, _m in refused.values())],
                                         [("sneaky", "sneaky-in")])
        records = [pb.Record(key=f"key{i}", value=b"%d" % i, timestamp=1_000_000 + i, id=f"s{i}")
                   for i in range(50)]
        cluster.client.inject([pb.InjectRequest(injector="sneaky", stream="sneaky-in", records=records)])

        # The module's own code runs (class and key extractor defined in it) ...
        wait_for(lambda: len(list(cluster.client.subscribe("allowed-out"))) == 50, 30,
                 "the allowed computation's output")
        assert {r.key for _s, r in cluster.client.subscribe("allowed-out")} == {"k"}
        # ... what it merely imported does not: refused, visibly, on every worker.
        for name, (_spec, module) in refused.items():
            wait_for(lambda n=name: cluster.client.describe(n).failing_ranges, 20,  # type: ignore[misc]
                     f"{name} to show as failing")
            (f,) = cluster.client.describe(name).failing_ranges
            assert f.stage == "refused" and f.exception_type == "PermissionDeniedError", f
            assert f"module {module!r}" in f.message and "allow-list" in f.message, f.message
            assert not list(cluster.client.subscribe(f"{name}-out")), name
        for _ in range(2):
            canary.round()
        time.sleep(2)
        assert not marker.exists(), "a shell command named through an allowed module ran"
        status = cluster.client.status()
        assert len(status.workers) == 2 and all(w.alive for w in status.workers), status.workers
        assert all(p.poll() is None for p in cluster.workers)
        for i in range(2):
            log = cluster.log(f"worker{i}")
            assert "Traceback" not in log and len(log) < 50_000, log[-3000:]
        print(f"canary rounds (s): {[round(t, 2) for t in canary.seconds]}")
    finally:
        cluster.stop()
