"""Prometheus metrics of every service process: the one module importing prometheus_client.

:class:`PrometheusSensors` implements :class:`millwheel.sensors.Sensors` (the hooks the
core calls) plus the data-plane series only the service has (in-flight batches,
backpressure time). Each process exposes them over HTTP at ``/metrics``.
"""

from __future__ import annotations

import urllib.request
from collections import Counter as Counter_
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from millwheel.nodes import is_injector, sink_node

if TYPE_CHECKING:
    from millwheel.state.protocol import Production

#: A scraped sample: (sample name, sorted label pairs) -> value.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
#: (computation -> outcome -> count, worker id -> alive)
ControllerView = tuple[dict[str, dict[str, int]], dict[str, bool]]


class PrometheusSensors:
    def __init__(self, process: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # process_resident_memory_bytes, process_cpu_seconds_total, open fds (from /proc):
        # the console's workers table shows each worker's RSS and CPU from these.
        ProcessCollector(registry=r)
        self._in = Counter("millwheel_records_in_total", "Records received for processing",
                           ["computation"], registry=r)
        self._out = Counter("millwheel_records_out_total", "Records produced", ["computation"],
                            registry=r)
        self._dups = Counter("millwheel_duplicates_dropped_total",
                             "Records dropped as duplicates (already consumed)", ["computation"],
                             registry=r)
        # action: the late_policy applied (process: handed to user code, also within
        # allowed_lateness_us; drop; route); input: the stream they came on ("" not known)
        self._late = Counter("millwheel_late_records_total", "Records behind the input watermark, "
                             "by what became of them and the input stream they came on",
                             ["computation", "action", "input"], registry=r)
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
        self._refused = Counter("millwheel_admission_refused_total",
                                "Client calls refused with RESOURCE_EXHAUSTED by an admission limit "
                                "(the limit's flag, the method)", ["limit", "method"], registry=r)
        self._ranges = Gauge("millwheel_owned_ranges", "Key ranges this process owns", registry=r)
        self._sink_down = Gauge("millwheel_sink_down_seconds", "How long a sink this worker runs has "
                                "been failing to write (0: writing); its stream waits in the log", ["sink"],
                                registry=r)
        # Per stream edge (producer node, stream, consumer: a computation, or "log:STREAM"):
        # records the consumer acknowledged, counted once by the producer's worker when
        # the ack removes them from its outbox or a direct delivery is acked (never for a
        # refused or resent batch): the console's edge rates (services/ui/snapshot.py).
        self._delivered = Counter("millwheel_edge_records_total", "Records delivered on a stream edge "
                                  "and acknowledged by its consumer (producer node, stream, consumer)",
                                  ["producer", "stream", "consumer"], registry=r)
        self._sink_written = Counter("millwheel_sink_records_total", "Records a sink read from its stream's "
                                     "log and wrote out (a retry's skipped ones included)", ["sink"], registry=r)
        self._up = Gauge("millwheel_process_info", "Which millwheel process this is", ["process"],
                         registry=r)
        self._up.labels(process).set(1)
        self._leader: Gauge | None = None
        self._epoch: Gauge | None = None
        if process == "controller":
            self._leader = Gauge("millwheel_controller_leader", "1 while this controller leads "
                                 "(holds the store's lease), 0 while it stands by", registry=r)
            self._epoch = Gauge("millwheel_controller_leader_epoch", "The leader epoch this "
                                "controller last saw (+1 each time leadership changes hands)", registry=r)

    # -- millwheel.sensors.Sensors -------------------------------------------------
    def records_in(self, computation: str, count: int) -> None:
        if count:
            self._in.labels(computation).inc(count)

    def records_out(self, computation: str, count: int) -> None:
        if count:
            self._out.labels(computation).inc(count)

    def duplicates_dropped(self, computation: str, count: int) -> None:
        self._dups.labels(computation).inc(count)

    def late_records(self, computation: str, count: int, action: str, input: str = "") -> None:
        self._late.labels(computation, action, input).inc(count)

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

    def delivered(self, producer: str, productions: Iterable[Production]) -> None:
        """Count ``productions`` of ``producer`` as delivered: each consumer acked them."""
        counts = Counter_((p.stream, p.consumer) for p in productions)
        for (stream, consumer), n in counts.items():
            self._delivered.labels(producer, stream, consumer).inc(n)

    def admission_refused(self, limit: str, method: str) -> None:
        self._refused.labels(limit, method).inc()

    def sink(self, name: str, down_seconds: float, written: int) -> None:
        self._sink_down.labels(name).set(down_seconds)
        if written:
            self._sink_written.labels(name).inc(written)

    def owned_ranges(self, count: int) -> None:
        self._ranges.set(count)

    def controller_role(self, leading: bool, epoch: int) -> None:
        if self._leader is not None and self._epoch is not None:
            self._leader.set(1 if leading else 0)
            self._epoch.set(epoch)

    def controller_view(self, view: Callable[[], ControllerView]) -> None:
        """Series computed when scraped, from the controller's state (``view`` returns
        per computation its error counts by outcome, and per known worker whether it is
        alive): ``millwheel_error_records`` and ``millwheel_worker_up``. Only what is
        registered and known has a series, and nothing is computed unless scraped."""
        self.registry.register(_ControllerCollector(view))

    def keep_nodes(self, nodes: set[str]) -> None:
        """Drop every series labelled with a computation or node not in ``nodes`` (the
        registered ones; a sink's series go with its node ``sink:NAME``): a label exists
        only while its name is registered, so neither an unregistered name nor a refused
        request leaves series behind."""
        for metric in (self._in, self._out, self._dups, self._late, self._cp, self._fenced,
                       self._wm, self._lag, self._spark_jobs, self._spark_seconds,
                       self._spark_windows):
            for labels in list(getattr(metric, "_metrics", {})):
                if labels[0] not in nodes:
                    metric.remove(*labels)
        for labels in list(getattr(self._delivered, "_metrics", {})):  # (producer, stream, consumer)
            if labels[0] not in nodes or not (labels[2] in nodes or labels[2].startswith("log:")):
                self._delivered.remove(*labels)
        for metric in (self._sink_down, self._sink_written):  # a sink's name, kept while "sink:NAME" is
            for labels in list(getattr(metric, "_metrics", {})):
                if sink_node(labels[0]) not in nodes:
                    metric.remove(*labels)
        for metric in (self._backpressure, self._inflight, self._retries):  # a node, or an address
            for labels in list(getattr(metric, "_metrics", {})):
                if is_injector(labels[0]) and labels[0] not in nodes:
                    metric.remove(*labels)

    def forget_destination(self, destination: str) -> None:
        """Drop the series of a destination no longer sent to (a worker address that owns
        no range any more: a restarted worker comes back at another port)."""
        for metric in (self._backpressure, self._inflight, self._retries):
            for labels in list(getattr(metric, "_metrics", {})):
                if labels[0] == destination:
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


class _ControllerCollector(Collector):
    def __init__(self, view: Callable[[], ControllerView]) -> None:
        self.view = view

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (GaugeMetricFamily("millwheel_error_records", "Records whose user code failed, by "
                                  "outcome (dead_lettered, skipped, late_dropped: durable totals; "
                                  "retrying: items being retried now; failing_ranges: key ranges "
                                  "that cannot run now)", labels=["computation", "outcome"]),
                GaugeMetricFamily("millwheel_worker_up", "1 while the worker heartbeats, 0 once the "
                                  "controller declared it dead", labels=["worker"]))

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        errors, workers = self.view()
        err, up = self._families()
        for computation, counts in sorted(errors.items()):
            for outcome, n in sorted(counts.items()):
                err.add_metric([computation, outcome], n)
        for worker, alive in sorted(workers.items()):
            up.add_metric([worker], 1 if alive else 0)
        return iter((err, up))
