"""Key ranges the workers report they cannot run: the controller's view, for display.

A worker sends the whole list of its failing ranges (services/worker/failing.py) with
every heartbeat; the latest list per worker replaces the one before. A range shows
as failing (``ComputationInfo.failing_ranges``, ``RangeInfo.failure``, the console)
while its current owner reports it, so a range that moved, or whose owner died and
was reaped, stops showing at once. Nothing is stored: a new leader hears every
failing range again within a heartbeat.
"""

from __future__ import annotations

from typing import Collection, Iterable, Mapping

from ..generated import millwheel_pb2 as pb
from .assign import Owner

Unit = tuple[str, int]
MAX_PER_WORKER = 65_536  # no more than the ranges there are
MAX_MESSAGE_CHARS = 1000


class FailingRanges:
    def __init__(self) -> None:
        self._by_worker: dict[str, dict[Unit, pb.RangeFailure]] = {}

    def heard(self, worker_id: str, failing: Iterable[pb.RangeFailure], known: Collection[str]) -> None:
        """``worker_id``'s list with its latest heartbeat (replaced whole); the lists of
        workers no longer ``known`` are dropped."""
        for gone in [w for w in self._by_worker if w not in known and w != worker_id]:
            del self._by_worker[gone]
        now: dict[Unit, pb.RangeFailure] = {}
        for f in failing:
            if len(now) >= MAX_PER_WORKER:
                break
            copy = pb.RangeFailure()
            copy.CopyFrom(f)
            copy.worker_id = worker_id
            copy.message = f.message[:MAX_MESSAGE_CHARS]
            now[(f.node, f.range_id)] = copy
        if now:
            self._by_worker[worker_id] = now
        else:
            self._by_worker.pop(worker_id, None)

    def of(self, unit: Unit, owner: Owner | None) -> pb.RangeFailure | None:
        """The failure ``unit``'s current owner reports, if any."""
        if owner is None or not owner.worker_id:
            return None
        return self._by_worker.get(owner.worker_id, {}).get(unit)

    def of_node(self, node: str, owners: Mapping[Unit, Owner]) -> list[pb.RangeFailure]:
        """Every failing range of ``node`` (as its owners report), by range."""
        out = []
        for reports in list(self._by_worker.values()):
            for unit, f in reports.items():
                if unit[0] == node and self.of(unit, owners.get(unit)) is f:
                    out.append(f)
        return sorted(out, key=lambda f: f.range_id)
