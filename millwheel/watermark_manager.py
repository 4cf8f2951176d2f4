"""The low-watermark rule (MillWheel §4.4), in one place.

* input low watermark of A = min(output low watermark of every node upstream of A);
* output low watermark of A = min(input low watermark of A, oldest pending work of A),
  where pending work is productions checkpointed but not yet acked and event-time
  timers not yet fired (a window result produced by a timer is never late);
* an injector's output watermark = min(what its source reports, its pending sends);
* a watermark never goes backwards: each node keeps the max of what it computed.

Runners feed it holds and read watermarks back; the store keeps the reported
per-range values durably so a restart resumes from them.
"""

from __future__ import annotations

from typing import Mapping

from millwheel.nodes import injector_node, is_injector
from millwheel.record import MAX_TIMESTAMP, MIN_TIMESTAMP
from millwheel.topology import Topology


class WatermarkManager:
    def __init__(self, topology: Topology, restored: Mapping[str, int] | None = None) -> None:
        self._topology = topology
        self._order = _topological_order(topology)
        self._output: dict[str, int] = {node: MIN_TIMESTAMP for node in self._order}
        self._input: dict[str, int] = {}
        for node, wm in (restored or {}).items():
            if node in self._output:
                self._output[node] = wm

    def update(
        self, injector_reports: Mapping[str, int], holds: Mapping[str, int]
    ) -> dict[str, int]:
        """Recompute every node's watermark from source reports and pending-work holds.

        ``injector_reports`` maps injector node -> the watermark its source reports;
        ``holds`` maps node -> its oldest pending work (absent means none).
        Returns the output watermark of every node.
        """
        for node in self._order:
            if is_injector(node):
                computed = min(injector_reports.get(node, MIN_TIMESTAMP), holds.get(node, MAX_TIMESTAMP))
            else:
                upstream = self._topology.upstream(node)
                self._input[node] = max(
                    self._input.get(node, MIN_TIMESTAMP),
                    min((self._output[u] for u in upstream), default=MIN_TIMESTAMP),
                )
                computed = min(self._input[node], holds.get(node, MAX_TIMESTAMP))
            self._output[node] = max(self._output[node], computed)  # never backwards
        return dict(self._output)

    def input_watermark(self, computation: str) -> int:
        return self._input.get(computation, MIN_TIMESTAMP)

    def output_watermark(self, node: str) -> int:
        return self._output[node]

    @property
    def order(self) -> list[str]:
        """Injectors first, then computations upstream before downstream."""
        return list(self._order)


def _topological_order(topology: Topology) -> list[str]:
    order = [injector_node(inj.name) for inj in topology.injectors]
    placed = set(order)
    remaining = [spec.name for spec in topology.computations]
    while remaining:
        ready = [n for n in remaining if all(u in placed for u in topology.upstream(n))]
        if not ready:  # validate() rejects cycles; an unfed computation stays at MIN
            ready = remaining[:1]
        for name in ready:
            order.append(name)
            placed.add(name)
            remaining.remove(name)
    return order
