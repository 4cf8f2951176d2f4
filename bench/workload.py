"""The seeded benchmark workload and the exact answer it must produce.

A workload is a list of records in injection order with:

* record IDs ``r<i>`` (unique; exactly-once dedup works on them);
* keys drawn uniformly or Zipf(s=1.1) over ``keys`` distinct keys;
* event times advancing at ``density`` records per event-second, each up to 2 s out
  of order (the sources use a 2 s bounded-disorder watermark, so these are never
  late);
* about 1% *late* records, stamped 22-32 s behind their neighbours: far beyond the
  watermark whatever the batching, so every runner drops exactly these (the
  window stage runs with ``late_policy: drop``) and the expected counts are exact.

:func:`expected_counts` is computed from the workload alone, never from a run.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from dataclasses import dataclass, field

from millwheel.record import Record

SECOND = 1_000_000
WINDOW_US = 10 * SECOND
DISORDER_US = 2 * SECOND
EPOCH_US = 1_700_000_000 * SECOND  # a window boundary
LATE_MIN_US = DISORDER_US + 20 * SECOND
LATE_SPREAD_US = 10 * SECOND
LATE_WARMUP_US = 25 * SECOND  # no late records before this much event time
PAD = "x" * 48  # brings a value to ~100 bytes, the record size of every figure


@dataclass
class Workload:
    """Records in injection order plus what a correct run must output."""

    name: str
    records: list[Record]
    keys: int
    distribution: str
    late_ids: set[str] = field(default_factory=set)

    @property
    def size(self) -> int:
        return len(self.records)

    def record_bytes(self) -> float:
        """Mean size of key + value + ID, the payload every limit is measured with."""
        sample = self.records[:1000]
        return sum(len(r.key) + len(r.value) + len(r.record_id) for r in sample) / max(1, len(sample))


def key_names(keys: int) -> list[str]:
    return [f"k{i}" for i in range(keys)]


def generate(
    n: int,
    keys: int = 1000,
    distribution: str = "uniform",
    seed: int = 7,
    late_fraction: float = 0.01,
    density: int | None = None,
) -> Workload:
    """``n`` records over ``keys`` keys; same arguments, same records and IDs.

    ``density`` (records per event-second) defaults to ``n / 30`` within [500, 2000],
    so a workload spans several 10 s windows. The late records are late for any
    runner whose batches span less than ~16 s of event time (5000 records at the
    default density of any workload of 20k records or more).
    """
    if distribution not in ("uniform", "zipf"):
        raise ValueError(f"distribution must be 'uniform' or 'zipf', not {distribution!r}")
    rng = random.Random(seed)
    population = key_names(keys)
    if distribution == "zipf":
        cum = list(itertools.accumulate(1.0 / (k + 1) ** 1.1 for k in range(keys)))
        chosen = rng.choices(population, cum_weights=cum, k=n)
    else:
        chosen = rng.choices(population, k=n)
    dens = density or max(500, min(2000, n // 30))
    spacing = SECOND / dens
    eligible_from = int(LATE_WARMUP_US / spacing)
    p_late = late_fraction * n / max(1, n - eligible_from) if n > eligible_from else 0.0
    records: list[Record] = []
    late: set[str] = set()
    rand = rng.random
    for i, key in enumerate(chosen):
        base = EPOCH_US + int(i * spacing)
        rid = f"r{i}"
        if i >= eligible_from and rand() < p_late:
            ts = base - LATE_MIN_US - int(rand() * LATE_SPREAD_US)
            late.add(rid)
        else:
            ts = base - int(rand() * (DISORDER_US - 1))
        value = json.dumps({"k": key, "n": i, "p": PAD}, separators=(",", ":")).encode()
        records.append(Record(key, value, ts, rid))
    name = f"{distribution}-{keys // 1000}k-{n // 1000}k"
    return Workload(name, records, keys, distribution, late)


def expected_counts(workload: Workload) -> Counter[tuple[str, int]]:
    """(key, window start) -> count over every record that is not late."""
    counts: Counter[tuple[str, int]] = Counter()
    late = workload.late_ids
    for r in workload.records:
        if r.record_id not in late:
            counts[(r.key, r.timestamp - r.timestamp % WINDOW_US)] += 1
    return counts


@dataclass
class Verdict:
    ok: bool
    windows_expected: int
    windows_seen: int
    late_expected: int
    late_dropped: int | None
    detail: str

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok, "windows_expected": self.windows_expected, "windows_seen": self.windows_seen,
            "late_expected": self.late_expected, "late_dropped": self.late_dropped, "detail": self.detail,
        }


def check(
    workload: Workload, observed: Counter[tuple[str, int]], late_dropped: int | None = None
) -> Verdict:
    """Compare observed window counts (and the late-drop counter, if known) exactly."""
    expected = expected_counts(workload)
    problems = []
    missing = [k for k in expected if observed.get(k) != expected[k]]
    extra = [k for k in observed if k not in expected]
    if missing:
        k = missing[0]
        problems.append(f"{len(missing)} windows differ (first {k}: expected {expected[k]}, got {observed.get(k)})")
    if extra:
        problems.append(f"{len(extra)} unexpected windows (first {extra[0]})")
    if late_dropped is not None and late_dropped != len(workload.late_ids):
        problems.append(f"late records dropped {late_dropped}, expected {len(workload.late_ids)}")
    return Verdict(
        not problems, len(expected), len(observed), len(workload.late_ids), late_dropped,
        "; ".join(problems) or "exact",
    )
