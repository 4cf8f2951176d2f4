"""A small multi-stage topology and workload shared by the recovery tests.

    events --[parse: map, re-key by JSON field "user"]--> parsed
    parsed --[counts: window_aggregate, 10 s tumbling count]--> counts
    counts --[totals: RunningTotal, cumulative per key]--> totals (sink)
    counts is also a sink (logged)

``RunningTotal`` makes double processing visible: a record counted twice changes
every later total of its key, not just one output.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from millwheel.computation import Computation, Context
from millwheel.keys import KeyExtractor
from millwheel.record import Record
from millwheel.sources import ListSource
from millwheel.state import open_store
from millwheel.state.protocol import StateStore
from millwheel.topology import (
    CodeRef,
    ComputationSpec,
    InjectorSpec,
    InputSpec,
    Options,
    Topology,
)
from tests.support import faulty

SECOND = 1_000_000
ROOT = Path(__file__).resolve().parents[2]
Outputs = dict[str, list[tuple[str, bytes, int, str]]]


class Doubler(faulty.Doubler):
    """The error-policy tests' user code, as ``tests.support.pipelines:Doubler`` too: a
    service test cluster that allows this module's code runs it. (Defined here, not
    imported: a worker runs only classes and functions defined in an allowed module.)"""


class RunningTotal(Computation):
    def process_record(self, ctx: Context, record: Record) -> None:
        window = json.loads(record.value)
        total = int(ctx.state or b"0") + int(window["count"])
        ctx.set_state(str(total).encode())
        ctx.produce(
            "totals", ctx.key, json.dumps({"through": window["end"], "total": total}).encode(), record.timestamp
        )


def topology(options: Options | None = None, key_ranges: int = 3) -> Topology:
    opts = options or Options(key_ranges=key_ranges)
    return Topology(
        computations=(
            ComputationSpec(
                "parse", (InputSpec("events"),), ("parsed",), CodeRef("map", {"key": "json['user']"}), opts
            ),
            ComputationSpec(
                "counts",
                (InputSpec("parsed"),),
                ("counts",),
                CodeRef("window_aggregate", {"size_us": 10 * SECOND}),
                opts,
            ),
            ComputationSpec(
                "totals", (InputSpec("counts"),), ("totals",), CodeRef("tests.support.pipelines:RunningTotal"), opts
            ),
        ),
        injectors=(InjectorSpec("events", "events"),),
        log_streams=("counts",),
    )


def workload(n: int = 1500, users: int = 12, seed: int = 3, disorder_us: int = 2 * SECOND) -> list[Record]:
    """Events one user each, ~20 per second of event time, bounded disorder."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        ts = 1_000 * SECOND + i * 50_000
        items.append((ts + rng.randrange(disorder_us), ts, f"u{rng.randrange(users)}"))
    items.sort()
    return [
        Record("raw", json.dumps({"user": u, "n": i}).encode(), ts, f"ev-{i}") for i, (_o, ts, u) in enumerate(items)
    ]


def sources(records: list[Record], disorder_us: int = 2 * SECOND) -> dict[str, Any]:
    return {"events": ListSource(records, disorder_us)}


def outputs(
    store: StateStore, streams: tuple[str, ...] = ("counts", "totals")
) -> dict[str, list[tuple[str, bytes, int, str]]]:
    """Each sink stream's records as sorted (key, value, timestamp, id) tuples."""
    return {
        s: sorted((r.key, r.value, r.timestamp, r.record_id) for _seq, r in store.read_log(s, 0, 10**9))
        for s in streams
    }


def final_state(store: StateStore, computation: str) -> dict[str, bytes]:
    keys = store.list_keys(computation, None, 10**6)
    return store.read_state(computation, keys)


def key_extractor(spec: str) -> KeyExtractor:
    return KeyExtractor(spec)


def write_events_jsonl(path: Path, records: list[Record]) -> Path:
    """Records as the JSON lines `millwheel run` and `millwheel inject` read."""
    with path.open("w") as fh:
        for r in records:
            fh.write(json.dumps({"key": r.key, "value": json.loads(r.value), "timestamp": r.timestamp,
                                 "id": r.record_id}) + "\n")
    return path


def write_spec(tmp: Path, n: int, key_ranges: int = 3) -> Path:
    """This module's topology as a YAML spec over a JSON-lines file of ``workload(n)``."""
    events = write_events_jsonl(tmp / "events.jsonl", workload(n=n))
    spec = tmp / "pipeline.yaml"
    spec.write_text(f"""
injectors:
  - {{name: events, stream: events, file: {events.name}, max_disorder_us: 2000000}}
log_streams: [counts]
computations:
  - name: parse
    inputs: [events]
    outputs: [parsed]
    code: {{name: map, params: {{key: "json['user']"}}}}
    options: {{key_ranges: {key_ranges}}}
  - name: counts
    inputs: [parsed]
    outputs: [counts]
    code: {{name: window_aggregate, params: {{size_us: 10000000}}}}
    options: {{key_ranges: {key_ranges}}}
  - name: totals
    inputs: [counts]
    outputs: [totals]
    code: tests.support.pipelines:RunningTotal
    options: {{key_ranges: {key_ranges}}}
""")
    return spec


def millwheel_run(
    spec: Path, url: str, crash_at: str | None = None, extra_env: dict[str, str] | None = None,
    batch_size: int | None = 250, extra_args: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    """``python -m services.cli run SPEC --store URL`` as a child process (kill it with -9).

    Small batches by default, so a crash point's N-th visit falls inside the run
    (``batch_size=None``: the CLI's own default)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(extra_env or {})}
    env.pop("MILLWHEEL_CRASH_AT", None)
    if crash_at:
        env["MILLWHEEL_CRASH_AT"] = crash_at
    batch = ["--batch-size", str(batch_size)] if batch_size is not None else []
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "run", str(spec), "--store", url, "--quiet", *batch, *extra_args],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )


def run_to_end(spec: Path, url: str, timeout_s: float = 180) -> None:
    proc = millwheel_run(spec, url)
    _, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err.decode()


def outputs_of(url: str) -> Outputs:
    store = open_store(url)
    try:
        return outputs(store)
    finally:
        store.close()



def key_of(record: Record) -> str:
    """A key extractor by import path (``import:tests.support.pipelines:key_of``): the
    record's own key, for tests of what the controller does with user-code keying."""
    return record.key
