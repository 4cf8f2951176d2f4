"""Kill -9 a `millwheel run` while a Spark stage's window buffer is half written;
restart; the output equals the failure-free run record by record (SQLite and Redis).

    events --[counts: spark_aggregate, 60 s count per user]--> counts --[totals]--> totals

A 60 s window holds ~1,200 records that arrive over several injector batches, so the
range's buffer for it grows over several checkpoints. The crash lands after one of
those (the process SIGKILLs itself at an exact ``after_checkpoint`` visit chosen from
the reference run) and the test checks the store really holds a partial buffer then.
``totals`` keeps a running sum of window counts per user: a record lost or counted
twice in a buffer would change a window's count and every later total.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Iterator

import pytest

from millwheel.runtime.local_runner import LocalRunner
from millwheel.state import open_store
from millwheel.state.sqlite_store import SQLiteStore
from services.cli.local import load_target
from tests.support import pipelines, spark_pipeline
from tests.support.redis_server import RedisServer


def write_spec(tmp: Path) -> Path:
    return spark_pipeline.write_spec(tmp, 12_000, 60_000_000, "aggregation: count")  # 60 s windows


def buffered(store_url: str) -> dict[int, int]:
    """Window start -> records in the counts stage's buffers (both ranges)."""
    store = open_store(store_url)
    try:
        out: dict[int, int] = {}
        for r in (0, 1):
            for name in store.list_buffers("counts", r):
                lines = sum(chunk.count(b"\n") for chunk in store.read_buffer("counts", r, name))
                out[int(name)] = out.get(int(name), 0) + lines
        return out
    finally:
        store.close()


def reference_run(spec: Path, db: Path) -> tuple[pipelines.Outputs, list[int]]:
    """The failure-free run, in process; and the ``after_checkpoint`` visits at which
    the store holds a window buffer that is not complete yet."""
    topology, sources = load_target(str(spec))
    visits = [0]
    partial_at: list[int] = []
    url = f"sqlite:///{db}"

    def hook(point: str) -> None:
        if point == "after_checkpoint":
            visits[0] += 1
            if buffered(url):
                partial_at.append(visits[0])

    runner = LocalRunner(topology, SQLiteStore(db), sources, crash=hook)
    runner.run(idle_sleep_s=0.001)
    return pipelines.outputs(SQLiteStore(db)), partial_at


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 's.db'}"
    else:
        with RedisServer() as server:
            yield server.url


def test_kill9_with_a_window_buffer_half_written_then_restart_is_exactly_once(
    tmp_path: Path, store_url: str
) -> None:
    spec = write_spec(tmp_path)
    reference, partial_at = reference_run(spec, tmp_path / "ref.db")
    ref_counts = {}  # (window start) -> records over all users
    for _k, value, _t, _i in reference["counts"]:
        result = json.loads(value)
        ref_counts[result["start"]] = ref_counts.get(result["start"], 0) + result["count"]
    assert len(reference["counts"]) > 50 and len(partial_at) >= 3
    crash_at = partial_at[len(partial_at) // 2]
    proc = spark_pipeline.millwheel_run(spec, store_url, f"after_checkpoint:{crash_at}")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    held = buffered(store_url)
    assert held and any(0 < n < ref_counts[start] for start, n in held.items()), (held, ref_counts)
    crashed = pipelines.outputs_of(store_url)
    assert len(crashed["counts"]) < len(reference["counts"])  # it died mid-run
    proc = spark_pipeline.millwheel_run(spec, store_url, None)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert pipelines.outputs_of(store_url) == reference
    assert buffered(store_url) == {}  # every window fired and its buffer went with it
