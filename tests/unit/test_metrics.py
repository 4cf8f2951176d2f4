"""The Prometheus exporter turns the core's sensor hooks into series a scraper reads."""

from __future__ import annotations

import urllib.request

from services.metrics import PrometheusSensors


def test_sensor_hooks_appear_on_the_metrics_endpoint() -> None:
    sensors = PrometheusSensors("worker-test")
    sensors.records_in("counts", 5)
    sensors.duplicates_dropped("counts", 2)
    sensors.late_records("counts", 1, "drop", "clicks")
    sensors.late_records("counts", 2, "process", "views")
    sensors.checkpoint("counts", 0.003, 5)
    sensors.fenced("counts", 3)
    sensors.watermark("counts", 1_700_000_000_000_000, 1_500_000)
    sensors.spark_job("spark_counts", "ok", 2.5, 12)
    sensors.spark_job("spark_counts", "retry", 1.0, 12)
    port = sensors.serve("127.0.0.1", 0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'millwheel_records_in_total{computation="counts"} 5.0' in text
    assert 'millwheel_duplicates_dropped_total{computation="counts"} 2.0' in text
    assert 'millwheel_late_records_total{action="drop",computation="counts",input="clicks"} 1.0' in text
    assert 'millwheel_late_records_total{action="process",computation="counts",input="views"} 2.0' in text
    assert 'millwheel_checkpoint_seconds_count{computation="counts"} 1.0' in text
    assert 'millwheel_fenced_writes_total{computation="counts"} 1.0' in text
    assert 'millwheel_watermark_lag_seconds{node="counts"} 1.5' in text
    assert 'millwheel_spark_jobs_total{computation="spark_counts",outcome="retry"} 1.0' in text
    assert 'millwheel_spark_windows_total{computation="spark_counts"} 12.0' in text


def test_a_sink_series_goes_when_its_sink_is_unregistered() -> None:
    """A worker keeps a sink's series only while ``sink:NAME`` is registered (before, the
    rows-written and down-seconds series of a removed sink stayed on /metrics for good)."""
    sensors = PrometheusSensors("worker-test")
    sensors.sink("orders.pg", 0.0, 7)
    sensors.sink("gone.redis", 3.5, 2)
    sensors.keep_nodes({"counts", "sink:orders.pg"})
    port = sensors.serve("127.0.0.1", 0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'millwheel_sink_records_total{sink="orders.pg"} 7.0' in text
    assert 'millwheel_sink_down_seconds{sink="orders.pg"} 0.0' in text
    assert "gone.redis" not in text
