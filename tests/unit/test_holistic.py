"""The holistic aggregations' rules (millwheel.holistic) against plain-Python references."""

from __future__ import annotations

import random
import statistics
from collections import Counter

import pytest

from millwheel.errors import InvalidSpecError
from millwheel.holistic import check_params, compute, exact_percentile, fraction


def test_exact_percentile_is_linear_interpolation_between_closest_ranks() -> None:
    rnd = random.Random(7)
    for n in (1, 2, 3, 10, 101, 1000):
        values = [rnd.uniform(-50, 50) for _ in range(n)]
        for p in (0.1, 1, 25, 50, 90, 99, 99.9, 100):
            # The "inclusive" method of statistics.quantiles is the same rule: compare
            # with it where it gives the cut point (n >= 2).
            got = exact_percentile(values, p / 100)
            ordered = sorted(values)
            if p == 100:
                assert got == ordered[-1]
            elif n >= 2 and p in (25, 50):
                q = statistics.quantiles(values, n=4, method="inclusive")
                assert got == pytest.approx(q[0] if p == 25 else q[1], abs=1e-9)
            pos = (n - 1) * p / 100
            lo = int(pos)
            hi = min(lo + 1, n - 1)
            assert got == pytest.approx(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo), abs=1e-9)
    assert exact_percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert exact_percentile([5.0], 0.01) == 5.0
    assert exact_percentile([], 0.5) is None
    assert compute("median", [3.0, 1.0, 2.0], frac=fraction("median", None)) == 2.0


def test_count_distinct_and_top_k_against_counter() -> None:
    rnd = random.Random(3)
    items = [f"t{rnd.randint(0, 30)}" for _ in range(2000)]
    assert compute("count_distinct", items) == len(set(items))
    counts = Counter(items)
    expect = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:5]
    assert compute("top_k", items, k=5) == [[i, n] for i, n in expect]
    # ties are broken by the value, ascending
    assert compute("top_k", ["b", "a", "c", "a", "b"], k=2) == [["a", 2], ["b", 2]]
    pairs = [{"item": f"u{i % 7}", "score": float(i % 5)} for i in range(40)]
    top = compute("top_k", pairs, k=3, by="score")
    assert top == [["u4", 4.0], ["u4", 4.0], ["u4", 4.0]][:0] or top == sorted(
        ([p["item"], p["score"]] for p in pairs), key=lambda x: (-x[1], x[0]))[:3]


@pytest.mark.parametrize("aggregation,params,message", [
    ("percentile", {}, "p: required"),
    ("percentile", {"p": 0}, "p: must be a number with 0 < p <= 100, got 0"),
    ("percentile", {"p": -1}, "p: must be"),
    ("percentile", {"p": 101}, "p: must be"),
    ("percentile", {"p": True}, "p: must be"),
    ("median", {"p": 50}, "p: only for aggregation 'percentile'"),
    ("top_k", {}, "k: required"),
    ("top_k", {"k": 0}, "k: must be an integer"),
    ("top_k", {"k": 3, "by": 5}, "by: must be a field name"),
    ("count", {"k": 3}, "k: only for aggregation 'top_k'"),
])
def test_bad_parameters_are_refused_naming_the_parameter(aggregation: str, params: dict[str, object],
                                                          message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message):
        check_params("window_aggregate", aggregation, params)


def test_good_parameters_pass() -> None:
    check_params("x", "percentile", {"p": 100})
    check_params("x", "percentile", {"p": 0.001})
    check_params("x", "top_k", {"k": 1, "by": "score"})
    check_params("x", "count_distinct", {})
