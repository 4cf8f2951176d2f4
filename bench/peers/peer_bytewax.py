"""The peer: Bytewax's keyed 10 s tumbling count on the same workload.

Same records, same keys, same windows, same answer (checked with the same
:func:`bench.workload.check`). Bytewax's event clock would also age its watermark by
wall-clock time, which on a replayed backlog drops on-time records as late; the clock
here is pinned (``now_getter``) so its watermark follows event time only, and waits
5 s for stragglers. Its clock is per key, so a late record of a key not seen for a
while can still be on time for Bytewax: the check expects exactly the late records
Bytewax reports as late to be missing, and fails if it dropped any on-time record.
"Recovery on" is Bytewax's own: SQLite snapshot partitions (``bytewax.recovery``) written at every epoch (``epoch_s``).
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.run_local import WorkloadArgs, peak_rss_mb
from bench.workload import EPOCH_US, WINDOW_US, check

ALIGN = datetime.fromtimestamp(EPOCH_US / 1e6, tz=UTC)


def available() -> str | None:
    """None if Bytewax imports, else why not (recorded in the results)."""
    try:
        import bytewax  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means "not available"
        return f"{exc.__class__.__name__}: {exc}"
    return None


def bytewax_case(wa: WorkloadArgs, recovery: bool, epoch_s: float = 1.0, batch: int = 1000) -> dict[str, Any]:
    import bytewax.operators as op
    import bytewax.operators.windowing as win
    from bytewax.dataflow import Dataflow
    from bytewax.recovery import RecoveryConfig, init_db_dir
    from bytewax.testing import TestingSink, TestingSource, run_main

    w = wa.build()
    items = [(r.key, r.timestamp, r.record_id, r.value) for r in w.records]
    out: list[Any] = []
    late: list[Any] = []
    flow = Dataflow("bench_count")
    stream = op.input("inp", flow, TestingSource(items, batch_size=batch))
    clock = win.EventClock(
        ts_getter=lambda x: datetime.fromtimestamp(x[1] / 1e6, tz=UTC),
        wait_for_system_duration=timedelta(seconds=5),
        now_getter=lambda: ALIGN,  # event time only: a replayed backlog must not age by wall clock
    )
    windower = win.TumblingWindower(length=timedelta(microseconds=WINDOW_US), align_to=ALIGN)
    counted = win.count_window("count", stream, clock, windower, key=lambda x: x[0])
    op.output("out", counted.down, TestingSink(out))
    op.output("late", counted.late, TestingSink(late))
    kwargs: dict[str, Any] = {"epoch_interval": timedelta(seconds=epoch_s)}
    tmp = None
    if recovery:
        tmp = tempfile.TemporaryDirectory(prefix="bench-bytewax-")
        init_db_dir(Path(tmp.name), 1)
        kwargs["recovery_config"] = RecoveryConfig(tmp.name)
    started = time.perf_counter()
    run_main(flow, **kwargs)
    elapsed = time.perf_counter() - started
    observed: Counter[tuple[str, int]] = Counter()
    for key, (window_id, count) in out:
        observed[(key, EPOCH_US + window_id * WINDOW_US)] += count
    # Bytewax keeps one event clock per key: a late record of a key not seen for a
    # while may still be on time for it. Expect exactly those to be counted, and
    # require that Bytewax dropped no record millwheel would count.
    dropped = {item[2] for _key, (_window_id, item) in late}
    wrongly_dropped = dropped - w.late_ids
    late_total = len(w.late_ids)
    w.late_ids = dropped & w.late_ids
    verdict = check(w, observed, len(dropped)).as_dict()
    if wrongly_dropped:
        verdict["ok"] = False
        verdict["detail"] += f"; {len(wrongly_dropped)} on-time records dropped as late"
    verdict["late_counted_by_per_key_clock"] = late_total - len(w.late_ids)
    snapshot_bytes = sum(p.stat().st_size for p in Path(tmp.name).glob("**/*") if p.is_file()) if tmp else 0
    if tmp is not None:
        tmp.cleanup()
    return {
        "records": w.size, "seconds": elapsed, "records_per_s": w.size / elapsed,
        "recovery": recovery, "epoch_s": epoch_s,
        "correct": verdict, "peak_rss_mb": peak_rss_mb(),
        "snapshot_bytes": snapshot_bytes,
    }
