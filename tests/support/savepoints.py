"""What the savepoint service tests share: the pipeline (tagged_counts'), its records,
the CLI run in process, and the whole mid-stream scenario (take a savepoint on one store while records
flow, restore it on another, feed the rest, compare with the failure-free run).

Used by tests/integration/test_service_savepoint.py (SQLite -> redis-server, refused
files) and test_service_savepoint_cluster.py (SQLite <-> Redis Cluster).
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

from millwheel.record import Record
from millwheel.savepoint.format import Writer
from millwheel.sources import ListSource
from services.cli import main as cli
from tests.support import tagged_counts
from tests.support.service_cluster import Cluster, expected_outputs, start_cluster, wait_for
from tests.support.tagged_counts import topology

N = 1200
BATCH = 40
CUT_AT = 12  # inject messages before the savepoint starts

Entry = tuple[str, bytes, int, str]


def records() -> list[Record]:
    return tagged_counts.records(N)


class _Enough(Exception):
    """Ends the feed of the first service once its savepoint is taken."""


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(list(args))
    return code, out.getvalue(), err.getvalue()


def log_entries(c: Cluster, stream: str) -> list[tuple[int, Entry]]:
    return [(seq, (r.key, r.value, r.timestamp, r.record_id)) for seq, r in c.client.subscribe(stream)]


def start(tmp: Path, name: str, store_url: str | None = None, workers: int = 2) -> Cluster:
    d = tmp / name
    d.mkdir()
    return start_cluster(d, workers, store_url=store_url)


def send_restore(c: Cluster, content: bytes) -> Any:
    """RestoreSavepoint with ``content`` as it is (no CLI check first); errors as the
    client raises them."""
    from services.generated import millwheel_pb2 as pb

    try:
        return c.client.stub.RestoreSavepoint(iter([pb.RestoreSavepointRequest(chunk=content)]), timeout=60)
    except Exception as exc:
        if hasattr(exc, "code"):
            raise c.client.error(exc) from None  # type: ignore[arg-type]
        raise


def forged(registry: dict[str, Any], frames: list[dict[str, Any]] = ()) -> bytes:  # type: ignore[assignment]
    """A well-formed, well-checksummed file with this registry and these frames."""
    buf = io.BytesIO()
    w = Writer(buf)
    w.frame({"t": "header", "created_us": 1, "stopped": False, "registry": registry})
    for fr in frames:
        w.frame(fr)
    w.finish()
    return buf.getvalue()


def flipped(data: bytes) -> bytes:
    """``data`` with one bit of its middle byte flipped."""
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0x01]) + data[mid + 1:]


def cut_and_take(first: Cluster, path: Path, recs: list[Record]) -> tuple[int, list[Entry]]:
    """Register the pipeline on ``first``, inject ``recs`` and take a savepoint into
    ``path`` mid-stream; stop feeding once it is taken. Returns the index of the first
    record the cut may lack, and the ``counts`` log entries up to the cut."""
    first.register(topology())
    first.wait_balanced()
    started = threading.Event()
    done_before: list[int] = []  # messages fully accepted before the savepoint began
    created: dict[str, Any] = {}

    def take() -> None:
        created["result"] = run_cli("savepoint", "create", str(path), "--controller", first.address, "--json")

    side = threading.Thread(target=take)

    def between(i: int) -> None:
        time.sleep(0.02)
        if i == CUT_AT:
            # The cut is to fall after some output: on a loaded machine the first service
            # may not have emitted a window yet after CUT_AT messages, so wait until it has.
            wait_for(lambda: log_entries(first, "counts"), 120, "a first window result before the cut")
            done_before.append(i + 1)
            started.set()
            side.start()
        if started.is_set() and not side.is_alive():
            raise _Enough  # the savepoint is taken: stop feeding the first service

    with contextlib.suppress(_Enough):
        first.inject("events", "events", recs, batch=BATCH, between=between)
    side.join(120)
    code, out, err = created["result"]
    assert code == 0, err
    summary = json.loads(out)
    assert summary["counts"]["ranges"] == 1 + 3 + 2 and summary["computations"] == 2
    cut = summary["log_last"].get("counts", 0)
    return done_before[0] * BATCH, [rec for seq, rec in log_entries(first, "counts") if seq <= cut]


def restore_and_finish(second: Cluster, path: Path, rest: list[Record], before: list[Entry],
                       refused: Callable[[Cluster, Path], None] | None = None) -> list[Entry]:
    """Restore ``path`` into the empty ``second`` (after ``refused``, which sends it
    files it must refuse), check what it holds, feed ``rest`` (the same record IDs) and
    return the ``counts`` entries it emits after the cut."""
    if refused is not None:
        refused(second, path)  # the good restore below needs an empty service: nothing was written
    code, out, err = run_cli("savepoint", "restore", str(path), "--controller", second.address, "--json")
    assert code == 0, err
    restored = json.loads(out)
    assert [c.spec.name for c in second.client.computations().computations] == ["tag", "counts"]
    assert {v.name: v.version for v in second.client.status().versions} == {"tag": 1, "counts": 1}
    second.wait_balanced()
    second.inject("events", "events", rest, batch=BATCH, done=True)
    second.wait_watermark("counts", timeout=120)
    mark = restored["restored_log_last"].get("counts", 0)
    # The restored log holds the first service's entries up to the cut, in order.
    assert [rec for seq, rec in log_entries(second, "counts") if seq <= mark] == before
    return [rec for seq, rec in log_entries(second, "counts") if seq > mark]


def mid_stream(tmp: Path, first_url: str | None, second_url: str | None, tag: str = "",
               refused: Callable[[Cluster, Path], None] | None = None) -> None:
    """The whole scenario: a savepoint taken mid-stream on ``first_url`` (None: SQLite)
    restored on ``second_url``; the union of the first's output up to the cut and the
    second's after it equals the failure-free run, each window once. ``refused``: see
    :func:`restore_and_finish`."""
    recs = records()
    path = tmp / f"cut{tag}.mwsp"
    first = start(tmp, f"first{tag}", store_url=first_url)
    try:
        resume_at, before = cut_and_take(first, path, recs)
    finally:
        first.stop()
    second = start(tmp, f"second{tag}", store_url=second_url)
    try:
        after = restore_and_finish(second, path, recs[resume_at:], before, refused)
    finally:
        second.stop()
    (tmp / f"expected{tag}").mkdir()
    want = expected_outputs(tmp / f"expected{tag}", topology(), {"events": ListSource(recs)}, ("counts",))["counts"]
    assert before and after, "the cut should fall mid-stream"
    assert sorted(before + after) == want  # each window exactly once, none missing
