"""`millwheel backfill`: recompute windows from the stream log with Spark and compare."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from millwheel.runtime.local_runner import LocalRunner
from millwheel.state.sqlite_store import SQLiteStore
from services.cli import main
from services.cli.local import load_target
from services.cli.spark import parse_time
from tests.support import pipelines

S = 1_000_000
T1, T2 = 1010 * S, 1060 * S  # the workload spans 1000 s .. 1075 s of event time


def write_spec(tmp: Path, late: int = 0) -> Path:
    events = tmp / "events.jsonl"
    records = pipelines.workload(n=1500, users=5)
    pipelines.write_events_jsonl(events, records)
    with events.open("a") as fh:
        for i in range(late):  # arrive last, 60 s behind: beyond any allowed lateness
            fh.write(json.dumps({"key": "raw", "value": {"user": "u1", "n": 7}, "timestamp": (1015 + i) * S,
                                 "id": f"late-{i}"}) + "\n")
    spec = tmp / "pipeline.yaml"
    spec.write_text(f"""
injectors:
  - {{name: events, stream: events, file: {events.name}, max_disorder_us: 2000000}}
log_streams: [events]
computations:
  - name: counts
    inputs: [{{stream: events, key: "json:user"}}]
    outputs: [counts]
    code: {{name: spark_aggregate, params: {{size_us: 10000000, period_us: 5000000}}}}
    options: {{key_ranges: 2, late_policy: drop}}
  - name: sums
    inputs: [{{stream: events, key: "json:user"}}]
    outputs: [sums]
    code: {{name: window_aggregate, params: {{size_us: 20000000, aggregation: sum, field: n}}}}
    options: {{key_ranges: 2, late_policy: drop}}
""")
    return spec


def stream(spec: Path, db: Path) -> str:
    topology, sources = load_target(str(spec))
    # Batches of 500: the late records (last in the file) come after the watermark moved on.
    LocalRunner(topology, SQLiteStore(db), sources, batch_size=500).run(idle_sleep_s=0.001)
    return f"sqlite:///{db}"


def windows_in(store: SQLiteStore, name: str) -> dict[tuple[str, int], dict[str, Any]]:
    out = {}
    for _s, r in store.read_log(name, 0, 10**9):
        v = json.loads(r.value)
        if v["start"] >= T1 and v["end"] <= T2:
            out[(v["key"], v["start"])] = v
    return out


def test_backfill_equals_streaming_results_and_is_idempotent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_spec(tmp_path)
    url = stream(spec, tmp_path / "s.db")
    out = tmp_path / "counts.jsonl"
    args = ["backfill", "counts", "--from", str(T1), "--to", str(T2), "--spec", str(spec), "--store", url]
    assert main([*args, "--out", str(out), "--compare"]) == 0
    assert "0 different, 0 only in backfill, 0 only in the stream" in capsys.readouterr().err
    streamed = windows_in(SQLiteStore(tmp_path / "s.db"), "counts")
    backfilled = {(v["key"], v["start"]): v for v in map(json.loads, out.read_text().splitlines())}
    assert backfilled == streamed
    assert len(backfilled) == 5 * 9  # 5 users, sliding 10 s windows every 5 s inside 50 s
    # Into a stream log: twice, and the second run adds nothing (IDs from computation, key, window).
    assert main([*args, "--to-stream", "counts_backfill"]) == 0
    assert main([*args, "--to-stream", "counts_backfill"]) == 0
    store = SQLiteStore(tmp_path / "s.db")
    assert windows_in(store, "counts_backfill") == streamed
    assert len(store.read_log("counts_backfill", 0, 1000)) == len(streamed)
    # An in-process window_aggregate can be backfilled (and checked) the same way.
    sums = ["backfill", "sums", "--from", "1970-01-01T00:16:40Z", "--to", str(T2), "--spec", str(spec),
            "--store", url, "--compare"]
    assert main(sums) == 0
    assert "0 different" in capsys.readouterr().err


def test_compare_reports_windows_the_stream_dropped_late_records_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_spec(tmp_path, late=2)
    url = stream(spec, tmp_path / "s.db")
    capsys.readouterr()
    code = main(["backfill", "counts", "--from", str(T1), "--to", str(T2), "--spec", str(spec),
                 "--store", url, "--compare"])
    assert code == 1
    diffs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # late records at 1015 s and 1016 s (user u1) belong to the windows starting 1010 s and 1015 s
    assert sorted((d["diff"], d["backfill"]["key"], d["backfill"]["start"]) for d in diffs) == [
        ("different", "u1", 1010 * S), ("different", "u1", 1015 * S)]
    for d in diffs:
        assert d["backfill"]["value"] == d["stream"]["value"] + 2


def test_backfill_errors_name_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path)
    spec.write_text(spec.read_text().replace("log_streams: [events]", "log_streams: []"))
    base = ["--spec", str(spec), "--store", f"sqlite:///{tmp_path / 'e.db'}"]
    assert main(["backfill", "counts", "--from", "10", "--to", "20", *base]) == 2
    assert "add it to the topology's log_streams" in capsys.readouterr().err
    assert main(["backfill", "nope", "--from", "10", "--to", "20", *base]) == 2
    assert "no computation named 'nope'" in capsys.readouterr().err
    assert main(["backfill", "counts", "--from", "20", "--to", "10", *base]) == 2
    assert "must be after" in capsys.readouterr().err
    assert parse_time("1970-01-01T00:00:01.5") == 1_500_000
