"""`millwheel run` with a Redis stream source and a PostgreSQL sink (real servers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.connector_pipeline import entries, expected_sums, spec, table_sums
from tests.support.postgres_server import PostgresServer
from tests.support.redis_server import RedisServer

pytest.importorskip("psycopg")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def servers() -> Any:
    with RedisServer() as redis_server, PostgresServer() as pg:
        yield redis_server, pg


def run(spec_path: Path, store: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "run", str(spec_path), "--store", store,
                           "--quiet", *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_redis_stream_to_postgres_once_with_bad_entries_dead_lettered(servers: Any, tmp_path: Path) -> None:
    import redis
    redis_server, pg = servers
    r = redis.Redis.from_url(redis_server.url)
    items = entries(400)
    for i, e in enumerate(items):
        r.xadd("events", e)
        if i == 100:
            r.xadd("events", {"key": "x", "value": "1"})  # no timestamp
        if i == 200:
            r.xadd("events", {"key": "x", "value": "1", "timestamp": "soon"})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec(redis_server.url, pg.url, until_end=True)))
    store = f"sqlite:///{tmp_path}/store.db"
    done = run(path, store, "--print", "ev.dead_letters")
    assert done.returncode == 3, done.stderr  # done, but records were set aside
    assert "dead-lettered records (ev.dead_letters 2)" in done.stderr
    letters = [json.loads(json.loads(line)["value"]) for line in done.stdout.splitlines()]
    assert sorted(m["message"].split(": ", 1)[1] for m in letters) == [
        "missing field 'timestamp'", "timestamp must be integer microseconds, got 'soon'"]
    assert table_sums(pg.rows("sums")) == expected_sums(items)
    # Again on the same store: the source resumes after its checkpointed entry (there is
    # none after it) and the sink after its position: the table is unchanged, none twice.
    before = pg.rows("sums")
    again = run(path, store)
    assert again.returncode == 0, again.stderr
    assert pg.rows("sums") == before


def test_a_spec_with_a_bad_source_or_sink_is_refused_without_its_password(tmp_path: Path) -> None:
    data = spec("redis://:hunter2@127.0.0.1:1/0", "postgresql://u:s3cret@127.0.0.1:1/db", until_end=True)
    data["injectors"][0]["source"]["stream_typo"] = "x"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    done = run(path, f"sqlite:///{tmp_path}/s.db")
    assert done.returncode != 0
    assert "injectors[0].source: unknown fields ['stream_typo']" in done.stderr
    data = spec("redis://127.0.0.1:1/0", "mysql://u:s3cret@127.0.0.1:1/db", until_end=True)
    path.write_text(yaml.safe_dump(data))
    done = run(path, f"sqlite:///{tmp_path}/s.db")
    assert "sinks[0].url: a postgres URL starts with postgresql:// or postgres://" in done.stderr
    assert "s3cret" not in done.stderr and "u:***@" in done.stderr


def test_the_readme_example_runs(servers: Any, tmp_path: Path) -> None:
    """README.md's Redis stream -> PostgreSQL spec, its URLs pointed at the test's servers."""
    import re

    import redis
    redis_server, pg = servers
    text = (ROOT / "README.md").read_text()
    block = re.search(r"### From a Redis stream to a PostgreSQL table.*?```yaml\n(.*?)```", text, re.S)
    assert block is not None
    spec_text = block.group(1).replace("redis://localhost:6379/0", redis_server.url).replace(
        "postgresql://app@localhost:5432/app", pg.url)
    r = redis.Redis.from_url(redis_server.url)
    for i in range(30):
        r.xadd("events", {"key": f"k{i % 2}", "value": str(i), "timestamp": str(1_000_000 * i)})
    path = tmp_path / "readme.yaml"
    path.write_text(spec_text)
    done = run(path, f"sqlite:///{tmp_path}/store.db")
    assert done.returncode == 0, done.stderr
    sums = {(row[1], row[2]): row[4]["value"] for row in pg.rows("sums")}
    assert sums == {(f"k{k}", w * 10_000_000): float(sum(i for i in range(w * 10, w * 10 + 10) if i % 2 == k))
                    for k in (0, 1) for w in range(3)}


def test_files_source_reads_every_file_in_name_order_once(tmp_path: Path) -> None:
    """A glob of JSON-lines files, followed: complete lines only, bad lines dead-lettered,
    a file that appears later read too, each line once."""
    indir = tmp_path / "in"
    indir.mkdir()

    def line(i: int) -> str:
        return json.dumps({"key": f"k{i % 3}", "value": i, "timestamp": 1_000_000 * i}) + "\n"

    (indir / "a.jsonl").write_text("".join(line(i) for i in range(10)) + "{bad json\n")
    (indir / "b.jsonl").write_text("".join(line(i) for i in range(10, 20)) + '{"key": "partial"')
    data = {"injectors": [{"name": "ev", "stream": "ev", "source": {"type": "files", "path": "in/*.jsonl"}}],
            "computations": [{"name": "keep", "inputs": ["ev"], "outputs": ["kept"],
                              "code": {"name": "filter", "params": {"expr": "True"}}}]}
    path = tmp_path / "files.yaml"
    path.write_text(yaml.safe_dump(data))
    store = f"sqlite:///{tmp_path}/store.db"
    # Following (no `until`): the run goes on; stop it once everything is through.
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "run", str(path), "--store", store, "--quiet"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import time

    from millwheel.state import open_store
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.5)
            st = open_store(store)
            try:
                if len(st.read_log("kept", 0, 1000)) >= 20 and st.read_log("ev.dead_letters", 0, 10):
                    break
            finally:
                st.close()
        (indir / "c.jsonl").write_text("".join(line(i) for i in range(20, 25)))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.5)
            st = open_store(store)
            try:
                kept = [r for _s, r in st.read_log("kept", 0, 1000)]
                letters = [json.loads(r.value) for _s, r in st.read_log("ev.dead_letters", 0, 10)]
            finally:
                st.close()
            if len(kept) >= 25 and len(letters) >= 2:
                break
    finally:
        proc.kill()
        proc.wait(10)
    assert sorted(int(r.value) for r in kept) == list(range(25))  # each once
    assert len({r.record_id for r in kept}) == 25
    # b's last line was never finished: given up once c appeared
    assert [m["message"].split(": ", 1)[1] for m in letters] == [
        "not valid JSON", "incomplete last line (a later file appeared)"]


def test_redis_source_watermark_follows_event_time_then_idle_time_never_backwards() -> None:
    """The pulled source's watermark: newest event time minus max_disorder_us; after
    idle_timeout_us of silence, processing time minus idle_timeout_us; never back, also
    when reopened from its checkpointed cursor."""
    import redis

    from millwheel.clock import ManualClock
    from millwheel.connectors.pulled import open_source
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        settings = {"type": "redis-stream", "url": server.url, "stream": "s", "max_disorder_us": 5,
                    "idle_timeout_us": 1_000, "fields": {"timestamp": "ts"}, "until": "never"}
        clock = ManualClock(10_000)
        src = open_source("ev", settings, clock)
        for ts in (100, 300, 200):
            r.xadd("s", {"key": "k", "value": "v", "ts": str(ts)})
        batch = src.read(None, 10)
        assert [rec.timestamp for rec in batch.records] == [100, 300, 200]
        assert batch.watermark == 295
        assert batch.records[0].record_id.startswith("redis:s:")
        clock.advance(999)
        quiet = src.read(batch.cursor, 10)
        assert quiet.watermark == 295 and not quiet.records  # not idle long enough yet
        clock.advance(1)
        idle = src.read(quiet.cursor, 10)
        assert idle.watermark == 11_000 - 1_000  # processing time minus the idle timeout
        r.xadd("s", {"key": "k", "value": "v", "ts": "500"})
        late = src.read(idle.cursor, 10)
        assert late.watermark == 10_000 and [x.timestamp for x in late.records] == [500]  # not back
        src.close()
        again = open_source("ev", settings, clock)  # a restart from the checkpointed cursor
        resumed = again.read(late.cursor, 10)
        assert resumed.records == [] and resumed.watermark == 10_000
        again.close()


def test_an_idle_source_that_cannot_be_read_does_not_advance_its_watermark() -> None:
    """The idleness rule: only a source that was read and had nothing left moves its
    watermark by idle_timeout_us; one that is down may hold unread entries."""
    import redis

    from millwheel.clock import ManualClock
    from millwheel.connectors.pulled import open_source
    server = RedisServer()
    server.start()
    try:
        r = redis.Redis.from_url(server.url)
        settings = {"type": "redis-stream", "url": server.url, "stream": "s", "max_disorder_us": 5,
                    "idle_timeout_us": 1_000, "fields": {"timestamp": "ts"}, "until": "never"}
        clock = ManualClock(10_000)
        src = open_source("ev", settings, clock)
        r.xadd("s", {"key": "k", "value": "v", "ts": "300"})
        batch = src.read(None, 10)
        assert batch.watermark == 295
    finally:
        server.stop()  # down, with whatever it held unread
    clock.advance(5_000)
    down = src.read(batch.cursor, 10)
    assert down.records == [] and down.watermark == 295
    src.close()
