"""Holistic window aggregations: exact ``percentile``, ``median``, ``count_distinct``
and ``top_k``, defined once for the Spark stage and the in-process ``window_aggregate``.

They need every value of a window (no fixed-size running summary), so both paths
buffer the window's records (append-only window buffers) and compute when it fires:
the Spark stage with Spark SQL functions on the executors, ``window_aggregate`` in
Python in the worker. The rules below are the contract both follow, so the two give
the same JSON result for the same records:

* ``percentile`` (parameter ``p`` in (0, 100]) and ``median`` (``p`` = 50): exact, by
  linear interpolation between the two closest ranks, as Spark's ``percentile``: with
  the window's n values sorted ascending, ``pos = (n - 1) * p / 100``,
  ``lo = floor(pos)``, ``hi = ceil(pos)``; the result is ``v[lo]`` when ``lo == hi`` or
  ``v[lo] == v[hi]``, else ``v[lo] + (v[hi] - v[lo]) * (pos - lo)`` (a float; this
  order of operations is Spark 4's, so the two agree to the last bit: measured on
  random data, the textbook ``(hi - pos) * v[lo] + (pos - lo) * v[hi]`` differs from
  Spark's result in the last digit for ~15% of windows).
* ``count_distinct``: the exact number of distinct values (values compared as the
  JSON text of the value or its ``field``, so ``1`` and ``1.0`` differ).
* ``top_k`` (parameter ``k`` >= 1): without ``by``, the k most frequent values, as
  ``[[value, count], ...]`` by count descending, ties by value ascending (code point
  order, the same as Spark's byte order of UTF-8); with ``by`` (a numeric field), the
  k records with the largest ``by``, as ``[[value, by], ...]`` by ``by`` descending,
  ties by value ascending.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from millwheel.errors import InvalidSpecError

HOLISTIC = ("percentile", "median", "count_distinct", "top_k")
MAX_TOP_K = 10_000  #: a result is one record: k pairs must fit in it comfortably


def check_params(operator: str, aggregation: str, params: Mapping[str, Any]) -> None:
    """InvalidSpecError naming the parameter unless ``p``/``k``/``by`` fit ``aggregation``:
    ``p`` only for (and required by) ``percentile``, ``k`` only for (and required by)
    ``top_k``, ``by`` only for ``top_k``."""
    p, k, by = params.get("p"), params.get("k"), params.get("by")
    if aggregation == "percentile":
        if p is None:
            raise InvalidSpecError(f"{operator}: p: required by aggregation 'percentile' (0 < p <= 100)")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 100:
            raise InvalidSpecError(f"{operator}: p: must be a number with 0 < p <= 100, got {p!r}")
    elif p is not None:
        raise InvalidSpecError(f"{operator}: p: only for aggregation 'percentile', not {aggregation!r}")
    if aggregation == "top_k":
        if k is None:
            raise InvalidSpecError(f"{operator}: k: required by aggregation 'top_k' (k >= 1)")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_TOP_K:
            raise InvalidSpecError(f"{operator}: k: must be an integer with 1 <= k <= {MAX_TOP_K}, got {k!r}")
        if by is not None and not isinstance(by, str):
            raise InvalidSpecError(f"{operator}: by: must be a field name (a string), got {by!r}")
    else:
        for name, value in (("k", k), ("by", by)):
            if value is not None:
                raise InvalidSpecError(f"{operator}: {name}: only for aggregation 'top_k', not {aggregation!r}")


def fraction(aggregation: str, p: float | None) -> float:
    """The percentile as a fraction in (0, 1], computed once here for both paths."""
    return 0.5 if aggregation == "median" else float(p) / 100.0  # type: ignore[arg-type]


def exact_percentile(values: Sequence[float], frac: float) -> float | None:
    """The module docstring's rule (Spark's ``percentile``); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * frac
    lo, hi = math.floor(pos), math.ceil(pos)
    low = ordered[lo]
    if lo == hi:
        return float(low)
    high = ordered[hi]
    if low == high:
        return float(low)
    return low + (high - low) * (pos - lo)


def top_frequent(items: Sequence[str], k: int) -> list[list[Any]]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    return [[item, n] for item, n in ranked]


def top_by(pairs: Sequence[tuple[str, float]], k: int) -> list[list[Any]]:
    ranked = sorted(pairs, key=lambda pair: (-pair[1], pair[0]))[:k]
    return [[item, float(score)] for item, score in ranked]


def compute(aggregation: str, values: Sequence[Any], *, frac: float = 0.5, k: int = 1,
            by: str | None = None) -> Any:
    """The result of ``aggregation`` over one window's extracted values (as
    :meth:`millwheel.spark.aggregations.Aggregation.extract` makes them)."""
    if aggregation in ("percentile", "median"):
        return exact_percentile(values, frac)
    if aggregation == "count_distinct":
        return len(set(values))
    if aggregation == "top_k":
        if by is not None:
            return top_by([(v["item"], v["score"]) for v in values], k)
        return top_frequent(values, k)
    raise InvalidSpecError(f"not a holistic aggregation: {aggregation!r}")
