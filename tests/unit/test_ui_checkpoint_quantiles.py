"""The console's checkpoint p50/p95: the histogram bucket a quantile of the checkpoints
since the last refresh falls in (the worker's /metrics has buckets, not samples)."""

from __future__ import annotations

from services.ui.graph import quantile_ms as _quantile_ms


def deltas(counts: dict[str, float]) -> dict[str, float]:
    return {"in": 0.0, "cp": counts.get("+Inf", 0.0), **{f"le:{k}": v for k, v in counts.items()}}


def test_quantiles_are_the_bound_of_the_bucket_they_fall_in() -> None:
    # 100 checkpoints: 60 under 1 ms, 35 more under 5 ms, 5 more under 50 ms
    d = deltas({"0.001": 60, "0.005": 95, "0.05": 100, "2.5": 100, "+Inf": 100})
    assert _quantile_ms(d, 0.5) == 1.0
    assert _quantile_ms(d, 0.95) == 5.0
    assert _quantile_ms(d, 0.99) == 50.0


def test_none_without_checkpoints_and_the_top_bound_above_it() -> None:
    assert _quantile_ms(deltas({"0.001": 0, "+Inf": 0}), 0.5) is None
    assert _quantile_ms({"in": 3.0}, 0.5) is None
    assert _quantile_ms(deltas({"0.001": 0, "2.5": 1, "+Inf": 10}), 0.95) == 2500.0
