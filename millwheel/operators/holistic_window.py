"""``window_aggregate`` with a holistic aggregation (exact ``percentile``, ``median``,
``count_distinct``, ``top_k``), computed in the worker, in Python.

Behaviour a user can rely on: the same windows, results and record IDs as the Spark
stage with the same parameters (``spark_aggregate``; rules in :mod:`millwheel.holistic`),
so the two are interchangeable and a benchmark compares only where the computing
happens. It is the Spark stage's own machinery (records appended to append-only window
buffers in their checkpoint, one end-of-window timer per key and window, results,
timer and buffer deletions in one checkpoint), with the due windows' buffers parsed
and aggregated here instead of in a Spark job. Hence, unlike the incremental
aggregations of ``window_aggregate``, a late record within ``allowed_lateness_us``
yields its corrected result at the next timer firing (several late records together,
one correction), as the Spark stage does.

Why not a running summary per key, as ``count``/``mean`` keep: an exact percentile,
a distinct count or a top k needs every value of the window, and rewriting a growing
list in the key's state at every checkpoint costs more per record the fuller the
window; an append-only buffer costs the same per record whatever the window holds.
"""

from __future__ import annotations

import time
from typing import Any

from millwheel import jsonvalue
from millwheel.computation import Computation, Context
from millwheel.holistic import HOLISTIC, check_params, compute
from millwheel.operators.aggregate import WindowedAggregate
from millwheel.spark.stage import SparkAggregate


class HolisticWindowAggregate(SparkAggregate):
    OPERATOR = "window_aggregate"

    def __init__(
        self,
        *,
        size_us: int,
        period_us: int | None = None,
        aggregation: str,
        field: str | None = None,
        p: float | None = None,
        k: int | None = None,
        by: str | None = None,
        output: str | None = None,
        allowed_lateness_us: int = 0,
    ) -> None:
        super().__init__(size_us=size_us, period_us=period_us, aggregation=aggregation, field=field,
                         p=p, k=k, by=by, output=output, allowed_lateness_us=allowed_lateness_us)
        self.name = "window_aggregate"

    def _run(self, ctx: Context, wanted: list[tuple[str, int]],
             legacy: dict[tuple[str, int], list[tuple[int, Any]]]) -> dict[tuple[str, int], Any]:
        """``(key, window_start) -> (value, records)`` for the due (key, window) pairs,
        from the windows' buffers: each buffer is parsed in one ``json.loads`` (its JSON
        lines made into one array: a newline only ever separates lines, as JSON text
        escapes it inside strings). Its time is counted in ``status["job_seconds"]``,
        as the Spark stage counts its jobs', so the two can be compared."""
        started = time.perf_counter()
        keys_of: dict[int, set[str]] = {}
        for key, start in wanted:
            keys_of.setdefault(start, set()).add(key)
        out: dict[tuple[str, int], Any] = {}
        for start, keys in keys_of.items():
            data = b"".join(ctx.read_buffer(str(start))).rstrip(b"\n")  # type: ignore[attr-defined]
            rows = jsonvalue.loads(b"[" + data.replace(b"\n", b",") + b"]") if data else []
            values: dict[str, list[Any]] = {key: [] for key in keys}
            for row in rows:
                found = values.get(row["key"])
                if found is not None:
                    found.append(row["value"])
            for key in keys:
                values[key].extend(v for _ts, v in legacy.get((key, start), ()))
            for key, vals in values.items():
                if vals:
                    out[(key, start)] = (self.reduce(vals), len(vals))
        self.status["jobs"] += 1
        self.status["windows"] += len(wanted)
        self.status["job_seconds"] += time.perf_counter() - started
        return out

    def reduce(self, values: list[Any]) -> Any:
        """One (key, window)'s result from its extracted values (a subclass may compute
        something else from the same buffered values, e.g. a benchmark's user code)."""
        agg = self.agg
        return compute(agg.name, values, frac=agg.frac, k=agg.k, by=agg.by)


def window_aggregate(**params: Any) -> Computation:
    """Factory behind the built-in ``window_aggregate``: incremental (a few numbers per
    key and window) for count, sum, min, max, mean; buffered for the holistic ones."""
    aggregation = params.get("aggregation", "count")
    if aggregation in HOLISTIC:
        return HolisticWindowAggregate(**params)
    check_params("window_aggregate", str(aggregation), params)  # no p/k/by here
    rest = {name: value for name, value in params.items() if name not in ("p", "k", "by")}
    return WindowedAggregate(**rest)
