"""The topology and paced source that ``millwheel run bench.cases.recovery_target`` runs in
the recovery figure; configured by ``$BENCH_RECOVERY`` (JSON: n, keys, distribution,
density, rate, t0, pipeline, probe). The release schedule is anchored at ``t0`` (wall
clock), so records keep arriving while the process is dead and a restarted runner
starts with that backlog, as a real worker would."""

from __future__ import annotations

import json
import os

from bench import pipelines
from bench.run_local import WorkloadArgs

_spec = json.loads(os.environ.get("BENCH_RECOVERY", "{}"))
_pipeline = _spec.get("pipeline", "single")
_w = WorkloadArgs(
    int(_spec.get("n", 1000)), int(_spec.get("keys", 1000)), _spec.get("distribution", "uniform"),
    density=_spec.get("density"),
).build()

topology = pipelines.topology(_pipeline, count_code="bench.pipelines:ProbedCount")
sources = {
    "events": pipelines.PacedSource(
        pipelines.injected(_w.records, _pipeline), float(_spec.get("rate", 1000.0)), float(_spec.get("t0", 0.0))
    )
}
