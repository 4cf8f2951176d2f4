"""Prometheus metrics of every service process: the one module importing prometheus_client.

:class:`PrometheusSensors` implements :class:`millwheel.sensors.Sensors` (the hooks the
core calls) plus the data-plane series only the service has (in-flight batches,
backpressure time). Each process exposes them over HTTP at ``/metrics``.
"""

from __future__ import annotations

import urllib.request

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.parser import text_string_to_metric_families

#: A scraped sample: (sample name, sorted label pairs) -> value.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class PrometheusSensors:
    def __init__(self, process: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._in = Counter("millwheel_records_in_total", "Records received for processing",
                           ["computation"], registry=r)
        self._out = Counter("millwheel_records_out_total", "Records produced", ["computation"],
                            registry=r)
        self._dups = Counter("millwheel_duplicates_dropped_total",
                             "Records dropped as duplicates (already consumed)", ["computation"],
                             registry=r)
        self._late = Counter("millwheel_late_records_total", "Records behind the input watermark",
                             ["computation", "action"], registry=r)
        self._cp = Histogram("millwheel_checkpoint_seconds", "Checkpoint latency in seconds",
                             ["computation"], registry=r,
                             buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self._fenced = Counter("millwheel_fenced_writes_total",
                               "Writes rejected because the sequencer token was no longer current",
                               ["computation"], registry=r)
        self._wm = Gauge("millwheel_low_watermark_us", "Low watermark, microseconds since the epoch",
                         ["node"], registry=r)
        self._lag = Gauge("millwheel_watermark_lag_seconds",
                          "Processing time minus low watermark, seconds", ["node"], registry=r)
        self._inflight = Gauge("millwheel_inflight_batches",
                               "Batches sent to a destination and not yet acked", ["destination"],
                               registry=r)
        self._backpressure = Counter("millwheel_backpressure_seconds_total",
                                     "Time senders waited for in-flight room at a destination",
                                     ["destination"], registry=r)
        self._retries = Counter("millwheel_delivery_retries_total",
                                "Batches retried after a failed or refused delivery", ["destination"],
                                registry=r)
        self._spark_jobs = Counter("millwheel_spark_jobs_total",
                                   "Spark stage jobs by outcome (ok, retry, failed)",
                                   ["computation", "outcome"], registry=r)
        self._spark_seconds = Histogram("millwheel_spark_job_seconds", "Spark stage job duration in seconds",
                                        ["computation"], registry=r,
                                        buckets=(.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self._spark_windows = Counter("millwheel_spark_windows_total",
                                      "Windows whose results a Spark job produced", ["computation"],
                                      registry=r)
        self._ranges = Gauge("millwheel_owned_ranges", "Key ranges this process owns", registry=r)
        # The controller's view (set by its console's snapshot thread, services/ui).
        self._errors = Gauge("millwheel_error_records", "Records whose user code failed, by outcome "
                             "(dead_lettered, skipped, late_dropped: durable totals; retrying: now)",
                             ["computation", "outcome"], registry=r)
        self._worker_up = Gauge("millwheel_worker_up", "1 while the worker heartbeats, 0 once "
                                "declared dead", ["worker"], registry=r)
        self._up = Gauge("millwheel_process_info", "Which millwheel process this is", ["process"],
                         registry=r)
        self._up.labels(process).set(1)

    # -- millwheel.sensors.Sensors -------------------------------------------------
    def records_in(self, computation: str, count: int) -> None:
        if count:
            self._in.labels(computation).inc(count)

    def records_out(self, computation: str, count: int) -> None:
        if count:
            self._out.labels(computation).inc(count)

    def duplicates_dropped(self, computation: str, count: int) -> None:
        self._dups.labels(computation).inc(count)

    def late_records(self, computation: str, count: int, action: str) -> None:
        self._late.labels(computation, action).inc(count)

    def checkpoint(self, computation: str, seconds: float, records: int) -> None:
        self._cp.labels(computation).observe(seconds)

    def fenced(self, computation: str, range_id: int) -> None:
        self._fenced.labels(computation).inc()

    def watermark(self, node: str, watermark: int, lag_us: int) -> None:
        self._wm.labels(node).set(watermark)
        self._lag.labels(node).set(max(lag_us, 0) / 1e6)

    def spark_job(self, computation: str, outcome: str, seconds: float, windows: int) -> None:
        self._spark_jobs.labels(computation, outcome).inc()
        if outcome == "ok":
            self._spark_seconds.labels(computation).observe(seconds)
            self._spark_windows.labels(computation).inc(windows)

    # -- the service's own series --------------------------------------------------
    def inflight(self, destination: str, count: int) -> None:
        self._inflight.labels(destination).set(count)

    def backpressure(self, destination: str, seconds: float) -> None:
        self._backpressure.labels(destination).inc(seconds)

    def retry(self, destination: str) -> None:
        self._retries.labels(destination).inc()

    def owned_ranges(self, count: int) -> None:
        self._ranges.set(count)

    def error_counts(self, computation: str, counts: dict[str, int]) -> None:
        for outcome, n in counts.items():
            self._errors.labels(computation, outcome).set(n)

    def workers_up(self, alive: dict[str, bool]) -> None:
        """One series per known worker (forgotten workers lose theirs)."""
        for labels in list(getattr(self._worker_up, "_metrics", {})):
            if labels[0] not in alive:
                self._worker_up.remove(*labels)
        for wid, up in alive.items():
            self._worker_up.labels(wid).set(1 if up else 0)

    def keep_nodes(self, nodes: set[str]) -> None:
        """Drop every series labelled with a computation or node not in ``nodes`` (the
        registered ones): a label exists only while its name is registered, so neither
        an unregistered name nor a refused request leaves series behind."""
        for metric in (self._in, self._out, self._dups, self._late, self._cp, self._fenced,
                       self._wm, self._lag, self._spark_jobs, self._spark_seconds,
                       self._spark_windows, self._errors):
            for labels in list(getattr(metric, "_metrics", {})):
                if labels[0] not in nodes:
                    metric.remove(*labels)
        for metric in (self._backpressure, self._inflight, self._retries):  # a node, or an address
            for labels in list(getattr(metric, "_metrics", {})):
                if labels[0].startswith("injector:") and labels[0] not in nodes:
                    metric.remove(*labels)

    def sample(self, name: str, labels: dict[str, str]) -> float | None:
        """This process's current value of one sample (None if it has none)."""
        return self.registry.get_sample_value(name, labels)

    def serve(self, host: str, port: int) -> int:
        """Expose ``/metrics`` over HTTP; ``port`` 0 picks a free port. Returns the port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)


def scrape(address: str, timeout_s: float = 0.5) -> Samples:
    """The samples another process serves at ``http://ADDRESS/metrics`` (the console
    reads workers' throughput this way); an unreachable process raises OSError."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as resp:  # noqa: S310
        text = resp.read(4 * 1024 * 1024).decode("utf-8", "replace")
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out
