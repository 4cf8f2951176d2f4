"""window_top, window_join and stream_join in ``millwheel run`` (local mode) from a YAML
spec reading JSON-lines files, as a user runs them: the printed streams equal the
plain-Python references (tests/support/window_refs.py) on seeded out-of-order records
with late ones, and records beyond the lateness are routed to the late streams."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

import yaml

from millwheel.record import Record
from tests.support import operator_refs as ref
from tests.support import window_refs as wref
from tests.support.operator_refs import DISORDER, LATENESS, S

ROOT = Path(__file__).resolve().parents[2]
SIZE = 10 * S


def write_jsonl(path: Path, records: list[Record]) -> None:
    path.write_text("".join(json.dumps({"key": r.key, "value": json.loads(r.value), "timestamp": r.timestamp,
                                        "id": r.record_id}) + "\n" for r in records))


def spec() -> dict[str, Any]:
    opts = {"key_ranges": 2, "allowed_lateness_us": LATENESS, "late_policy": "route"}
    return {
        "injectors": [{"name": "ia", "stream": "a", "file": "a.jsonl", "max_disorder_us": DISORDER},
                      {"name": "ib", "stream": "b", "file": "b.jsonl", "max_disorder_us": DISORDER}],
        "computations": [
            {"name": "top", "inputs": [{"stream": "a"}], "outputs": ["top-out"],
             "options": {**opts, "late_stream": "top-late"},
             "code": {"name": "window_top", "params": {"size_us": SIZE, "field": "x"}}},
            {"name": "wjoin", "inputs": [{"stream": "a"}, {"stream": "b"}], "outputs": ["wjoin-out"],
             "options": {**opts, "late_stream": "wjoin-late"},
             "code": {"name": "window_join", "params": {"size_us": SIZE, "offset_us": 5 * S}}},
            {"name": "sjoin", "inputs": [{"stream": "a"}, {"stream": "b"}], "outputs": ["sjoin-out"],
             "options": {**opts, "late_stream": "sjoin-late"},
             "code": {"name": "stream_join", "params": {"retention_us": 20 * S}}},
        ],
    }


def test_the_three_operators_in_millwheel_run_match_the_references(tmp_path: Path) -> None:
    a, beyond_a = ref.timeline(21, 300, "a", keys=3)
    b, beyond_b = ref.timeline(22, 300, "b", keys=3)
    write_jsonl(tmp_path / "a.jsonl", a)
    write_jsonl(tmp_path / "b.jsonl", b)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec()))
    streams = ["top-out", "top-late", "wjoin-out", "sjoin-out", "sjoin-late"]
    done = subprocess.run([sys.executable, "-m", "services.cli", "run", "spec.yaml", "--store",
                           "sqlite:///store.db", "--quiet", "--batch-size", "20",
                           *[arg for s in streams for arg in ("--print", s)]],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    out = printed_by_order(done.stdout, done.stderr, streams)
    kept_a = [r for r in a if r.record_id not in beyond_a]
    kept_b = [r for r in b if r.record_id not in beyond_b]
    assert min(len(out[s]) for s in streams) > 5, {s: len(out[s]) for s in streams}
    assert wref.final_tops(out["top-out"], "x") == wref.tops(kept_a, SIZE, "x")
    assert as_data(out["top-late"]) == as_data(r for r in a if r.record_id in beyond_a)
    assert wref.window_join_outputs(out["wjoin-out"]) == wref.window_pairs(kept_a, kept_b, SIZE, 5 * S)
    assert ref.join_outputs(out["sjoin-out"]) == ref.joined(kept_a, kept_b, -20 * S, 20 * S)
    assert as_data(out["sjoin-late"]) == as_data(r for r in a + b if r.record_id in beyond_a | beyond_b)


def as_data(records: Iterable[Record]) -> list[tuple[str, Any, int]]:
    """Records as a user compares them: a routed late record has an ID of its own."""
    return sorted(((r.key, json.loads(r.value), r.timestamp) for r in records), key=repr)


def printed_by_order(stdout: str, stderr: str, streams: list[str]) -> dict[str, list[Record]]:
    """The ``--print`` output split by stream: each stream's records printed one after
    another in the order asked, as JSON ``{"key", "value", "timestamp", "id"}`` lines;
    how many each has is the ``STREAM: N records`` line on stderr."""
    counts = {}
    for line in stderr.splitlines():
        name, sep, rest = line.rpartition(": ")
        if sep and name in streams and rest.endswith(" records"):
            counts[name] = int(rest.split()[0])
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    out: dict[str, list[Record]] = {}
    i = 0
    for s in streams:
        out[s] = [Record(d["key"], d["value"].encode(), d["timestamp"], d["id"]) for d in lines[i:i + counts[s]]]
        i += counts[s]
    assert i == len(lines)
    return out
