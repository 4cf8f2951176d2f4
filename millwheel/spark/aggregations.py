"""What a Spark stage computes per (key, window): built-in aggregations or a user function.

Built-ins: ``count``, ``sum``, ``min``, ``max``, ``mean``, and the exact holistic
``percentile`` (with ``p``), ``median``, ``count_distinct`` and ``top_k`` (with ``k``,
optionally ``by``) whose rules :mod:`millwheel.holistic` defines (the same as the
in-process ``window_aggregate``); ``approx_count_distinct`` and ``approx_percentile``
(with ``percentile``). Numeric aggregations read the record's JSON value, or its ``field``.

A user ``function: pkg.module:fn`` receives a DataFrame of the window records with
columns ``key, window_start, window_end, timestamp, value`` (``value`` is the record's
value as text) and returns a DataFrame with ``key, window_start, value``; windows it
returns no row for produce nothing.

Values are extracted and validated when a record arrives (so a bad record fails on
that record, naming it) and stored as one JSON text per record.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from millwheel.errors import InvalidSpecError
from millwheel.holistic import HOLISTIC, check_params, fraction
from millwheel.importing import import_object

BUILTIN = ("count", "sum", "min", "max", "mean", *HOLISTIC, "approx_count_distinct", "approx_percentile")
NUMERIC = ("sum", "min", "max", "mean", "approx_percentile", "percentile", "median")


@dataclass(frozen=True)
class Group:
    """The records of one (key, window): ``(timestamp, stored JSON value)`` pairs."""

    key: str
    start: int
    end: int
    records: Sequence[tuple[int, Any]]


class Aggregation:
    def __init__(
        self,
        aggregation: str = "count",
        field: str | None = None,
        percentile: float = 0.5,
        function: str | None = None,
        p: float | None = None,
        k: int | None = None,
        by: str | None = None,
        operator: str = "spark_aggregate",
    ) -> None:
        self.function: Callable[[Any], Any] | None = None
        if function is not None:
            fn = import_object(function, what="spark_aggregate function")
            if not callable(fn):
                raise InvalidSpecError(f"spark_aggregate function {function!r} is not callable")
            self.function = fn
            self.label = function
        elif aggregation not in BUILTIN:
            raise InvalidSpecError(
                f"{operator}: aggregation {aggregation!r} not one of {BUILTIN} "
                "(or give 'function: pkg.module:fn')"
            )
        else:
            self.label = aggregation
            check_params(operator, aggregation, {"p": p, "k": k, "by": by})
        if not 0.0 <= float(percentile) <= 1.0:
            raise InvalidSpecError(f"spark_aggregate: percentile must be in [0, 1], got {percentile}")
        self.name = aggregation
        self.operator = operator
        self.field = field
        self.percentile = float(percentile)
        self.numeric = self.function is None and aggregation in NUMERIC
        self.frac = fraction(aggregation, p) if aggregation in ("percentile", "median") else 0.5
        self.k = int(k) if k is not None else 1
        self.by = by if self.function is None and aggregation == "top_k" else None
        self.value_type = "double" if self.numeric else "pair" if self.by is not None else "string"

    def extract(self, value: bytes, record_id: str) -> Any:
        """The part of a record value this aggregation needs (JSON-serialisable)."""
        if self.function is not None:
            return value.decode("utf-8", "replace")
        if self.name == "count":
            return None
        try:
            parsed: Any = json.loads(value)
            if self.field is not None:
                parsed = parsed[self.field]
        except (ValueError, KeyError, TypeError) as exc:
            if self.field is None and not self.numeric:
                return value.decode("utf-8", "replace")  # distinct count of raw text
            raise InvalidSpecError(self._bad(record_id, exc)) from None
        if self.by is not None:
            return self._pair(value, parsed, record_id)
        if not self.numeric:
            return parsed if isinstance(parsed, str) else json.dumps(parsed, sort_keys=True)
        try:
            return float(parsed)
        except (ValueError, TypeError) as exc:
            raise InvalidSpecError(self._bad(record_id, exc)) from None

    def _pair(self, value: bytes, item: Any, record_id: str) -> dict[str, Any]:
        """``top_k`` with ``by``: the item (the value or its ``field``, as text) and its score."""
        try:
            score = float(json.loads(value)[self.by])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidSpecError(
                f"{self.operator}: record {record_id} has no number at field {self.by!r} (by): {exc}") from None
        if not math.isfinite(score):
            raise InvalidSpecError(f"{self.operator}: record {record_id} field {self.by!r} (by) is {score}")
        return {"item": item if isinstance(item, str) else json.dumps(item, sort_keys=True), "score": score}

    def _bad(self, record_id: str, exc: Exception) -> str:
        where = f" at field {self.field!r}" if self.field else ""
        return f"{self.operator}: record {record_id} value is not usable for {self.name}{where}: {exc}"

    def compute(self, spark: Any, groups: Sequence[Group]) -> dict[tuple[str, int], Any]:
        """One Spark job over all groups: ``(key, window_start) -> value`` (backfill)."""
        from millwheel.spark.session import window_frame

        rows = [(g.key, g.start, g.end, ts, v) for g in groups for ts, v in g.records]
        return {k: v for k, (v, _n) in self.aggregate(window_frame(spark, rows, self.value_type)).items()}

    def aggregate(self, frame: Any) -> dict[tuple[str, int], tuple[Any, int]]:
        """One Spark job over a DataFrame of window records: ``(key, window_start) ->
        (value, records in the window)``."""
        from millwheel.spark.session import sql_functions

        F = sql_functions()
        counts = frame.groupBy("key", "window_start").agg(F.count(F.lit(1)).alias("n"))
        if self.function is not None:
            result = self.function(frame)
            try:
                selected = result.select("key", "window_start", "value")
            except Exception as exc:
                raise InvalidSpecError(
                    f"spark_aggregate function {self.label!r} must return a DataFrame with columns "
                    f"key, window_start, value: {exc.__class__.__name__}: {str(exc)[:200]}"
                ) from None
            joined = selected.join(counts, ["key", "window_start"], "inner")
            return {(r[0], int(r[1])): (to_json_value(r[2]), int(r[3]))
                    for r in joined.select("key", "window_start", "value", "n").collect()}
        if self.name == "top_k":
            return self._top_k(frame, F)
        expr = {
            "count": lambda: F.count(F.lit(1)),
            "sum": lambda: F.sum("value"),
            "min": lambda: F.min("value"),
            "max": lambda: F.max("value"),
            "mean": lambda: F.avg("value"),
            "approx_count_distinct": lambda: F.approx_count_distinct("value"),
            "approx_percentile": lambda: F.percentile_approx("value", self.percentile),
            "percentile": lambda: F.percentile("value", F.lit(self.frac)),
            "median": lambda: F.percentile("value", F.lit(self.frac)),
            "count_distinct": lambda: F.count_distinct("value"),
        }[self.name]()
        out = frame.groupBy("key", "window_start").agg(
            expr.alias("result"), F.count(F.lit(1)).alias("n")).collect()
        return {(r[0], int(r[1])): (to_json_value(r[2]), int(r[3])) for r in out}


    def _top_k(self, frame: Any, F: Any) -> dict[tuple[str, int], tuple[Any, int]]:
        """The k first per (key, window) by a window function on the executors (ties by
        item ascending), put in order on the driver (at most k rows per window)."""
        from millwheel.spark.session import sql_window

        counts = frame.groupBy("key", "window_start").agg(F.count(F.lit(1)).alias("n"))
        if self.by is not None:
            ranked = frame.select("key", "window_start", F.col("value.item").alias("item"),
                                  F.col("value.score").alias("score"))
        else:
            ranked = frame.groupBy("key", "window_start", F.col("value").alias("item")).agg(
                F.count(F.lit(1)).alias("score"))
        order = sql_window().partitionBy("key", "window_start").orderBy(F.col("score").desc(), F.col("item").asc())
        top = ranked.withColumn("rank", F.row_number().over(order)).where(F.col("rank") <= self.k)
        grouped = top.groupBy("key", "window_start").agg(
            F.collect_list(F.struct("score", "item")).alias("top")).join(counts, ["key", "window_start"])
        out: dict[tuple[str, int], tuple[Any, int]] = {}
        for r in grouped.select("key", "window_start", "top", "n").collect():
            pairs = sorted(((row["item"], row["score"]) for row in r[2]), key=lambda p: (-p[1], p[0]))
            value = [[item, float(score) if self.by is not None else int(score)] for item, score in pairs]
            out[(r[0], int(r[1]))] = (value, int(r[3]))
        return out


def to_json_value(value: Any) -> Any:
    """Spark Row values (rows, lists, dicts, numbers) as plain JSON-able Python."""
    if hasattr(value, "asDict"):
        return {k: to_json_value(v) for k, v in value.asDict().items()}
    if isinstance(value, dict):
        return {str(k): to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
