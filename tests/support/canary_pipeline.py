"""A canary pipeline that must keep flowing while something else misbehaves.

    canary (injector) -> canary-in -> canary-count (window_aggregate: 1 s count) -> canary-counts (sink)

Each :meth:`Canary.round` injects records into a fresh stretch of event time, moves the
injector's watermark past it and waits until every window of that stretch is in the
sink with its exact count, once. A test runs rounds before, during and after the
misbehaviour it provokes: a round that times out is the service stopped for others.
"""

from __future__ import annotations

import json
import time
from collections import Counter

from services.client import ControllerClient
from services.generated import millwheel_pb2 as pb

SECOND = 1_000_000
T0 = 1_700_000_000_000_000
INJECTOR, STREAM, COMPUTATION, SINK = "canary", "canary-in", "canary-count", "canary-counts"


def canary_spec(key_ranges: int = 2) -> pb.ComputationSpec:
    return pb.ComputationSpec(
        name=COMPUTATION, inputs=[pb.InputStream(stream=STREAM)], outputs=[SINK],
        code=pb.Code(name="window_aggregate", params_json=json.dumps({"size_us": SECOND})),
        options=pb.Options(key_ranges=key_ranges))


class Canary:
    def __init__(self, client: ControllerClient, keys: int = 4, per_key: int = 10) -> None:
        self.client = client
        self.keys = keys
        self.per_key = per_key
        self.rounds = 0
        self.seconds: list[float] = []  # how long each round took, injection to last window

    def register(self) -> None:
        self.client.register_topology([canary_spec()], [(INJECTOR, STREAM)])

    def round(self, timeout_s: float = 60.0) -> float:
        """Inject one round and wait for every one of its windows; returns its seconds."""
        base = T0 + self.rounds * 1000 * SECOND
        self.rounds += 1
        records, want = [], Counter[tuple[str, int]]()
        for i in range(self.per_key):
            for k in range(self.keys):
                ts = base + i * 300_000 + k
                records.append(pb.Record(key=f"k{k}", value=b"1", timestamp=ts,
                                         id=f"canary-{self.rounds}-{k}-{i}"))
                want[(f"k{k}", ts - ts % SECOND)] += 1
        started = time.monotonic()
        self.client.inject([pb.InjectRequest(injector=INJECTOR, stream=STREAM, records=records),
                            pb.InjectRequest(injector=INJECTOR, stream=STREAM,
                                             watermark=base + 100 * SECOND)])
        injected = time.monotonic() - started  # said if the round fails: was it the call?
        deadline = started + timeout_s
        got: Counter[tuple[str, int]] = Counter()
        while time.monotonic() < deadline:
            got = self._windows(base, base + 1000 * SECOND)
            if got == want:
                took = time.monotonic() - started
                self.seconds.append(took)
                return took
            time.sleep(0.1)
        raise AssertionError(f"canary round {self.rounds}: after {timeout_s:.0f} s the sink holds "
                             f"{sorted(got.items())}, wanted {sorted(want.items())} "
                             f"(its Inject call took {injected:.1f} s); {self.describe()}")

    def describe(self) -> str:
        """The controller's view of the canary (its ranges' owners, alive or not, and
        watermarks), for a failure message: where did the round stop?"""
        try:
            status = self.client.status()
        except Exception as exc:  # noqa: BLE001 - a description, never a second failure
            return f"cluster status unavailable: {exc}"
        alive = {w.worker_id: w.alive for w in status.workers}
        ranges = [f"{r.node}/{r.range_id}@{r.worker_id}(alive={alive.get(r.worker_id)}, token {r.token}, "
                  f"watermark {r.watermark}, pending {r.pending}{', failing' if r.HasField('failure') else ''})"
                  for r in status.ranges if r.node in (COMPUTATION, f"injector:{INJECTOR}")]
        wms = [f"{w.node}: low {w.low_watermark} input {w.input_low_watermark}"
               for w in status.watermarks if w.node in (COMPUTATION, f"injector:{INJECTOR}")]
        return f"ranges {ranges}; watermarks {wms}; workers {sorted(alive.items())}"

    def _windows(self, lo: int, hi: int) -> Counter[tuple[str, int]]:
        """(key, window start) -> count, of the windows in [lo, hi) in the sink; a
        window delivered twice counts twice (and so fails the comparison)."""
        out: Counter[tuple[str, int]] = Counter()
        for _seq, rec in self.client.subscribe(SINK):
            w = json.loads(rec.value)
            if lo <= w["start"] < hi:
                out[(w["key"], w["start"])] += w["count"]
        return out
